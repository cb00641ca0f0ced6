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
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from vlmfast.data.autotune import AutotuneResult, autotune_num_workers
from vlmfast.data.bad_samples import BadSampleCounts, CheckedCollate, IndexedDataset
from vlmfast.data.micro_batches import SampleBatch, SampleCollate
from vlmfast.data.sample_checks import SampleCheck
from vlmfast.data.samplers import LengthGroupedSampler, check_groupable, dataset_lengths
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
    ) -> None:
        """`sample_check`: the host-side checks of every batch (data.check_samples; default: without the model's
        vocabulary, so ids are not range-checked: the trainer passes ``SampleCheck.for_model``)."""
        self.batch_size = batch_size
        self.collate_fn = collate_fn
        # One shared cell: the trainer's size reaches the worker processes, whose collate reads it per batch.
        self._micro_batch_size = torch.tensor([micro_batch_size or 0], dtype=torch.int64).share_memory_()
        self.epoch = 0
        self.batch_in_epoch = 0
        self._skip = 0
        self._iterator: Iterator[Any] | None = None
        self.sampler: EpochSampler | LengthGroupedSampler | None = None
        self.autotune: AutotuneResult | None = None  # with num_workers auto: the measured choice and why
        self.bad_samples = BadSampleCounts()  # samples read / bad ones skipped (a user DataLoader's: not seen)
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
            if world_size > 1 and not hasattr(data.sampler, "set_epoch"):
                log.warning("%d ranks share a user DataLoader without a DistributedSampler: every rank may see the "
                            "same batches; pass the Dataset instead and vlmfast shards it", world_size)
            return
        stream = isinstance(data, IterableDataset)
        # Bad samples (unreadable, wrong keys or shapes) are dropped from their batch and counted, or named in an error.
        check = None if spec.check_samples == "off" else sample_check or SampleCheck()
        collate = SampleCollate(collate_fn, self._micro_batch_size) if micro_batch_size else collate_fn
        checked = CheckedCollate(collate, self.bad_samples, spec.max_bad_sample_fraction, indexed=not stream,
                                 check=check, check_mode=spec.check_samples)
        source = data if stream else IndexedDataset(data)
        if stream:
            self._configure_stream(data, spec, world_size)
            sampler, generator = None, None
        else:
            num_samples = len(data)  # type: ignore[arg-type]
            if num_samples // world_size < batch_size:
                raise ValueError(f"the dataset has {num_samples} samples, fewer than batch_size {batch_size} per "
                                 f"rank ({world_size} rank(s)): lower batch_size or add data")
            if spec.group_by_length != "none":  # batches of similar length, the longest first
                self.sampler = sampler = LengthGroupedSampler(
                    dataset_lengths(data, spec.group_by_length), batch_size, seed, spec.shuffle, rank, world_size,
                    mode=spec.group_by_length)
            else:
                self.sampler = sampler = EpochSampler(num_samples, seed, spec.shuffle, rank, world_size)
            generator = torch.Generator().manual_seed(seed)  # deterministic worker seeds

        def build(num_workers: int, persistent: bool = spec.persistent_workers) -> DataLoader:
            return DataLoader(source, batch_size=batch_size, sampler=sampler, collate_fn=checked,
                              drop_last=spec.drop_last, generator=generator,
                              **_loader_kwargs(spec, pin_memory, num_workers, persistent))

        num_workers = spec.num_workers
        if num_workers == "auto":
            self.autotune = autotune_num_workers(lambda n: build(n, persistent=False), spec.autotune_budget_s,
                                                 spec.autotune_max_workers)
            num_workers = self.autotune.num_workers
            if hasattr(data, "reset_counts"):  # the measurement's reads are not part of training
                data.reset_counts()
            self.bad_samples.reset()
        self.loader = build(num_workers)

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
        for _ in range(2):  # at most one epoch boundary per call
            if self._iterator is None:
                self._iterator = self._start_epoch()
            try:
                batch = next(self._iterator)
            except StopIteration:
                self._iterator = None
                self.epoch += 1
                self.batch_in_epoch = 0
                continue
            self.batch_in_epoch += 1
            if isinstance(batch, SampleBatch):  # not pickled with every batch: attached on this side
                batch.collate_fn, batch.on_resize = self.collate_fn, self.set_micro_batch_size
            return batch
        raise RuntimeError("the training data yielded no batch in a whole epoch: is it empty, or smaller than "
                           "batch_size with drop_last?")

    def _start_epoch(self) -> Iterator[Any]:
        if self.sampler is not None:
            self.sampler.set_position(self.epoch, self.batch_in_epoch * self.batch_size)
            with stop_signals_blocked():  # new workers start with SIGTERM/SIGINT blocked (see vlmfast.train.interrupt)
                return iter(self.loader)
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
        return iterator

    def set_micro_batch_size(self, micro_batch_size: int) -> None:
        """Collate the batches still to come at this size (a SampleBatch asks when it is split at another)."""
        if int(self._micro_batch_size[0]):
            self._micro_batch_size[0] = micro_batch_size

    def sample_counts(self) -> dict[str, int]:
        """Samples delivered and bad samples skipped so far (summed over workers): {"samples": n, "bad": m}."""
        return self.bad_samples.as_dict()

    def close(self) -> None:
        """Shut the loader's worker processes down now (they would otherwise live until garbage collection)."""
        for iterator in (self._iterator, getattr(self.loader, "_iterator", None)):  # persistent workers: the latter
            shutdown = getattr(iterator, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        self._iterator = None

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_in_epoch": self.batch_in_epoch}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.epoch, self.batch_in_epoch = state["epoch"], state["batch_in_epoch"]
        self._iterator = None


def _loader_kwargs(spec: DataSpec, pin_memory: bool, num_workers: int, persistent: bool) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"num_workers": num_workers, "pin_memory": pin_memory}
    if num_workers > 0:
        kwargs["persistent_workers"] = persistent
        # A scheduler's SIGTERM to the process group is the main process's to handle (a final checkpoint).
        kwargs["worker_init_fn"] = functools.partial(worker_ignores_stop_signals, main_pid=os.getpid())
        if spec.prefetch_factor is not None:
            kwargs["prefetch_factor"] = spec.prefetch_factor
    return kwargs
