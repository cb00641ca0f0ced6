"""The folders a run writes into: one writer per ``save.dir``, and checks that fail before any training.

- :class:`SaveDirLock`: an exclusive lock on ``save.dir/.vlmfast.lock`` holding the writer's PID and host. A second
  run on the same folder is refused naming the first; the kernel drops the lock when its process dies, so the lock
  of a killed run is taken over (and said so). Re-entrant within one process.
- :func:`check_output_dirs`: ``save.dir``, ``save.export.dir`` and ``log.dir`` are folders this process can create
  and write, with no dangling symbolic links; errors name the field.
- :func:`check_free_space`: room for one more checkpoint of this model (the newest checkpoint's size, else an
  estimate from the parameters and the optimizer), before the first step instead of after hours of training.

Usage::

    check_output_dirs(spec)                               # before any work (check_environment calls it)
    with SaveDirLock(spec.save.dir):                      # around the whole run (rank 0)
        check_free_space(spec.save.dir, estimate_checkpoint_bytes(model, optimizer_name="adamw"))
        ...train and save...
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import re
import shutil
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import torch

from vlmfast.common.safe_files import open_fd, open_for_writing, refuse_symlink
from vlmfast.common.sections import SpecError

log = logging.getLogger(__name__)

LOCK_FILE = ".vlmfast.lock"
HOST = socket.gethostname()
_UNSUPPORTED = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # file systems without POSIX locks


class SaveDirInUseError(SpecError):
    """Another live run holds the lock of this save.dir; the message names it (PID, host, since when)."""


class OutputDirError(SpecError):
    """save.dir or log.dir cannot be used; the message names the field, the folder and what to do."""


# ---- one writer per save.dir ------------------------------------------------------------------------------------
class SaveDirLock:
    """Exclusive lock of a checkpoint folder for this process (POSIX record lock: released by the kernel when the
    process dies, not inherited by DataLoader workers, honoured over NFS). See the module docstring.

    Usage: ``with SaveDirLock("ckpt"): save_checkpoint("ckpt", ...)``
    """

    _held: ClassVar[dict[str, _Holder]] = {}  # real path of the folder -> this process's lock on it
    _guard = threading.Lock()

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self._key: str | None = None

    @property
    def path(self) -> Path:
        return self.directory / LOCK_FILE

    def acquire(self) -> SaveDirLock:
        """Take the lock (or join this process's hold on it); :class:`SaveDirInUseError` if another run has it."""
        if self._key is not None:
            return self
        self.directory.mkdir(parents=True, exist_ok=True)
        key = os.path.realpath(self.directory)
        with self._guard:
            holder = self._held.get(key)
            if holder is None:
                holder = self._held[key] = _Holder.take(self.path)
            holder.count += 1
        self._key = key
        return self

    def release(self) -> None:
        """Leave the lock; the last holder in this process unlocks the file (which stays, holding the last owner)."""
        if self._key is None:
            return
        with self._guard:
            holder = self._held.get(self._key)
            if holder is not None:
                holder.count -= 1
                if holder.count <= 0:
                    holder.close()
                    del self._held[self._key]
        self._key = None

    @classmethod
    def held_by_this_process(cls, directory: str | Path) -> bool:
        """Whether this process holds the lock of `directory` (so no other vlmfast run writes there)."""
        return os.path.realpath(directory) in cls._held

    def __enter__(self) -> SaveDirLock:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Holder:
    """The open lock file of one folder; every SaveDirLock of this process on that folder shares it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.count = 0

    @classmethod
    def take(cls, path: Path) -> _Holder:
        try:
            fd = open_fd(path, os.O_RDWR, what="save.dir lock file")  # a planted link is refused, never followed
        except OSError as exc:
            raise OutputDirError(f"save.dir {path.parent}: cannot create its lock file {path.name} ({exc.strerror}): "
                                 "make the folder writable or choose another save.dir") from exc
        try:
            previous = _read_owner(fd)
            if not _lock(fd, path):
                _refuse_if_owner_alive(path, previous)  # no POSIX locks here: judge by PID
            elif previous and (previous.get("pid"), previous.get("host")) != (os.getpid(), HOST):
                log.info("save.dir %s: taking over the lock of pid %s on %s (that run is no longer running)",
                         path.parent, previous.get("pid"), previous.get("host"))
            _write_owner(fd)
        except BaseException:
            os.close(fd)  # closing drops a lock we may have taken
            raise
        return cls(fd)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            fcntl.lockf(self.fd, fcntl.LOCK_UN)
        os.close(self.fd)


def _lock(fd: int, path: Path) -> bool:
    """Take the POSIX lock: True if taken, False if this file system has no locks; raises if another run has it."""
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EAGAIN):
            owner = _read_owner(fd)
            raise SaveDirInUseError(_in_use_message(path.parent, owner)) from None
        if exc.errno in _UNSUPPORTED:
            return False
        raise
    return True


def _refuse_if_owner_alive(path: Path, owner: dict[str, Any] | None) -> None:
    if not owner or (owner.get("pid"), owner.get("host")) == (os.getpid(), HOST):
        return
    if owner.get("host") == HOST and not _pid_alive(int(owner.get("pid", 0))):
        log.info("save.dir %s: taking over the lock of pid %s (no longer running)", path.parent, owner.get("pid"))
        return
    raise SaveDirInUseError(_in_use_message(path.parent, owner) + f" (this file system has no file locks: if that "
                            f"run is gone, delete {path})")


def _in_use_message(directory: Path, owner: dict[str, Any] | None) -> str:
    who = "another run"
    if owner:
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(owner.get("since", 0)))
        who = f"another run (pid {owner.get('pid')} on host {owner.get('host')}, since {since})"
    return (f"save.dir {directory} is in use by {who}: two runs writing one save.dir would delete each other's "
            "checkpoints. Wait for that run to end or stop it, or give this run another save.dir")


def _read_owner(fd: int) -> dict[str, Any] | None:
    try:
        raw = os.pread(fd, 4096, 0)
        return json.loads(raw) if raw.strip() else None
    except (OSError, ValueError):
        return None


def _write_owner(fd: int) -> None:
    data = json.dumps({"pid": os.getpid(), "host": HOST, "since": time.time()}).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


# ---- leftovers of other writers ---------------------------------------------------------------------------------
_LEFTOVER_NAME = re.compile(r"^\.(?:tmp|old)-step_\d{8}-(\d+)(?:-(.+))?$")


def owner_of_leftover(name: str) -> tuple[int | None, str | None]:
    """(pid, host) from a temporary folder's name: ``.tmp-step_00000004-<pid>-<host>`` (host absent in older names)."""
    match = _LEFTOVER_NAME.match(name)
    return (int(match.group(1)), match.group(2)) if match else (None, None)


def leftover_is_abandoned(directory: Path, name: str) -> bool:
    """Whether a temporary folder belongs to no running writer, so it may be removed.

    On this host (older names carry no host): when its process is gone, never ours or a live one's. From another
    host: when this process holds the folder's lock, as every writer holds it while it writes.
    """
    pid, host = owner_of_leftover(name)
    if pid is None:
        return False
    if host in (None, HOST):
        return pid != os.getpid() and not _pid_alive(pid)
    return SaveDirLock.held_by_this_process(directory)


def temp_name(prefix: str, name: str) -> str:
    """The name of this process's temporary folder for checkpoint `name`."""
    return f".{prefix}-{name}-{os.getpid()}-{HOST}"


# ---- checks before any training ---------------------------------------------------------------------------------
def check_output_dirs(spec: Any) -> None:
    """``save.dir``, ``save.export.dir`` and ``log.dir`` are (or can be created as) folders this process can write,
    with no dangling link; raises a SpecError naming the field. Creates nothing."""
    folders = (("save.dir", spec.save.dir), ("save.export.dir", spec.save.export.dir), ("log.dir", spec.log.dir))
    for field, directory in folders:
        if directory is not None:
            check_output_dir(field, Path(directory))
    if spec.save.dir is not None:
        _check_entries(Path(spec.save.dir))
        refuse_symlink(Path(spec.save.dir) / LOCK_FILE, "save.dir lock file")


def check_output_dir(field: str, directory: Path) -> None:
    """`directory` is (or can be created as) a folder this process can write; else a SpecError naming `field`."""
    if directory.is_symlink() and not directory.exists():
        raise OutputDirError(f"{field} {directory} is a symbolic link to {os.readlink(directory)}, which does not "
                             f"exist: create that folder, remove the link, or set {field} to another folder")
    if directory.exists():
        if not directory.is_dir():
            raise OutputDirError(f"{field} {directory} is a file, not a folder: set {field} to a folder")
        _probe_write(field, directory)
        return
    parent = directory.parent
    while not parent.exists() and parent != parent.parent:
        if parent.is_symlink():
            raise OutputDirError(f"{field} {directory}: {parent} is a symbolic link to {os.readlink(parent)}, which "
                                 f"does not exist: create it, or set {field} to another folder")
        parent = parent.parent
    if not parent.is_dir():
        raise OutputDirError(f"{field} {directory} cannot be created: {parent} is a file, not a folder")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise OutputDirError(f"{field} {directory} cannot be created: no write permission in {parent} (or it is on a "
                             f"read-only file system): choose a folder you can write, or fix its permissions")


def _probe_write(field: str, directory: Path) -> None:
    probe = directory / f".vlmfast-write-test-{os.getpid()}"
    try:
        with open_for_writing(probe, "wb", what=f"{field} write test file") as f:
            f.write(b"ok")
        probe.unlink()
    except OSError as exc:
        raise OutputDirError(f"{field} {directory} is not writable ({exc.strerror}): fix its permissions or free "
                             f"space, or set {field} to another folder") from exc
    try:
        os.listdir(directory)
    except OSError as exc:
        raise OutputDirError(f"{field} {directory} cannot be listed ({exc.strerror}): fix its permissions") from exc


def _check_entries(directory: Path) -> None:
    """Dangling links or unreadable checkpoints in save.dir fail now, not at the resume or the first save."""
    if not directory.is_dir():
        return
    for entry in directory.iterdir():
        if entry.name.startswith("step_") and entry.is_symlink() and not entry.exists():
            raise OutputDirError(f"save.dir {directory}: {entry.name} is a symbolic link to {os.readlink(entry)}, "
                                 "which does not exist: remove it (or restore its target)")
        if entry.name.startswith("step_") and entry.is_dir() and not os.access(entry, os.R_OK | os.X_OK):
            raise OutputDirError(f"save.dir {directory}: checkpoint {entry.name} is not readable (permissions): "
                                 "fix its permissions or remove it")


def estimate_checkpoint_bytes(model: torch.nn.Module, optimizer_name: str = "adamw", momentum: float = 0.0,
                              master_weights: bool = False, trainable_only: bool = False) -> int:
    """A lower estimate of one checkpoint's size: the model's state plus the optimizer's per-parameter states.

    `master_weights`: an fp32 copy of every trainable parameter is saved too (DeepSpeed bf16/fp16).
    `trainable_only`: the model's state is its trainable parameters alone (a LoRA run; the frozen base is
    fingerprinted, not saved).
    """
    if trainable_only:
        model_bytes = sum(_storage_bytes(p) for p in model.parameters() if p.requires_grad)
    else:
        model_bytes = sum(_storage_bytes(t) for t in model.state_dict().values() if isinstance(t, torch.Tensor))
    trainable = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters() if p.requires_grad)
    states = {"adamw": 2, "sgd": 1 if momentum else 0}.get(optimizer_name, 0)
    return model_bytes + trainable * 4 * (states + int(master_weights))


