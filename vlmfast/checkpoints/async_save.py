"""Asynchronous checkpoints (``save.async: true``): the step waits only for a copy of the state in host memory.

:meth:`AsyncCheckpointer.save` copies every tensor of the state to host memory (CUDA tensors into pinned buffers,
one synchronisation; CPU tensors cloned, since the optimizer updates them in place) and returns; a background thread
then does what a synchronous save does (:func:`vlmfast.checkpoints.store.save_checkpoint`): write, fsync, the manifest,
the atomic rename, pruning. So the checkpoint becomes visible complete or not at all, exactly as a synchronous one: a
resume never sees half of it, and a failed write removes its partial folder and keeps every earlier checkpoint.

- At most one save is in flight: the next :meth:`save` first waits for the previous one.
- A save that fails is reported at the next step (:meth:`poll`, the trainer's ``on_step_end``), at the next save,
  or at the end of the run (:meth:`wait`), with the same :class:`~vlmfast.checkpoints.store.CheckpointWriteError`.
- The end of the run waits for the last save (``on_fit_end``, and the final save itself waits).

The copy costs host memory for one more state and the time of a memory copy (about 0.1 s per GB on CPU); the write,
the hashing and fsync run off the training thread (they release the GIL).

Usage::

    checkpointer = AsyncCheckpointer()
    checkpointer.save("ckpt", step, trainer.state_dict(), keep_last=3)   # returns after the host copy
    checkpointer.poll()                                                    # each step: raises a failed save's error
    checkpointer.wait()                                                    # the end of the run
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

import torch

from vlmfast.checkpoints.store import checkpoint_name, save_checkpoint, state_tensors

log = logging.getLogger(__name__)


def snapshot_to_host(state: Any, reuse: list[torch.Tensor] | None = None) -> tuple[Any, list[torch.Tensor]]:
    """A copy of `state` whose tensors live in host memory and share nothing with the originals, and the list of
    its tensors (in traversal order: pass it back as `reuse` once that copy is written, so the next copy goes into
    the same buffers: no allocation, no page faults, no pinning).

    CUDA tensors are copied into pinned buffers without blocking, then synchronised once; a tensor that appears
    twice (tied weights) is copied once. Containers are rebuilt; other leaves are deep-copied.
    """
    copies: dict[int, torch.Tensor] = {}
    buffers: list[torch.Tensor] = []
    spare = list(reuse or [])
    devices: set[torch.device] = set()

    def visit(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            key = id(value)
            if key not in copies:
                index = len(buffers)
                target = spare[index] if index < len(spare) else None
                copies[key] = _host_copy(value.detach(), devices, target)
                buffers.append(copies[key])
            return copies[key]
        if isinstance(value, dict):
            items = ((k, visit(v)) for k, v in value.items())
            return dict(items) if type(value) is dict else type(value)(items)
        if isinstance(value, list):
            return [visit(v) for v in value]
        if isinstance(value, tuple):
            items = [visit(v) for v in value]
            return type(value)(*items) if hasattr(value, "_fields") else tuple(items)
        return copy.deepcopy(value)

    out = visit(state)
    for device in devices:  # the non-blocking copies into pinned memory are complete after this
        torch.cuda.synchronize(device)
    return out, buffers


def _layout(state: Any) -> list[tuple[torch.Size, torch.dtype, bool]]:
    """(shape, dtype, pinned) of each distinct tensor of `state`, in :func:`snapshot_to_host`'s order."""
    distinct = {id(t): t for t in state_tensors(state)}  # first occurrence kept, in order (tied weights once)
    return [(t.shape, t.dtype, t.device.type == "cuda") for t in distinct.values()]


def _host_copy(tensor: torch.Tensor, devices: set[torch.device], target: torch.Tensor | None) -> torch.Tensor:
    fits = (target is not None and target.shape == tensor.shape and target.dtype == tensor.dtype
            and target.is_pinned() == (tensor.device.type == "cuda"))
    if tensor.device.type == "cuda":
        devices.add(tensor.device)
        host = target if fits else torch.empty(tensor.shape, dtype=tensor.dtype, device="cpu", pin_memory=True)
        return host.copy_(tensor, non_blocking=True)
    if fits:
        return target.copy_(tensor)
    return tensor.clone() if tensor.device.type == "cpu" else tensor.to("cpu", copy=True)


