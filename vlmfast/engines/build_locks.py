"""Explain the silent wait on a lock file left by a killed DeepSpeed op build.

DeepSpeed builds its C++ ops on first use through ``torch.utils.cpp_extension.load`` (``deepspeed/ops/op_builder/
builder.py: jit_load``). torch guards each build folder with a ``FileBaton`` (``torch/utils/cpp_extension.py:
_jit_compile``): the builder creates ``<build dir>/lock`` with O_EXCL, keeps it open while it compiles, and deletes
it at the end; every other process waits, polling, until the file is gone (``FileBaton.wait``: no timeout, and no
word unless ``warn_after_seconds`` is given, which cpp_extension does not do). A build killed mid-way leaves the file,
and every later run waits forever without a word.

:func:`explain_build_locks` (around ``deepspeed.initialize``) names such files before the wait and, if the wait
goes on, every minute. A lock that no process on this machine holds open (read from ``/proc/*/fd``) is called
stale; one held by a live build is only waited for. Nothing is deleted: a build on another machine sharing the
folder could hold it.

Usage::

    with explain_build_locks():
        engine, *_ = deepspeed.initialize(...)
"""

from __future__ import annotations

import logging
import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

log = logging.getLogger(__name__)


def extensions_root() -> Path:
    """The folder torch builds extensions in: TORCH_EXTENSIONS_DIR, else its default root (as cpp_extension does)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env)
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    accelerator = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip is not None
                   else f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda is not None else "cpu")
    python = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{python}_{accelerator}"


def build_locks(root: Path | None = None) -> list[Path]:
    """The ``lock`` files of extension build folders under `root` (default: :func:`extensions_root`)."""
    root = root or extensions_root()
    return sorted(root.glob("*/lock")) if root.is_dir() else []


def lock_holders(lock: Path) -> list[int]:
    """PIDs of processes on this machine with `lock` open (empty where /proc cannot be read)."""
    target = os.path.realpath(lock)
    holders = []
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            if any(os.readlink(fd) == target for fd in (proc / "fd").iterdir()):
                holders.append(int(proc.name))
        except OSError:  # a process that ended, or another user's
            continue
    return holders


def explain(lock: Path) -> str:
    holders = lock_holders(lock)
    if holders:
        return (f"{lock}: a DeepSpeed/torch extension build holds this lock (pid {', '.join(map(str, holders))}); "
                "this run waits until that build finishes")
    return (f"{lock}: an extension build lock that no process on this machine holds: a killed DeepSpeed op build "
            "left it, and torch waits for it to disappear with no timeout. If no build is running on another machine "
            f"sharing {lock.parent.parent}, delete it (rm {lock}) and the run goes on")


@contextmanager
def explain_build_locks(after_s: float = 60.0, every_s: float = 60.0, root: Path | None = None) -> Iterator[None]:
    """Warn now about stale build locks, and again every `every_s` while the block runs longer than `after_s` with
    any lock present (see the module docstring)."""
    for lock in build_locks(root):
        if not lock_holders(lock):
            log.warning("%s", explain(lock))
    done = threading.Event()

    def watch() -> None:
        wait = after_s
        while not done.wait(wait):
            for lock in build_locks(root):
                log.warning("still waiting after %.0f s? %s", after_s, explain(lock))
            wait = every_s

    thread = threading.Thread(target=watch, name="vlmfast-build-locks", daemon=True)
    thread.start()
    try:
        yield
    finally:
        done.set()