def _storage_bytes(tensor: torch.Tensor) -> int:
    numel = getattr(tensor, "ds_numel", None)  # ZeRO-3: the local tensor is an empty placeholder
    return numel * tensor.element_size() if numel is not None else tensor.numel() * tensor.element_size()


def check_free_space(directory: str | Path, needed: int, field: str = "save.dir") -> None:
    """Raise a SpecError naming `field` when `directory`'s file system has less than `needed` bytes free."""
    directory = Path(directory)
    probe = directory if directory.exists() else next(p for p in directory.parents if p.exists())
    free = shutil.disk_usage(probe).free
    if free < needed:
        raise OutputDirError(f"{field} {directory}: {format_bytes(free)} free, but one checkpoint of this run needs "
                             f"about {format_bytes(needed)}: free space, or set {field} to a folder on a larger disk")


def format_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


# ---- the trainer's side -----------------------------------------------------------------------------------------
def prepare_save_dir(directory: str | Path | None, checkpoint_bytes: Callable[[], int]) -> SaveDirLock | None:
    """At the start of a run, on rank 0: take ``save.dir``'s lock and check there is room for one more checkpoint
    (raises naming ``save.dir`` otherwise). The caller releases the lock at the end of the run.

    Usage: ``lock = prepare_save_dir(spec.save.dir, lambda: estimate_checkpoint_bytes(model))``
    """
    if directory is None:
        return None
    lock = SaveDirLock(directory)
    lock.acquire()
    try:
        check_free_space(directory, checkpoint_bytes())
    except BaseException:
        lock.release()
        raise
    return lock
