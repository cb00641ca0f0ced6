"""Device prefetch: load and copy the next batch to the device while the current step computes.

On CUDA the copy (and an optional on-device transform such as batched image resizing) runs on a side stream,
``non_blocking`` from pinned host memory, and an event is recorded on that stream right after it. Before a batch is
handed out the compute stream waits for *that batch's* event only (``wait_stream`` would also wait for the copies of
the batches loaded after it, which are already queued on the side stream), and every tensor of the batch is marked
with ``record_stream`` so the caching allocator does not reuse its memory while the compute stream still reads it
(torch.Tensor.record_stream docs: memory allocated on one stream and used on another). On CPU there is no stream.

The host batch a device batch was copied from is kept until the next one is handed out (``host_batch(batch)``):
the trainer counts tokens on it, so weighting micro-batches never reads the device (a SampleBatch keeps its own host
micro-batches). That keeps each host batch alive one step longer; it holds the same tensors the loader produced.

The next batch is loaded by one background thread, so collation (or receiving a batch from DataLoader workers,
which costs a round trip per tensor) leaves the step's critical path; PIL decoding and torch ops release the GIL,
so on CPU the thread overlaps the step too. The resume position stays exact: ``state_dict()`` is the source's
position after the batches handed out, not after the one already prefetched.

With ``timeout_s`` (the trainer passes data.timeout_s when no DataLoader worker enforces it) the caller waits that
long at most for a batch, then a DataLoaderTimeoutError names the batch (the source's ``describe_pending()``); the
thread is a daemon, so a load stuck forever is abandoned, not joined, at exit.

Usage::

    batches = DevicePrefetcher(loader, torch.device("cuda"))          # any iterator of nested tensor batches
    for step in range(max_steps):
        batch = next(batches)                                         # already on the device
        loss = model(**batch).loss
"""

from __future__ import annotations

import concurrent.futures.thread
import logging
import os
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from typing import Any

import torch
from accelerate.utils import recursively_apply

from vlmfast.data.batch import move_to_device
from vlmfast.data.micro_batches import SampleBatch
from vlmfast.data.timeout import DataLoaderTimeoutError, LoaderThread, wait_for
from vlmfast.spec import DataSpec

log = logging.getLogger(__name__)

_EXHAUSTED = object()


def _forget_the_forking_executor_thread() -> None:
    """In a process forked from the prefetch thread (DataLoader workers of a new epoch are), that thread is the
    child's only thread; concurrent.futures' exit hook would join it from itself ("cannot join current thread"), and
    the worker would exit with code 1 after its work, which torch's SIGCHLD handler turns into a RuntimeError in the
    main process (seen on an H200 and on CPU: num_workers > 0 with device_prefetch). The child forgets it."""
    registry = getattr(concurrent.futures.thread, "_threads_queues", None)  # CPython 3.8-3.13: thread -> work queue
    if registry is not None:
        registry.pop(threading.current_thread(), None)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_the_forking_executor_thread)


