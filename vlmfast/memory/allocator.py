"""The CUDA caching allocator at run time: expandable segments after CUDA has started, and the OOM observer.

``PYTORCH_CUDA_ALLOC_CONF`` is read once, when the allocator first starts; by the time a trainer is built with
``device: auto`` CUDA is usually running already, so setting the variable then changes nothing. torch can change the
setting afterwards through ``torch._C._accelerator_setAllocatorSettings`` (what torch 2.13's deprecated
``torch.cuda.memory._set_allocator_settings`` forwards to): ``CUDAAllocatorConfig::expandable_segments()`` is read
at each new segment (c10/cuda/CUDAAllocatorConfig.h), so segments mapped from then on are expandable.

The OOM observer (``torch._C._cuda_attach_out_of_memory_observer``) is called by the allocator right when an
allocation fails, before the error is raised (c10/cuda/CUDACachingAllocator.cpp calls its ``oom_observers_`` after
releasing its lock), so a snapshot taken there shows the memory that was live at the failure; a snapshot taken in the
``except`` block of the OOM handler, after ``empty_cache()``, shows what was left.

Usage::

    set_expandable_segments()                           # before or after CUDA starts
    watch = OOMSnapshots(); watch.attach()              # then an OOM keeps the allocator's state at the failure
    ...; watch.take()                                   # the snapshot of the last OOM (or None)
"""

from __future__ import annotations

import logging
import os
import threading
import weakref
from collections.abc import Callable
from typing import Any, ClassVar

import torch

__all__ = ["OOMSnapshots", "allocator_setter", "set_expandable_segments"]

log = logging.getLogger(__name__)


def allocator_setter() -> Callable[[str], None] | None:
    """torch's run-time allocator-settings call, newest name first (None on a torch without one)."""
    setter = getattr(torch._C, "_accelerator_setAllocatorSettings", None)
    if setter is not None:
        return setter
    return getattr(getattr(torch.cuda, "memory", None), "_set_allocator_settings", None)  # torch < 2.9


def set_expandable_segments(setter: Callable[[str], None] | None = None) -> bool:
    """Ask the CUDA caching allocator for expandable segments (less fragmentation); works before and after CUDA starts.

    Before CUDA starts the environment variable is set too (so child processes inherit it). `setter` is a seam for
    tests; it defaults to :func:`allocator_setter`. Returns whether the setting took effect.
    """
    current = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    cuda_started = torch.cuda.is_available() and torch.cuda.is_initialized()
    if not cuda_started and "expandable_segments" not in current:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [current, "expandable_segments:True"]))
    if not cuda_started:
        return True
    setter = setter or allocator_setter()
    if setter is None:
        log.warning("oom.expandable_segments: CUDA has started and torch %s cannot change the allocator now; set "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting Python", torch.__version__)
        return False
    setter("expandable_segments:True")  # segments allocated from now on; existing ones stay as they are
    return True


class OOMSnapshots:
    """Keeps the CUDA allocator's snapshot taken at the moment of the last out-of-memory error.

    torch offers no way to detach an observer, so one process-wide observer is attached once and forwards to the
    live instances (held weakly). ``attach_fn`` and ``snapshot_fn`` are seams for tests without CUDA.
    Usage: ``watch = OOMSnapshots(); watch.attach(); ...; snapshot = watch.take()``
    """

    _instances: ClassVar[weakref.WeakSet[OOMSnapshots]] = weakref.WeakSet()
    _attached = False
    _lock = threading.Lock()

    def __init__(self, snapshot_fn: Callable[[], Any] | None = None) -> None:
        self.snapshot_fn = snapshot_fn or (lambda: torch.cuda.memory._snapshot())
        self.snapshot: Any = None
        self.failures: list[dict[str, int]] = []  # what the allocator reported: device, alloc, device_alloc, free

    def attach(self, attach_fn: Callable[[Callable[..., None]], None] | None = None) -> bool:
        """Start watching (False when there is no CUDA and no `attach_fn`)."""
        real = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
        if attach_fn is None:
            if real is None or not torch.cuda.is_available():
                return False
            attach_fn = real
        with OOMSnapshots._lock:
            OOMSnapshots._instances.add(self)
            if attach_fn is not real or not OOMSnapshots._attached:  # torch's observers cannot be removed: once
                attach_fn(OOMSnapshots._observe)
                OOMSnapshots._attached = OOMSnapshots._attached or attach_fn is real
        return True

    def detach(self) -> None:
        OOMSnapshots._instances.discard(self)

    @staticmethod
    def _observe(device: int, alloc: int, device_alloc: int, device_free: int) -> None:
        """Called by the allocator on every failed allocation, before torch.OutOfMemoryError is raised."""
        for watch in list(OOMSnapshots._instances):
            watch.failures.append({"device": device, "requested": alloc, "limit": device_alloc, "free": device_free})
            try:
                watch.snapshot = watch.snapshot_fn()
            except Exception as exc:  # never turn an OOM into a different error
                log.warning("could not take the allocator snapshot at the OOM: %s", exc)

    def take(self) -> Any:
        """The snapshot of the last OOM (and forget it), or None when none happened since the last take."""
        snapshot, self.snapshot = self.snapshot, None
        return snapshot
