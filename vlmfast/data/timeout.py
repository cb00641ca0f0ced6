"""data.timeout_s: a batch that does not arrive in time ends the run with an error naming what was being loaded.

Where the wait is enforced depends on who loads:

- DataLoader worker processes (``num_workers > 0``): the DataLoader's own ``timeout``; its RuntimeError becomes a
  :class:`DataLoaderTimeoutError` naming the worker and the batch's sample indices.
- No workers (``num_workers: 0``, the default): the batch is loaded in one background daemon thread (a
  :class:`LoaderThread`) while the training thread waits on it with the timeout. The training thread, never
  stuck itself, can then write the final checkpoint and raise. One thread hop per batch; the training thread is
  blocked meanwhile, so the load runs alone, as before (same order, same random numbers: resume stays exact).
- Device prefetch (``data.device_prefetch``): the prefetch thread loads; the training thread waits on its future
  with the timeout (the prefetcher's own thread is a daemon LoaderThread too).

What is not covered: a Python thread cannot be killed, so a load stuck forever stays stuck in its daemon thread
(abandoned: it does not keep the process from exiting); code that holds the GIL without ever releasing it (a C
extension spinning) stops every thread, the waiting one included. A stuck worker *process* is shut down with the
loader (torch terminates workers that do not exit).

Usage::

    thread = LoaderThread("vlmfast-loader")
    batch = wait_for(thread.submit(lambda: next(iterator)), 600, describe=lambda: "batch 3 of epoch 0")
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

import torch

__all__ = ["DataLoaderTimeoutError", "LoaderThread", "timeout_message", "wait_for"]


class DataLoaderTimeoutError(RuntimeError):
    """A batch (or a sample) did not arrive within data.timeout_s; the message names what was being loaded.

    ``checkpoint``: the final checkpoint the trainer wrote before raising (None when it wrote none)."""

    def __init__(self, message: str, checkpoint: Any = None) -> None:
        super().__init__(message)
        self.checkpoint = checkpoint


def timeout_message(timeout_s: float, what: str) -> str:
    return (f"the training data delivered nothing for data.timeout_s={timeout_s:g} s while loading {what}: the loader "
            "seems stuck (a read that never returns: a network file system, a lock, a deadlocked worker). Fix the "
            "reader, or raise data.timeout_s if loading really takes this long (0 disables the timeout)")


class LoaderThread:
    """One daemon thread that runs the loads handed to it, in order. Daemon: a load stuck forever is abandoned
    when the process exits (a ThreadPoolExecutor's thread would be joined at exit, hanging it)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._queue: queue.SimpleQueue[tuple[Callable[[], Any], Future] | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], Any]) -> Future:
        if self._thread is None:  # the thread holds the queue, not this object: dropping it ends the thread
            threads, ready = torch.get_num_threads(), threading.Event()
            self._thread = threading.Thread(target=_run, args=(self._queue, ready), name=self.name, daemon=True)
            self._thread.start()
            ready.wait()
            torch.set_num_threads(threads)  # the process-wide default new threads start with: the caller's again
            weakref.finalize(self, self._queue.put, None)
        future: Future = Future()
        self._queue.put((fn, future))
        return future

    def shutdown(self, wait: bool = True) -> None:
        """Stop the thread after the loads queued (`wait=False`: a load still running is abandoned, not joined); a
        later `submit` starts a new thread."""
        if self._thread is None:
            return
        self._queue.put(None)
        if wait:
            self._thread.join()
        self._thread, self._queue = None, queue.SimpleQueue()  # a later submit starts a thread of its own


def _run(work: queue.SimpleQueue, ready: threading.Event) -> None:
    # Torch ops of this thread on one core. A second thread running parallel regions gets an OpenMP team of its own;
    # libgomp then manages more threads than there are cores and throttles every team's spin-wait, the training
    # thread's too, which then sleeps and wakes between its ops (-11 % on the cpu-vlm benchmark's steps).
    # omp_set_num_threads (torch.set_num_threads) sets the calling thread's value; the caller restores the
    # process-wide default once this ran (submit). get_num_threads first: torch initialises a thread's setting from
    # that default on its first query (at::internal::lazy_init_num_threads), which would undo a set before it.
    torch.get_num_threads()
    torch.set_num_threads(1)
    ready.set()
    while (item := work.get()) is not None:
        fn, future = item
        if not future.set_running_or_notify_cancel():
            continue
        try:
            future.set_result(fn())
        except BaseException as exc:  # handed to the waiting thread, which re-raises it
            future.set_exception(exc)
        del item, fn, future  # no reference to the last batch (or its loader) kept while idle


def wait_for(future: Future, timeout_s: float | None, describe: Callable[[], str],
             progress: Callable[[], float] | None = None) -> Any:
    """The future's result, or a DataLoaderTimeoutError naming `describe()` once nothing happened for `timeout_s`
    (None/0: no limit). `progress()`: the time.monotonic() of the load's latest progress (a resume skipping batches
    makes progress at each one), which restarts the wait."""
    if not timeout_s:
        return future.result()
    since = time.monotonic()
    while True:
        try:
            return future.result(timeout=max(since + timeout_s - time.monotonic(), 0.0))
        except FutureTimeout:
            if future.done():  # it finished just now (a TimeoutError the load itself raised is re-raised as is)
                return future.result()
            latest = progress() if progress is not None else since
            if latest > since:
                since = latest
                continue
            raise DataLoaderTimeoutError(timeout_message(timeout_s, describe())) from None