class DevicePrefetcher:
    """Wrap an iterator of host batches; yield them on `device`, the next one already loaded (see module doc)."""

    def __init__(
        self,
        source: Iterator[Any],
        device: torch.device | str,
        transform: Callable[[Any], Any] | None = None,
        prefetch: bool = True,
        background: bool = True,
        depth: int = 2,
        timeout_s: float | None = None,
    ) -> None:
        self.source = source
        self.timeout_s = timeout_s if prefetch and background else None  # in the caller's thread: nothing to wait on
        self._failed: DataLoaderTimeoutError | None = None
        self.device = torch.device(device)
        self.transform = transform
        self.prefetch = prefetch
        use_stream = prefetch and self.device.type == "cuda"
        self.stream = torch.cuda.Stream(device=self.device) if use_stream else None
        # One thread: next(source) (collation, or receiving from DataLoader workers) and the copy leave the step's
        # critical path; decoding and torch ops release the GIL, so this overlaps even on CPU.
        self._executor = LoaderThread("vlmfast-prefetch") if prefetch and background else None
        self.depth = depth if prefetch else 0  # batches loaded ahead: more than one absorbs jitter in load times
        self._pending: deque[Future | tuple[Any, Any, Any, Any]] = deque()
        self._state: dict[str, Any] | None = None  # the source's position after the batches handed out
        self._handed_out: tuple[Any, Any] = (None, None)  # the last batch handed out and its host original
        self._warned_unpinned = False

    def __iter__(self) -> DevicePrefetcher:
        return self

    def __getattr__(self, name: str) -> Any:
        # Everything else is the source's (e.g. a ResumableLoader's .loader, .autotune, .epoch).
        if name == "source":  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        return getattr(self.source, name)

    def __next__(self) -> Any:
        if self._failed is not None:
            raise self._failed
        if not self._pending and self.timeout_s and self._executor is not None:  # the first batch too: bounded wait
            self._pending.append(self._executor.submit(self._load))
        batch, state, copied, host = self._collect() if self._pending else self._load()
        if batch is _EXHAUSTED:
            raise StopIteration
        if copied is not None:
            compute = torch.cuda.current_stream(self.device)
            compute.wait_event(copied)  # this batch's copies only, not the next batches' queued behind them
            self._used_on(batch, compute)
        self._state = state
        self._handed_out = (batch, host)
        while len(self._pending) < self.depth:  # in flight while the caller computes on `batch`
            self._pending.append(self._executor.submit(self._load) if self._executor is not None else self._load())
        return batch

    def host_batch(self, batch: Any) -> Any:
        """The host batch that `batch` (the one handed out last) was copied from, else `batch` itself: count tokens
        there, not on the device copy (a read of a device value waits for the GPU). A SampleBatch is its own: it
        keeps its host micro-batches. Usage: ``count_input_tokens(prefetcher.host_batch(batch))``"""
        handed_out, host = self._handed_out
        return host if handed_out is batch and host is not None else batch

    def _collect(self) -> tuple[Any, Any, Any, Any]:
        pending = self._pending[0]
        if isinstance(pending, Future):
            try:
                pending = wait_for(pending, self.timeout_s, self._describe_pending)
            except DataLoaderTimeoutError as exc:
                self._failed = exc  # the load stays stuck in the thread: it is abandoned, never waited for again
                raise
        self._pending.popleft()
        return pending

    def _describe_pending(self) -> str:
        describe = getattr(self.source, "describe_pending", None)
        return f"{describe() if describe is not None else 'the next batch'} (device prefetch thread)"

    def _load(self) -> tuple[Any, dict[str, Any] | None, Any, Any]:
        """(device batch, source position after it, the side-stream event its copies complete at or None, the host
        batch it was copied from: None for a SampleBatch, which is moved in place and keeps its host micro-batches)."""
        try:
            host_batch = next(self.source)
        except StopIteration:
            return _EXHAUSTED, None, None, None
        state = self._source_state()  # read here: the main thread never touches the source while a load runs
        self._check_pinned(host_batch)
        host = None if isinstance(host_batch, SampleBatch) else host_batch
        if self.stream is None:
            return self._to_device(host_batch), state, None, host
        with torch.cuda.stream(self.stream):
            batch = self._to_device(host_batch)
            copied = torch.cuda.Event()
            copied.record(self.stream)
        return batch, state, copied, host

    @staticmethod
    def _used_on(batch: Any, stream: Any) -> None:
        """Tell the caching allocator the batch's memory (allocated on the side stream) is in use on `stream`."""
        tensors = batch.micro_batches if isinstance(batch, SampleBatch) else batch
        recursively_apply(lambda t: t.record_stream(stream), tensors, error_on_other_type=False)

    def close(self) -> None:
        """Finish the loads in flight, stop the background thread and close the host loader (its workers); later
        batches load in the caller's thread (the doctor reads a few after training, to measure padding)."""
        while self._pending and self._failed is None:
            self._collect()
        self._pending.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=self._failed is None)
            self._executor = None
        getattr(self.source, "close", lambda: None)()

    def _to_device(self, host_batch: Any) -> Any:
        batch = move_to_device(host_batch, self.device, non_blocking=True)
        if self.transform is None:
            return batch
        # A SampleBatch keeps the transform for micro-batches it collates again later (after an OOM re-split).
        return batch.map(self.transform) if isinstance(batch, SampleBatch) else self.transform(batch)

    def _check_pinned(self, host_batch: Any) -> None:
        if self.stream is None or self._warned_unpinned:
            return
        pinned: list[bool] = []
        tensors = host_batch.micro_batches if isinstance(host_batch, SampleBatch) else host_batch
        recursively_apply(lambda t: pinned.append(t.is_pinned()), tensors, error_on_other_type=False)
        if pinned and not all(pinned):
            self._warned_unpinned = True
            log.warning("device prefetch: host batches are not in pinned memory, so the copy to %s cannot overlap "
                        "compute; set data.pin_memory: true (or pin_memory=True on your DataLoader)", self.device)

    def _source_state(self) -> dict[str, Any] | None:
        state_dict = getattr(self.source, "state_dict", None)
        return state_dict() if state_dict is not None else None

    def state_dict(self) -> dict[str, Any]:
        """The source's position after the batches handed out (the prefetched one is not counted)."""
        if self._state is not None:
            return self._state
        state = self._source_state()
        if state is None:
            raise TypeError(f"{type(self.source).__name__} has no state_dict(): it cannot be checkpointed")
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Reposition the source and drop the prefetched batch (it belongs to the old position)."""
        while self._pending:
            self._collect()  # let the loads in flight finish before the source moves
        self.source.load_state_dict(state)  # type: ignore[attr-defined]
        self._state = None
        self._handed_out = (None, None)


def device_batches(loader: Iterator[Any], spec: DataSpec, device: torch.device) -> Any:
    """The trainer's batch source for `spec`: `loader` itself, or a DevicePrefetcher with the image transform."""
    prefetch = spec.device_prefetch if spec.device_prefetch is not None else device.type == "cuda"
    if not (prefetch or spec.device_image_size):
        return loader
    transform = None
    if spec.device_image_size:
        from vlmfast.data.images import BatchImagePreprocessor

        transform = BatchImagePreprocessor(spec.device_image_size, spec.image_mean, spec.image_std, spec.image_key)
    # Loads run in the prefetch thread: data.timeout_s is enforced there unless the DataLoader's workers enforce it.
    take_over = getattr(loader, "take_over_timeout", None)
    timeout_s = take_over() if take_over is not None else spec.timeout_s
    return DevicePrefetcher(loader, device, transform=transform, prefetch=True, timeout_s=timeout_s)


def host_batch(source: Any, batch: Any) -> Any:
    """The host batch `batch` was copied from when `source` is a DevicePrefetcher that handed it out, else `batch`.

    Usage: ``tokens = count_input_tokens(host_batch(trainer.loader, batch))``  # no device read under prefetch
    """
    return source.host_batch(batch) if isinstance(source, DevicePrefetcher) else batch
