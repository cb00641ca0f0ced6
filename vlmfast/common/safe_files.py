"""Every file vlmfast writes outside a checkpoint's temporary folder goes through here: no write follows a symlink.

A run's folders (``log.dir``, ``save.dir``, profiler and bench outputs) are often shared. A symbolic link planted
there under a name vlmfast writes (``metrics.jsonl -> ~/.bashrc``) would otherwise make the run append to, truncate
or replace the file it points to, with the user's rights. So:

- :func:`open_fd` / :func:`open_for_writing` open with ``O_NOFOLLOW`` (a link is refused by the kernel itself, no
  check-then-open race) and refuse anything but a regular file with a single name (a FIFO, a device, a hard link
  to another file);
- :func:`write_atomic` writes a temporary file created with ``O_EXCL | O_NOFOLLOW``, then renames it over the
  destination;
- :func:`library_output` gives a library that only takes a path (matplotlib, the torch profiler, numpy) a path in a
  fresh private folder (mode 0700, ours), then renames the result into place;
- :func:`library_folder_output` does the same for a library that writes a whole folder (``save_pretrained``): the
  fresh private folder takes the destination's place when it is complete (the previous folder moved aside, then
  removed), so a link planted in the destination is never written through and no reader sees a mix;
- :func:`refuse_symlink` checks a path handed to a library we cannot give a file object (TensorBoard, trackers).

A refusal is an :class:`UnsafeOutputError` naming the path, where the link points and what to do. The configured
folders themselves (``log.dir`` …) may be links the user made; the files and sub-folders vlmfast creates in them may
not.

Usage::

    with open_for_writing(log_dir / "out.json", "w") as f:   # "w"/"wb" truncate, "a"/"ab" append, "x"/"xb" new
        f.write(text)
    write_atomic(log_dir / "report.json", text)
    with library_output(log_dir / "plot.png") as tmp:
        fig.savefig(tmp)
    with library_folder_output(export_dir) as tmp:
        model.save_pretrained(tmp)
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from vlmfast.common.sections import SpecError

__all__ = ["UnsafeOutputError", "ensure_dir", "library_folder_output", "library_output", "open_fd", "open_for_writing",
           "refuse_symlink", "write_atomic"]

_MODES = {"w": os.O_TRUNC, "a": os.O_APPEND, "x": os.O_EXCL}


class UnsafeOutputError(SpecError):
    """A path vlmfast would write is a symbolic link (or not a plain file): refused; the message names it."""


def _refusal(path: Path, what: str, reason: str) -> UnsafeOutputError:
    label = f"{what} {path}" if what else str(path)
    return UnsafeOutputError(
        f"{label} {reason}: vlmfast never writes through it, since a link (or special file) planted in a shared folder "
        f"would make the run overwrite another file. Remove {path} (check who created it), or write to another folder")


def refuse_symlink(path: str | Path, what: str = "") -> Path:
    """Raise :class:`UnsafeOutputError` if `path` itself is a symbolic link (its folder may be one the user made);
    returns `path` as a Path. A path that does not exist passes."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return path
    if stat.S_ISLNK(st.st_mode):
        raise _link_refusal(path, what)
    return path


def _link_refusal(path: Path, what: str) -> UnsafeOutputError:
    try:
        target = os.readlink(path)
    except OSError:
        target = "?"
    return _refusal(path, what, f"is a symbolic link (to {target})")


def ensure_dir(path: str | Path, what: str = "") -> Path:
    """Create folder `path` (and its parents) for vlmfast's own files; refuse it if it is a symbolic link."""
    path = refuse_symlink(path, what)
    path.mkdir(parents=True, exist_ok=True)
    return refuse_symlink(path, what)


