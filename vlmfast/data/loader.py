"""The training loader: yields whole per-rank optimizer batches forever and can resume mid-epoch exactly.

A sample that cannot be read, does not fit its batch (other keys, another shape) or fails the host-side checks
(``data.check_samples``: integer ids within the vocabulary, finite pixels) is dropped from the batch and counted, up
to ``data.max_bad_sample_fraction``; then the error names it (``vlmfast.data.bad_samples``).

With ``micro_batch_size`` the loader yields each batch as a :class:`~vlmfast.data.micro_batches.SampleBatch`: the
samples plus their micro-batches, already collated by ``collate_fn`` in the loader workers (off the training thread).
When the trainer asks for another size (the OOM fallback), that batch is collated again once and the workers are
told the new size through shared memory, so the batches they collate next come at it.

Usage::

    loader = ResumableLoader(dataset, batch_size=16, spec=DataSpec(num_workers="auto"), seed=0, collate_fn=collate)
    batch = next(loader)                       # loader.state_dict() -> {"epoch": 0, "batch_in_epoch": 1}
    loader = ResumableLoader(dataset, 16, DataSpec(), 0, collate, micro_batch_size=4)   # yields SampleBatch
    loader.autotune.reason                     # with num_workers auto: the choice and why (also logged)
    loader.sample_counts()                     # {"samples": 120, "bad": 1}
    loader.fingerprint()                       # {"length": 120, "samples_sha": ..., "batch_size": 16, ...}

A batch that takes longer than ``data.timeout_s`` to load raises :class:`~vlmfast.data.timeout.DataLoaderTimeoutError`
naming the batch's sample indices (and the worker); without worker processes the batch is loaded in a background
thread so that the caller is never the one stuck (see vlmfast.data.timeout).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from vlmfast.data.autotune import AutotuneResult, autotune_num_workers
from vlmfast.data.bad_samples import BadSampleCounts, CheckedCollate, IndexedDataset
from vlmfast.data.fingerprint import data_fingerprint
from vlmfast.data.micro_batches import SampleBatch, SampleCollate
from vlmfast.data.rank_balance import CostModel, RankBalancedBatchSampler, sample_metadata
from vlmfast.data.run_batches import RunBatches
from vlmfast.data.sample_checks import SampleCheck
from vlmfast.data.samplers import LengthGroupedSampler, check_groupable, dataset_lengths
from vlmfast.data.timeout import DataLoaderTimeoutError, LoaderThread, timeout_message, wait_for
from vlmfast.spec import DataSpec
from vlmfast.train.interrupt import stop_signals_blocked, worker_ignores_stop_signals

log = logging.getLogger(__name__)


class EpochSampler(Sampler[int]):
    """A seeded per-epoch permutation, sharded across ranks, that can start at any batch of the epoch."""

    def __init__(self, num_samples: int, seed: int, shuffle: bool, rank: int = 0, world_size: int = 1) -> None:
        self.num_samples = num_samples
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.epoch = 0
        self.start = 0  # samples of this rank's shard already consumed

    def set_position(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start

    def _indices(self) -> list[int]:
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)
            order = torch.randperm(self.num_samples, generator=generator).tolist()
        else:
            order = list(range(self.num_samples))
        per_rank = self.num_samples // self.world_size  # equal shards: no rank waits on another at epoch end
        # Strided (as DistributedSampler): step k's batches over all ranks are exactly the samples one process
        # with world_size x batch_size would take at step k, so a DDP run matches a single-process run.
        return order[self.rank::self.world_size][:per_rank]

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices()[self.start:])

    def __len__(self) -> int:
        return self.num_samples // self.world_size - self.start


class ResumableLoader:
    """Wraps a Dataset (map-style or iterable) or a user DataLoader; tracks (epoch, batch) for exact resume.

    Map-style datasets resume by starting the sampler mid-epoch (no batch is loaded twice). Iterable datasets and
    user DataLoaders resume by skipping the batches already consumed in the epoch, which is exact only if their
    order is deterministic. With ``micro_batch_size``, batches of a Dataset come as samples with collated
    micro-batches (see the module docstring); a user DataLoader's batches come as it collates them.
    """

    def __init__(
        self,
        data: Dataset | DataLoader,
        batch_size: int,
        spec: DataSpec,
        seed: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        rank: int = 0,
        world_size: int = 1,
        sample_check: SampleCheck | None = None,
        micro_batch_size: int | None = None,
        cost_model: CostModel | None = None,
        step_seconds: Callable[[], float | None] | None = None,
    ) -> None:
        """`sample_check`: the host-side checks of every batch (data.check_samples; default: without the model's
        vocabulary, so ids are not range-checked: the trainer passes ``SampleCheck.for_model``). `step_seconds`: with
        num_workers auto, an estimate of the training step's time (called once, before any worker starts): the
        fewest workers that keep up with it are chosen."""
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        # One shared cell: the trainer's size reaches the worker processes, whose collate reads it per batch.
        self._micro_batch_size = torch.tensor([micro_batch_size or 0], dtype=torch.int64).share_memory_()
        self.epoch = 0
        self.batch_in_epoch = 0
        self._iterator: Iterator[Any] | None = None
        self._run: RunBatches | None = None  # a Dataset's batches: the whole run in one DataLoader iteration
        self._limit: int | None = None  # batches the run still needs (start()); none loaded past them
        self._delivered = 0  # batches handed out since start()
        self._per_epoch = 1  # batches per epoch of a Dataset (the position rolls over after them)
        self._drop_last = spec.drop_last
        self.sampler: EpochSampler | LengthGroupedSampler | RankBalancedBatchSampler | None = None
        self.autotune: AutotuneResult | None = None  # with num_workers auto: the measured choice and why
        self.bad_samples = BadSampleCounts()  # samples read / bad ones skipped (a user DataLoader's: not seen)
        self.data, self.world_size, self.timeout_s = data, world_size, spec.timeout_s
        self._sampler_settings = {"batch_size": batch_size, "shuffle": spec.shuffle, "seed": seed,
                                  "drop_last": spec.drop_last, "world_size": world_size,
                                  "group_by_length": spec.group_by_length}
        self._fingerprint: dict[str, Any] | None = None
        # data.timeout_s without worker processes: loads run in this thread, the caller waits with the timeout
        self._thread: LoaderThread | None = None
        self._progress = 0.0  # when the last underlying batch arrived (a resume's skipped batches count as progress)
        self._failed: DataLoaderTimeoutError | None = None
        check_groupable(data, spec.group_by_length)  # a stream or a user DataLoader cannot be reordered
        if isinstance(data, DataLoader):
            if data.batch_size is not None and data.batch_size != batch_size:
                raise ValueError(f"the DataLoader yields batches of {data.batch_size} but batch_size is {batch_size}: "
                                 "set batch_size to match, or pass the Dataset and let vlmfast build the loader")
            self.loader = data
            if data.num_workers > 0 and getattr(data.worker_init_fn, "func", None) is not worker_ignores_stop_signals:
                # Stop signals are the main process's: a scheduler's SIGTERM to the group must not kill workers.
                data.worker_init_fn = functools.partial(worker_ignores_stop_signals, init=data.worker_init_fn,
                                                        main_pid=os.getpid())
            if data.num_workers > 0 and not data.persistent_workers:
                log.warning("the DataLoader's %d workers are started again at every epoch: each start forks the "
                            "training process and stalls the step; pass persistent_workers=True to the DataLoader, "
                            "or pass the Dataset and let vlmfast load it (its workers start once)", data.num_workers)
            if world_size > 1 and not hasattr(data.sampler, "set_epoch"):
                log.warning("%d ranks share a user DataLoader without a DistributedSampler: every rank may see the "
                            "same batches; pass the Dataset instead and vlmfast shards it", world_size)
            if data.num_workers > 0 and not data.timeout and spec.timeout_s:
                data.timeout = spec.timeout_s  # the DataLoader's own timeout covers its workers
            self._watch_loads(data.num_workers)
            return
        stream = isinstance(data, IterableDataset)
        # Bad samples (unreadable, wrong keys or shapes) are dropped from their batch and counted, or named in an error.
        check = None if spec.check_samples == "off" else sample_check or SampleCheck()
        collate = SampleCollate(collate_fn, self._micro_batch_size) if micro_batch_size else collate_fn
        checked = CheckedCollate(collate, self.bad_samples, spec.max_bad_sample_fraction, indexed=not stream,
                                 check=check, check_mode=spec.check_samples)
        source = data if stream else IndexedDataset(data, seed=seed)  # per-sample seeds in workers
        if stream:
            self._configure_stream(data, spec, world_size)
            sampler, generator = None, None
        else:
            num_samples = len(data)  # type: ignore[arg-type]
            if num_samples // world_size < batch_size:
                raise ValueError(f"the dataset has {num_samples} samples, fewer than batch_size {batch_size} per "
                                 f"rank ({world_size} rank(s)): lower batch_size or add data")
            if spec.rank_balance != "off" and world_size > 1:  # each global batch dealt by the samples' costs
                tokens, images = sample_metadata(data)
                model = cost_model if spec.rank_balance == "cost" and cost_model is not None else CostModel()
                grouping = spec.group_by_length  # grouping forms the global batches, the deal splits them
                self.sampler = sampler = RankBalancedBatchSampler(
                    model.costs(tokens, images), batch_size, seed, spec.shuffle, rank, world_size,
                    group_lengths=None if grouping == "none" else dataset_lengths(data, grouping), group_mode=grouping)
            elif spec.group_by_length != "none":  # batches of similar length, the longest first
                self.sampler = sampler = LengthGroupedSampler(
                    dataset_lengths(data, spec.group_by_length), batch_size, seed, spec.shuffle, rank, world_size,
                    mode=spec.group_by_length)
            else:
                self.sampler = sampler = EpochSampler(num_samples, seed, spec.shuffle, rank, world_size)
            generator = torch.Generator().manual_seed(seed)  # deterministic worker seeds
            self._drop_last = spec.drop_last or isinstance(sampler, RankBalancedBatchSampler)
            self._run = RunBatches(sampler, batch_size, spec.drop_last,
                                   yields_batches=isinstance(sampler, RankBalancedBatchSampler))
            self._per_epoch = self.batches_per_epoch(num_samples) or 1

        def build(num_workers: int, persistent: bool = spec.persistent_workers) -> DataLoader:
            kwargs = _loader_kwargs(spec, pin_memory, num_workers, persistent)
            if self._run is not None:  # the run's batches, epoch after epoch, in one iteration (see run_batches.py)
                return DataLoader(source, batch_sampler=self._run, collate_fn=checked, generator=generator, **kwargs)
            return DataLoader(source, batch_size=batch_size, collate_fn=checked, drop_last=spec.drop_last, **kwargs)

        num_workers = spec.num_workers
        if num_workers == "auto":
            step_s = step_seconds() if step_seconds is not None else None
            self.autotune = autotune_num_workers(lambda n: build(n, persistent=False), spec.autotune_budget_s,
                                                 spec.autotune_max_workers, step_s=step_s)
            num_workers = self.autotune.num_workers
            if hasattr(data, "reset_counts"):  # the measurement's reads are not part of training
                data.reset_counts()
            self.bad_samples.reset()
        self.loader = build(num_workers)
        self._watch_loads(num_workers)

    def _watch_loads(self, num_workers: int) -> None:
        """Without workers, batches load in a background thread and the caller waits data.timeout_s at most."""
        if num_workers == 0 and self.timeout_s:
            self._thread = LoaderThread("vlmfast-loader")

    def take_over_timeout(self) -> float | None:
        """For a caller that loads from its own background thread (device prefetch): stop loading in a thread of
        this loader's and return the timeout the caller must enforce (None: the DataLoader's workers enforce it)."""
        if self._thread is None:
            return None
        self._thread.shutdown()
        self._thread = None
        return self.timeout_s

    @staticmethod
    def _configure_stream(data: IterableDataset, spec: DataSpec, world_size: int) -> None:
        if world_size > 1 and not getattr(data, "splits_by_rank", False):
            log.warning("an IterableDataset must shard itself by rank (torch.distributed.get_rank()); "
                        "vlmfast cannot split a stream it does not index (vlmfast.data.shards does)")
        if getattr(data, "max_bad_fraction", 0) is None:  # shard readers take the spec's threshold unless given one
            data.max_bad_fraction = spec.max_bad_sample_fraction

    def __iter__(self) -> ResumableLoader:
        return self

    def __next__(self) -> Any:
        if self._failed is not None:  # a load is stuck (abandoned in its thread, or a worker): no more batches
            raise self._failed
        if self._thread is None:
            return self._next()
        self._progress = time.monotonic()
        try:
            return wait_for(self._thread.submit(self._next), self.timeout_s, self.describe_pending,
                            progress=lambda: self._progress)
        except DataLoaderTimeoutError as exc:
            self._failed = exc
            raise

    def start(self, batches: int | None = None) -> None:
        """Start loading now, in the calling thread (worker processes start here, before any step, never from a
        prefetch thread or mid-run), the next `batches` batches and no more (None: no end). After them the loader
        raises StopIteration until ``close()``, ``load_state_dict()`` or another ``start()``.

        Usage: ``loader.start(spec.max_steps - state.step)`` after a resume has set the position."""
        self._close_iterator()
        self._limit, self._delivered = batches, 0
        self._iterator = self._start_run() if self._run is not None else self._start_epoch()

    def _next(self) -> Any:
        if self._run is None:
            return self._next_of_epochs()
        if self._limit is not None and self._delivered >= self._limit:
            raise StopIteration  # the run has what it needs: nothing is read past it
        if self._iterator is None:
            self._iterator = self._start_run()
        try:
            batch = self._receive()
        except StopIteration:
            self._iterator = None
            raise RuntimeError("the training data yielded no batch in a whole epoch: is it empty, or smaller than "
                               "batch_size with drop_last?") from None
        if self.batch_in_epoch >= self._per_epoch:  # the position rolls over when the next epoch's first
            self.epoch, self.batch_in_epoch = self.epoch + 1, 0  # batch is handed out (as a per-epoch iteration's)
        self._delivered += 1
        return self._handed_out(batch)

    def _start_run(self) -> Iterator[Any]:
        assert self._run is not None
        left = None if self._limit is None else self._limit - self._delivered
        self._run.start_at(self.epoch, self.batch_in_epoch, left)
        with stop_signals_blocked():  # new workers start with SIGTERM/SIGINT blocked (see vlmfast.train.interrupt)
            return iter(self.loader)

    def _next_of_epochs(self) -> Any:
        """A stream or a user DataLoader: one iteration per epoch (their workers persist across epochs by default)."""
        for _ in range(2):  # at most one epoch boundary per call
            if self._iterator is None:
                self._iterator = self._start_epoch()
            try:
                batch = self._receive()
            except StopIteration:
                self._iterator = None
                self.epoch += 1
                self.batch_in_epoch = 0
                continue
            return self._handed_out(batch)
        raise RuntimeError("the training data yielded no batch in a whole epoch: is it empty, or smaller than "
                           "batch_size with drop_last?")

    def _receive(self) -> Any:
        assert self._iterator is not None
        try:
            return next(self._iterator)
        except RuntimeError as exc:  # a worker's batch did not come within the DataLoader's timeout
            if "DataLoader timed out" not in str(exc):
                raise
            self._failed = DataLoaderTimeoutError(timeout_message(self.timeout_s or self.loader.timeout,
                                                                  self.describe_pending()))
            raise self._failed from exc

    def _handed_out(self, batch: Any) -> Any:
        self.batch_in_epoch += 1
        if isinstance(batch, SampleBatch):  # not pickled with every batch: attached on this side
            batch.collate_fn, batch.on_resize = self.collate_fn, self.set_micro_batch_size
        return batch

    def _start_epoch(self) -> Iterator[Any]:
        for source in (self.loader.sampler, self.loader.dataset):  # DistributedSampler, shard readers
            if hasattr(source, "set_epoch"):
                source.set_epoch(self.epoch)
        with stop_signals_blocked():
            iterator = iter(self.loader)
        if self.batch_in_epoch:
            log.warning("resuming by skipping %d already-seen batches of epoch %d (exact only if the data order is "
                        "deterministic)", self.batch_in_epoch, self.epoch)
            for _ in range(self.batch_in_epoch):
                next(iterator)
                self._progress = time.monotonic()  # each skipped batch is progress (data.timeout_s is per batch)
        return iterator

    def describe_pending(self) -> str:
        """The batch being loaded: its sample indices (from the sampler), its place in the epoch, and the DataLoader
        worker it was sent to. Usage: in the DataLoaderTimeoutError's message."""
        epoch, batch = self.epoch, self.batch_in_epoch
        if self._run is not None and batch >= self._per_epoch:
            epoch, batch = epoch + 1, 0
        where = f"batch {batch} of epoch {epoch}"
        if isinstance(self.sampler, RankBalancedBatchSampler):
            where = f"the samples at indices {self.sampler.share(batch)} ({where})"
        elif self.sampler is not None and self.sampler.epoch == epoch:  # read ahead into another epoch: its order
            start = batch * self.batch_size  # would need the sampler moved back, under the loading thread's feet
            where = f"the samples at indices {self.sampler._indices()[start:start + self.batch_size]} ({where})"
        task = getattr(self._iterator, "_task_info", {}).get(getattr(self._iterator, "_rcvd_idx", None))
        if task:
            where += f" in DataLoader worker {task[0]}"
        elif self._thread is not None:
            where += " in the main process (num_workers: 0)"
        return where

    def fingerprint(self) -> dict[str, Any]:
        """The data's fingerprint (vlmfast.data.fingerprint), computed once: saved in checkpoints, compared on
        resume. Its sample reads are bounded by data.timeout_s too."""
        if self._fingerprint is None:
            self._fingerprint = data_fingerprint(self.data, self._sampler_settings, read=self._read_bounded)
        return self._fingerprint

    def _read_bounded(self, read: Callable[[], Any], index: int) -> Any:
        if not self.timeout_s:
            return read()
        thread = LoaderThread("vlmfast-fingerprint")
        try:
            return wait_for(thread.submit(read), self.timeout_s,
                            lambda: f"sample {index} (read for the data fingerprint, before any step)")
        finally:
            thread.shutdown(wait=False)

    def batches_per_epoch(self, length: int | None) -> int | None:
        """Batches per epoch on this rank for a dataset of `length` samples (None: unknown, a stream)."""
        if length is None:
            return None
        if self._run is not None:  # vlmfast's samplers: equal per-rank shares
            per_rank, batch_size, drop_last = length // self.world_size, self.batch_size, self._drop_last
        else:  # a user DataLoader (its sampler shards) or a stream
            per_rank, batch_size, drop_last = length, self.loader.batch_size or self.batch_size, self.loader.drop_last
        return per_rank // batch_size if drop_last else -(-per_rank // batch_size)

    def set_micro_batch_size(self, micro_batch_size: int) -> None:
        """Collate the batches still to come at this size (a SampleBatch asks when it is split at another)."""
        if int(self._micro_batch_size[0]):
            self._micro_batch_size[0] = micro_batch_size

    def sample_counts(self) -> dict[str, int]:
        """Samples delivered and bad samples skipped so far (summed over workers): {"samples": n, "bad": m}."""
        return self.bad_samples.as_dict()

    def close(self) -> None:
        """Shut the loader's worker processes down now (they would otherwise live until garbage collection); a
        later batch starts a new iteration with no end (the doctor reads a few after training)."""
        if self._thread is not None:  # not joined: a load still running (stuck, or cut short by Ctrl-C) is abandoned
            self._thread.shutdown(wait=False)  # later batches start a new thread (still bounded by data.timeout_s)
        self._close_iterator()
        self._limit = None

    def _close_iterator(self) -> None:
        for iterator in (self._iterator, getattr(self.loader, "_iterator", None)):  # persistent workers: the latter
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        self._iterator = None
        if getattr(self.loader, "_iterator", None) is not None:  # a persistent iterator shut down: the next iter()
            self.loader._iterator = None  # must start new workers, not reset the stopped ones ("Queue is closed")

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch_in_epoch = state["epoch"], state["batch_in_epoch"]
        self._close_iterator()
        self._limit = None


def _loader_kwargs(spec: DataSpec, pin_memory: bool, num_workers: int, persistent: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"num_workers": num_workers, "pin_memory": pin_memory}
    if num_workers > 0:
        kwargs["persistent_workers"] = persistent
        kwargs["timeout"] = spec.timeout_s  # a batch not back from its worker in time: an error naming it
        # A scheduler's SIGTERM to the process group is the main process's to handle (a final checkpoint).
        kwargs["worker_init_fn"] = functools.partial(worker_ignores_stop_signals, main_pid=os.getpid())
        if spec.prefetch_factor is not None:
            kwargs["prefetch_factor"] = spec.prefetch_factor
    return kwargs