class AsyncCheckpointer:
    """Writes checkpoints in one background thread, at most one in flight (see the module docstring)."""

    def __init__(self, writer_niceness: int = 10) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._path: Path | None = None
        self._buffers: list[torch.Tensor] = []  # the last copy's tensors, reused once it is written
        self._writer_tid: int | None = None
        self.writer_niceness = writer_niceness  # the writer thread yields the CPU to training (Linux: per thread)
        self.last_wait_s = 0.0  # how long the last save waited for the one before it
        self.last_copy_s = 0.0  # the part of the last save the step waited for
        self.last_write_s = 0.0  # the part that ran in the background

    def save(self, directory: str | Path, step: int, state: dict[str, Any], keep_last: int = 3,
             meta: dict[str, Any] | None = None, staged: Path | None = None) -> Path:
        """Copy `state` to host memory, start writing it, return the checkpoint's final path (complete once the
        write ends). Waits for the previous save first, and raises its error if it failed."""
        start = time.perf_counter()
        if self.in_flight:  # the step now waits for the write: let it have the CPU back
            _set_thread_niceness(self._writer_tid, 0)
        self.wait()
        self.last_wait_s = time.perf_counter() - start
        start = time.perf_counter()
        host_state, self._buffers = snapshot_to_host(state, reuse=self._buffers)
        self.last_copy_s = time.perf_counter() - start
        path = Path(directory) / checkpoint_name(step)
        self._path, self._error = path, None
        self._thread = threading.Thread(target=self._write, args=(directory, step, host_state, keep_last, meta, staged),
                                        name=f"vlmfast-checkpoint-{step}", daemon=False)
        self._thread.start()
        return path

    def _write(self, directory: str | Path, step: int, state: dict[str, Any], keep_last: int,
               meta: dict[str, Any] | None, staged: Path | None) -> None:
        start = time.perf_counter()
        self._writer_tid = threading.get_native_id()
        _set_thread_niceness(self._writer_tid, self.writer_niceness)
        try:
            save_checkpoint(directory, step, state, keep_last, meta=meta, staged=staged)
        except BaseException as exc:  # reported on the training thread: poll / wait / the next save
            log.warning("the asynchronous save of step %d failed (reported at the next step): %s", step, exc)
            self._error = exc
        finally:
            self.last_write_s = time.perf_counter() - start

    @property
    def in_flight(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def poll(self) -> None:
        """Raise the error of a finished save that failed (without waiting for one in flight)."""
        if self._thread is not None and not self._thread.is_alive():
            self._finish()

    def wait(self) -> Path | None:
        """Block until the save in flight is on disk; raise its error if it failed. Returns its path."""
        if self._thread is None:
            return None
        self._thread.join()
        return self._finish()

    def _finish(self) -> Path | None:
        self._thread = None
        error, self._error = self._error, None
        if error is not None:
            log.error("the asynchronous save of %s failed: %s", self._path, error)
            raise error
        return self._path

    # ---- as a trainer callback --------------------------------------------------------------------------------
    def on_step_end(self, trainer: Any, metrics: dict[str, Any]) -> None:
        self.poll()
        # An engine that gathers its state with a collective (FSDP2) is never asked from one rank's callback.
        if (not self._buffers and not self.in_flight and trainer.is_main_process and trainer.spec.save.every_steps
                and trainer.engine.local_state_dict):
            # The engine's state: the bulk, first in the trainer's state and so first in the buffers' order (the
            # rest, RNG states gathered from every rank, is a collective and small).
            self.prepare_buffers({"engine": trainer.engine.state_dict()})

    def prepare_buffers(self, state: dict[str, Any]) -> None:
        """Allocate (and touch) the host buffers for copies of `state` in a background thread, so the first save
        costs the step a copy, not an allocation with its page faults (4x the copy for 200 MB, measured)."""
        layout = _layout(state)  # on this thread: shapes and dtypes only, no data

        def allocate() -> None:
            _set_thread_niceness(threading.get_native_id(), self.writer_niceness)
            self._buffers = [torch.zeros(shape, dtype=dtype, pin_memory=pinned) for shape, dtype, pinned in layout]

        self._thread, self._path = threading.Thread(target=allocate, name="vlmfast-checkpoint-buffers"), None
        self._thread.start()

    def on_fit_end(self, trainer: Any, result: Any) -> None:
        self.wait()


_BASE_NICENESS = os.getpriority(os.PRIO_PROCESS, 0) if hasattr(os, "getpriority") else 0


def _set_thread_niceness(tid: int | None, niceness: int) -> None:
    """Set a thread's CPU priority relative to the process's: on Linux a thread is a task with its own nice value,
    so the write, the hashing and the pickling yield to the training thread. Raising it back (when the step waits
    for the write) needs CAP_SYS_NICE or RLIMIT_NICE; where the kernel refuses, the writer stays lowered."""
    if tid is None or not hasattr(os, "setpriority"):
        return
    with contextlib.suppress(OSError):
        os.setpriority(os.PRIO_PROCESS, tid, min(19, _BASE_NICENESS + niceness))