def open_fd(path: str | Path, flags: int = os.O_WRONLY, mode: int = 0o644, what: str = "") -> int:
    """``os.open(path, flags | O_CREAT | O_NOFOLLOW)``, refusing a symbolic link, anything but a regular file, and a
    file with other names (hard links). Add ``O_TRUNC`` / ``O_APPEND`` / ``O_EXCL`` / ``O_RDWR`` as needed."""
    path = Path(path)
    # O_NONBLOCK: a planted FIFO must not block the open (it is refused just below); cleared again afterwards.
    # O_TRUNC only once the file passed the checks: a hard link to another file must not be cut at the open.
    truncate, flags = bool(flags & os.O_TRUNC), flags & ~os.O_TRUNC
    try:
        fd = os.open(path, flags | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.EEXIST) and os.path.islink(path):
            raise _link_refusal(path, what) from None
        if exc.errno == errno.ENXIO:  # a FIFO with no reader
            raise _refusal(path, what, "is not a regular file") from None
        if exc.errno == errno.EISDIR:
            label = f"{what} {path}" if what else str(path)
            raise SpecError(f"{label} is a folder where vlmfast writes a file: move it away, or write to another "
                            "folder") from exc
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _refusal(path, what, "is not a regular file")
        if st.st_nlink > 1:
            raise _refusal(path, what, f"is a hard link ({st.st_nlink} names for one file)")
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        if truncate:
            os.ftruncate(fd, 0)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_for_writing(path: str | Path, mode: str = "wb", what: str = "", **kwargs: Any) -> IO[Any]:
    """A file object like ``open(path, mode)`` for "w", "a", "x" (+ "b", "+"), through :func:`open_fd`."""
    base = mode.replace("b", "").replace("+", "").replace("t", "")
    if base not in _MODES:
        raise ValueError(f"open_for_writing: mode {mode!r} is not a writing mode")
    flags = _MODES[base] | (os.O_RDWR if "+" in mode else os.O_WRONLY)
    fd = open_fd(path, flags, what=what)
    try:
        return open(fd, mode.replace("x", "w"), **kwargs)
    except BaseException:
        os.close(fd)
        raise


def write_atomic(path: str | Path, data: str | bytes, what: str = "", fsync: bool = False) -> None:
    """Replace `path` with `data` atomically: a temporary file created with O_EXCL | O_NOFOLLOW next to it, then
    ``os.replace``. A symbolic link at `path` is refused (and ``os.replace`` would replace a link itself, never
    the file it points to, so a link planted after the check is harmless too)."""
    path = refuse_symlink(path, what)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    raw = data.encode() if isinstance(data, str) else data
    try:
        with open_for_writing(tmp, "xb", what=what) as f:
            f.write(raw)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        refuse_symlink(path, what)
        os.replace(tmp, path)  # renames over a link itself (never follows it)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def library_output(path: str | Path, what: str = "") -> Iterator[Path]:
    """A path for a library that writes `path` by name: inside a fresh private folder (mkdtemp: mode 0700, so no
    one else can plant a link in it) next to `path`; renamed into place when the block succeeds (``os.replace``:
    a link at `path` is replaced itself, never followed, and one there beforehand is refused)."""
    path = refuse_symlink(path, what)
    folder = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
    try:
        tmp = folder / path.name
        yield tmp
        if os.path.islink(tmp) or not os.path.isfile(tmp):
            raise _refusal(tmp, what, "was not written as a regular file")
        refuse_symlink(path, what)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextlib.contextmanager
def library_folder_output(path: str | Path, what: str = "") -> Iterator[Path]:
    """A fresh private folder (mkdtemp: mode 0700) next to folder `path`, for a library that writes a whole folder by
    name; when the block succeeds it takes `path`'s place (given the usual folder mode): a folder already there is
    moved aside, the new one renamed in, the old one removed. A reader sees the old folder or the new one, never a
    mix; a link planted in `path` is never written through (nothing is written into `path` itself); on an error
    nothing changes at `path`. `path` itself may be a link the user made to a folder: its target is replaced."""
    path = Path(os.path.realpath(path)) if os.path.islink(path) else Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    folder = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
    try:
        yield folder
        os.chmod(folder, 0o777 & ~_umask())
        _replace_folder(folder, path, what)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # gone already when it was published


def _replace_folder(new: Path, path: Path, what: str) -> None:
    """Rename folder `new` to `path`; a folder at `path` is moved aside first (a rename cannot replace a non-empty
    folder), and put back if the second rename fails."""
    if not os.path.lexists(path):
        os.rename(new, path)
        return
    if os.path.islink(path) or not os.path.isdir(path):
        raise _refusal(path, what, "is not a folder")
    aside = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".old", dir=path.parent))
    try:
        os.rename(path, aside / path.name)
        os.rename(new, path)
    except BaseException:
        if not os.path.lexists(path) and os.path.lexists(aside / path.name):
            os.rename(aside / path.name, path)  # the old folder back where it was
        with contextlib.suppress(OSError):
            os.rmdir(aside)  # only when empty: never the old folder
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
