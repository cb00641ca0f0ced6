"""Atomic, verified checkpoints: a run killed at any moment leaves its last complete checkpoint intact, and a
checkpoint damaged afterwards is detected before anything is loaded from it.

A checkpoint is a folder ``step_00000100/`` holding ``state.pt``, ``meta.json`` (and, for sharded backends, the
shards) and, written last, ``manifest.json``: the size and SHA-256 of every file. It is written under a temporary
name, flushed to disk, then renamed: a folder with the final name is always complete. Before loading, every file
is checked against the manifest (and no file may be added); ``resume: auto`` falls back from a damaged newest
checkpoint to the previous verified one, with a warning naming the damage. Nothing is unpickled with
``weights_only=False``.

A failed save (a full disk, an I/O error) removes its partial folder, keeps every previous checkpoint and raises
:class:`CheckpointWriteError` naming ``save.dir`` and the bytes it needed.

Usage::

    path = save_checkpoint("ckpt", step=100, state=trainer_state, keep_last=3)
    state = load_checkpoint(latest_verified_checkpoint("ckpt"))     # verified against its manifest first
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import pickle
import re
import shutil
import time
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from vlmfast.checkpoints.save_dir import SaveDirLock, format_bytes, leftover_is_abandoned, temp_name
from vlmfast.common.safe_files import open_for_writing
from vlmfast.common.sections import SpecError

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d{8})$")
STATE_FILE = "state.pt"
META_FILE = "meta.json"
MANIFEST_FILE = "manifest.json"
MANIFEST_FORMAT = 1
_LEFTOVER = re.compile(r"^\.(tmp|old)-step_\d{8}-")
_CHUNK = 8 << 20


class CheckpointError(RuntimeError):
    """Base of the checkpoint errors; each message names the file or folder and what to do."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint whose files do not match its manifest, or that torch.load cannot read; names the file."""


class CheckpointWriteError(CheckpointError):
    """A save that failed (disk full, I/O error): the partial folder is removed, the previous checkpoints are kept."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


# ---- writing ----------------------------------------------------------------------------------------------------
def save_checkpoint(directory: str | Path, step: int, state: dict[str, Any], keep_last: int = 3,
                    meta: dict[str, Any] | None = None, staged: Path | None = None) -> Path:
    """Write `state` atomically as checkpoint `step` in `directory`; keep the newest `keep_last`.

    `staged`: a folder from :func:`staging_dir` that other ranks already wrote their shards into; it becomes the
    checkpoint together with `state`, in the same atomic rename. Holds the folder's :class:`SaveDirLock` meanwhile
    (re-entrant: the trainer holds it for the whole run).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    with SaveDirLock(directory):
        tmp = staged or _fresh_temp_dir(directory, step, needed=lambda: state_bytes(state))
        write = [(STATE_FILE, lambda f: torch.save(state, f)),
                 (META_FILE, lambda f: f.write(json.dumps({"step": step, "time": time.time(), **(meta or {})},
                                                          indent=2).encode()))]
        final = commit_checkpoint(directory, step, tmp, write, needed=lambda: state_bytes(state))
        prune_checkpoints(directory, keep_last)
    return final


def commit_checkpoint(directory: Path, step: int, tmp: Path, files: list[tuple[str, Callable[[Any], Any]]],
                      needed: Callable[[], int]) -> Path:
    """Write `files` into `tmp`, fsync, write the manifest of everything in `tmp`, rename it to its final name.

    On any failure the temporary folder is removed (the previous checkpoints are untouched) and an OSError becomes
    :class:`CheckpointWriteError` naming `directory` and about `needed()` bytes.
    """
    final = directory / checkpoint_name(step)
    try:
        hashed = {name: _write_synced(tmp / name, write) for name, write in files}
        write_manifest(tmp, step, hashed)
        _publish(directory, tmp, final)
        _remember_verified(final)  # hashed from these very files: a resume in this process need not read them again
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        cause = _os_error_in(exc)
        if cause is not None:
            raise _write_error(directory, step, cause, needed) from exc
        raise
    return final


def _os_error_in(exc: BaseException) -> OSError | None:
    """The OSError behind `exc` (torch.save reports a failed write as a RuntimeError of its zip writer, with the
    OSError as its context)."""
    seen = 0
    while exc is not None and seen < 8:
        if isinstance(exc, OSError):
            return exc
        exc, seen = exc.__cause__ or exc.__context__, seen + 1
    return None


def _publish(directory: Path, tmp: Path, final: Path) -> None:
    if final.is_symlink() or final.exists():  # re-saving the same step: move the old one aside, keep the swap atomic
        old = directory / temp_name("old", final.name)
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(directory)


def _write_error(directory: Path, step: int, exc: OSError, needed: Callable[[], int]) -> CheckpointWriteError:
    try:
        free = shutil.disk_usage(directory).free
        need = needed()
    except Exception:  # the message must not fail on the way out
        free, need = None, None
    space = f" It needs about {format_bytes(need)}; {format_bytes(free)} are free on that disk." if need else ""
    latest = latest_checkpoint(directory)
    kept = f"the previous checkpoint {latest.name} is intact" if latest else "no earlier checkpoint exists"
    advice = ("Free space, or set save.dir to a folder on a larger disk" if exc.errno in (errno.ENOSPC, errno.EDQUOT)
              else "Check the disk and the folder's permissions, or set save.dir to another folder")
    return CheckpointWriteError(
        f"save.dir {directory}: cannot write checkpoint {checkpoint_name(step)} ({exc.strerror or exc}).{space} "
        f"The partial checkpoint was removed and {kept}. {advice}; resume continues from the last checkpoint"
    )


def state_tensors(state: Any) -> list[torch.Tensor]:
    """The tensors of a nested state (dicts, lists, tuples), in insertion order (torch's pytree traversal)."""
    return [leaf for leaf in tree_leaves(state) if isinstance(leaf, torch.Tensor)]


def state_bytes(state: Any) -> int:
    """Bytes of the tensor storages in `state` (each storage once, as torch.save writes them)."""
    storages = (t.untyped_storage() for t in state_tensors(state))
    return sum({s.data_ptr() or id(s): s.nbytes() for s in storages}.values())


def _fresh_temp_dir(directory: Path, step: int, needed: Callable[[], int] = lambda: 0) -> Path:
    """This process's empty temporary folder for checkpoint `step`; a folder that became read-only (or full) since
    the run started is a :class:`CheckpointWriteError` naming save.dir, not an OSError naming the temporary folder."""
    tmp = directory / temp_name("tmp", checkpoint_name(step))
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
    except OSError as exc:
        raise _write_error(directory, step, exc, needed) from exc
    return tmp


def staging_dir(directory: str | Path, step: int, world_size: int = 1) -> Path:
    """The temporary folder all ranks write a sharded checkpoint into (rank 0's name: a collective when sharded)."""
    directory = Path(directory)
    name = [temp_name("tmp", checkpoint_name(step))]
    if world_size > 1:
        torch.distributed.broadcast_object_list(name, src=0)
    staged = directory / name[0]
    if world_size == 1 or torch.distributed.get_rank() == 0:
        staged = _fresh_temp_dir(directory, step)
    if world_size > 1:
        torch.distributed.barrier()
    return staged


def _write_synced(path: Path, write: Any) -> str:
    """Write through `write(file)`, fsync; returns the SHA-256 of the bytes written (hashed on the way, so the
    manifest need not read the file back)."""
    with open_for_writing(path, "wb", what="checkpoint file") as f:  # in our temporary folder; no link followed anyway
        hashing = _HashingWriter(f)
        write(hashing)
        f.flush()
        os.fsync(f.fileno())
    return hashing.digest.hexdigest()


class _HashingWriter:
    """A write-only file that hashes what passes through (torch.save writes its zip sequentially: write, flush)."""

    def __init__(self, file: Any) -> None:
        self.file = file
        self.digest = hashlib.sha256()

    def write(self, data: Any) -> int:
        self.digest.update(data)
        return self.file.write(data)

    def __getattr__(self, name: str) -> Any:
        if name in ("seek", "truncate"):  # a writer that rewinds would make the running hash wrong
            raise AttributeError(name)
        return getattr(self.file, name)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- the manifest -----------------------------------------------------------------------------------------------
def write_manifest(folder: Path, step: int, hashed: dict[str, str] | None = None) -> dict[str, Any]:
    """Hash every file under `folder` (fsyncing files other ranks wrote) and write ``manifest.json`` last.
    `hashed`: SHA-256s already known (files this process wrote and fsynced), not read again."""
    files: dict[str, dict[str, Any]] = {}
    for path in sorted(_files_under(folder)):
        rel = path.relative_to(folder).as_posix()
        if rel == MANIFEST_FILE:
            continue
        digest = (hashed or {}).get(rel) or _sha256(path, fsync=True)
        files[rel] = {"bytes": path.stat().st_size, "sha256": digest}
    for sub in sorted({p.parent for p in _files_under(folder)} | {folder}):
        _fsync_dir(sub)
    manifest = {"format": MANIFEST_FORMAT, "step": step, "files": files}
    _write_synced(folder / MANIFEST_FILE, lambda f: f.write(json.dumps(manifest, indent=1).encode()))
    return manifest


def _files_under(folder: Path) -> list[Path]:
    found = []
    for root, dirs, names in os.walk(folder, followlinks=False):
        found += [Path(root) / n for n in names]
        found += [Path(root) / d for d in dirs if (Path(root) / d).is_symlink()]  # a linked folder: an unexpected file
    return found


def _sha256(path: Path, fsync: bool = False) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            digest.update(chunk)
        if fsync:
            os.fsync(f.fileno())
    return digest.hexdigest()


_verified: dict[str, tuple[Any, ...]] = {}  # folder -> stat signature of its files when they last matched


def verify_checkpoint(path: str | Path) -> None:
    """Check every file of checkpoint folder `path` against its manifest; raise :class:`CorruptCheckpointError`
    naming the first file that is missing, of another size or content, or not in the manifest.

    A folder written before manifests existed is checked by the CRCs of its zip files only (logged). A folder
    verified earlier in this process and not modified since is not hashed again.
    """
    folder = Path(path)
    manifest_path = folder / MANIFEST_FILE
    if not manifest_path.is_file():
        _verify_legacy(folder)
        return
    try:
        manifest = json.loads(manifest_path.read_text())
        files: dict[str, dict[str, Any]] = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CorruptCheckpointError(f"{manifest_path} cannot be read ({type(exc).__name__}: {exc}): the checkpoint "
                                     f"cannot be verified. {_DELETE_ADVICE}") from exc
    _check_manifest_entries(folder, files)
    on_disk = {p.relative_to(folder).as_posix(): p for p in _files_under(folder)}
    on_disk.pop(MANIFEST_FILE, None)
    extra = sorted(set(on_disk) - set(files))
    if extra:
        more = f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""
        raise CorruptCheckpointError(f"{folder / extra[0]}{more}: not listed in this checkpoint's manifest, so not "
                                     f"written by vlmfast's save: nothing is loaded. Remove it, or "
                                     f"{_DELETE_ADVICE[0].lower()}{_DELETE_ADVICE[1:]}")
    if _verified.get(str(folder.resolve())) == _signature(on_disk):
        return
    for rel, expected in files.items():
        _verify_file(folder / rel, expected)
    _remember_verified(folder)


def _check_manifest_entries(folder: Path, files: Any) -> None:
    """Every manifest entry is a plain relative name of a file inside `folder`: no absolute path, no `..`, nothing
    that resolves outside through a link. Otherwise verifying would read (and loading trust) a file elsewhere."""
    if not isinstance(files, dict):
        raise CorruptCheckpointError(f"checkpoint {folder}: its manifest's 'files' is not a mapping. {_DELETE_ADVICE}")
    root = folder.resolve()
    for rel in files:
        parts = rel.split("/") if isinstance(rel, str) else []
        plain = bool(rel) and not any(p in ("", ".", "..") for p in parts) and "\\" not in rel and "\0" not in rel
        if plain:
            resolved = (folder / rel).resolve()
            plain = resolved != root and resolved.is_relative_to(root)
        if not plain:
            raise CorruptCheckpointError(
                f"checkpoint {folder}: its manifest lists {rel!r}, which is not a plain relative name of a file inside "
                f"the checkpoint (absolute paths, '..' and links leading out are refused), so nothing is read or "
                f"loaded: the manifest was not written by vlmfast's save. {_DELETE_ADVICE}")


def _signature(files: dict[str, Path]) -> tuple[Any, ...]:
    return tuple(sorted((rel, _stat_key(p)) for rel, p in files.items()))


def _remember_verified(folder: Path) -> None:
    files = {p.relative_to(folder).as_posix(): p for p in _files_under(folder)}
    files.pop(MANIFEST_FILE, None)
    _verified[str(folder.resolve())] = _signature(files)


def _stat_key(path: Path) -> tuple[int, int, int]:
    st = path.lstat()
    return st.st_size, st.st_mtime_ns, st.st_ino


def _verify_file(file: Path, expected: dict[str, Any]) -> None:
    if not file.is_file() or file.is_symlink():
        raise CorruptCheckpointError(f"{file} is missing (listed in the checkpoint's manifest). {_DELETE_ADVICE}")
    size = file.stat().st_size
    if size != expected.get("bytes"):
        raise CorruptCheckpointError(f"{file} has {size} bytes where the manifest says {expected.get('bytes')}: it "
                                     f"was truncated or changed after the save. {_DELETE_ADVICE}")
    if _sha256(file) != expected.get("sha256"):
        raise CorruptCheckpointError(f"{file} does not match its SHA-256 in the manifest: its bytes changed after the "
                                     f"save (disk or copy error, or tampering). {_DELETE_ADVICE}")


def _verify_legacy(folder: Path) -> None:
    """Checkpoints of vlmfast versions without manifests: the zip CRCs torch.save wrote catch flipped bytes."""
    for file in sorted(_files_under(folder)):
        if file.suffix != ".pt" or not zipfile.is_zipfile(file):
            continue
        try:
            with zipfile.ZipFile(file) as archive:
                bad = archive.testzip()
        except (zipfile.BadZipFile, OSError, EOFError) as exc:
            raise CorruptCheckpointError(f"{file} cannot be read: {exc}. {_DELETE_ADVICE}") from exc
        if bad is not None:
            raise CorruptCheckpointError(f"{file}: entry {bad} fails its CRC check: the file changed after the save. "
                                         f"{_DELETE_ADVICE}")
    log.info("%s has no manifest (written by an older vlmfast): checked the zip CRCs of its files only", folder)


_DELETE_ADVICE = "Delete that checkpoint folder to resume from the previous one"


# ---- finding and loading ----------------------------------------------------------------------------------------
def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints in `directory`, oldest first (temporary folders of killed writers are ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if STEP_DIR.match(p.name) and p.is_dir() and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint, or None (not verified: see :func:`latest_verified_checkpoint`)."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def latest_verified_checkpoint(directory: str | Path) -> Path | None:
    """The newest checkpoint whose files match its manifest, or None when there is none at all.

    A damaged newer one is skipped with a warning naming it and what is wrong. When checkpoints exist but none
    verifies, raises :class:`CorruptCheckpointError` (starting afresh would prune them away).
    """
    found = list_checkpoints(directory)
    damaged: list[str] = []
    for path in reversed(found):
        try:
            verify_checkpoint(path)
        except (CorruptCheckpointError, OSError) as exc:
            damaged.append(f"{path.name}: {exc}")
            log.warning("checkpoint %s is damaged, falling back to the previous one: %s", path, exc)
            continue
        return path
    if damaged:
        raise CorruptCheckpointError(f"no checkpoint in {directory} passes verification, so nothing is resumed and "
                                     f"nothing is deleted: {'; '.join(damaged)}")
    return None


def prune_checkpoints(directory: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints, and leftovers of writers that are gone (never a
    running writer's temporary folder: see :func:`vlmfast.checkpoints.save_dir.leftover_is_abandoned`)."""
    directory = Path(directory)
    for stale in directory.iterdir():
        if _LEFTOVER.match(stale.name) and leftover_is_abandoned(directory, stale.name):
            shutil.rmtree(stale, ignore_errors=True)
    for old in list_checkpoints(directory)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu", verify: bool = True) -> dict[str, Any]:
    """Read a checkpoint folder (or its state.pt) written by :func:`save_checkpoint`, verified against its manifest
    first (`verify`), with torch's weights-only unpickler."""
    path = Path(path)
    file = path / STATE_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: expected a folder with {STATE_FILE}")
    if verify and (path.is_dir() or (file.parent / MANIFEST_FILE).is_file()):
        verify_checkpoint(file.parent)
    try:
        return torch.load(file, map_location=map_location, weights_only=True)
    except (PermissionError, FileNotFoundError):
        raise
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, OSError) as exc:  # torch.load on bad bytes
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        raise CorruptCheckpointError(
            f"{file} cannot be read: it is truncated or corrupt, or not a vlmfast checkpoint ({type(exc).__name__}: "
            f"{reason}). Checkpoints are written atomically, so something changed it afterwards: delete that folder "
            "to resume from the previous checkpoint"
        ) from exc


def resume_path(resume: str, directory: str | Path | None) -> Path | None:
    """The checkpoint `save.resume` asks for, verified: 'auto' (newest verified in `directory`, if any), 'never', or
    a path (refused naming the bad file if it does not verify)."""
    if resume == "never":
        return None
    if resume == "auto":
        if not directory:
            return None
        try:
            return latest_verified_checkpoint(directory)
        except CorruptCheckpointError as exc:
            raise SpecError(f"save.resume: cannot resume from {directory}: {exc}") from exc
    path = Path(resume)
    if not path.exists():
        raise SpecError(f"save.resume: checkpoint {path} does not exist; use 'auto', 'never' or a path")
    folder = path if path.is_dir() else path.parent
    try:
        verify_checkpoint(folder)
    except CorruptCheckpointError as exc:
        raise SpecError(f"save.resume: cannot resume from {path}: {exc}") from exc
    except OSError as exc:  # unreadable files (permissions), a dangling link inside
        raise SpecError(f"save.resume: cannot resume from {path}: {exc.filename or path} cannot be read "
                        f"({exc.strerror or exc}): fix its permissions, or resume from another checkpoint") from exc
    return path


# Spec fields whose change on resume would silently mix two trainings, refused with the reason: the checkpoint's
# optimizer/scheduler state would override the new value, its data position counts batches of the old order, or
# its state has another backend's layout. A field listed under one of these prefixes is refused too.
REFUSED_ON_RESUME: dict[str, str] = {
    "seed": "the data order and the saved data position follow the seed",
    "batch_size": "the saved data position counts batches of the old size",
    "data.shuffle": "the saved data position points into the old sample order",
    "data.drop_last": "the saved data position points into the old sample order",
    "data.group_by_length": "the saved data position points into the old sample order",
    "optimizer": "the optimizer state in the checkpoint carries the old setting and would silently override it",
    "scheduler": "the scheduler state in the checkpoint carries the old schedule, so lr would jump or be ignored",
    "engine": "the checkpoint holds another engine's state layout",
    "deepspeed.zero_stage": "the checkpoint holds another ZeRO stage's shards",
}
# The kernel choice (not part of the optimizer state); accepting a changed data set (said in its own warning).
ALLOWED_ON_RESUME = ("optimizer.implementation", "save.accept_data_change")
# Allowed, but they change what is trained from here on: said in a warning (other changes are logged as info).
CHANGES_TRAINING_ON_RESUME = ("max_steps", "precision", "grad_clip", "loss.weighting", "loss.shift_labels",
                              "loss.ignore_index", "loss.label_key", "packing.enabled", "packing.max_tokens")


def check_global_batch(saved_batch: int, saved_world: int, batch_size: int, world_size: int) -> None:
    """Refuse a resume whose global batch (ranks x batch_size) changed: the data position counts global batches, and
    token-weighted accumulation makes any split of the same global batch give the same gradient, so only the global
    batch must stay. Usage: ``check_global_batch(4, 2, 8, 1)`` (2 ranks x 4 continue on 1 rank x 8)."""
    saved_global, global_batch = saved_batch * saved_world, batch_size * world_size
    if saved_global == global_batch:
        return
    fix = (f"set batch_size: {saved_global // world_size} to continue on {world_size} rank(s)"
           if saved_global % world_size == 0 else
           f"resume on a number of ranks that divides {saved_global} (its global batch)")
    raise SpecError(
        f"save.resume: the checkpoint's global batch is {saved_world} rank(s) x batch_size {saved_batch} = "
        f"{saved_global} samples, this run's {world_size} x {batch_size} = {global_batch}: the data position counts "
        f"global batches, so the run would not continue the same trajectory. To continue it, {fix} (batch_size "
        "counts samples per rank); or start afresh (save.resume: never)")


class _Absent:
    """A spec field that the checkpoint's vlmfast version did not have yet."""

    def __repr__(self) -> str:
        return "(absent)"


_MISSING = _Absent()


def check_resume_compatible(saved: dict[str, Any], current: dict[str, Any], accepted: tuple[str, ...] = ()) -> None:
    """Refuse to continue a run whose spec changed in a field that would silently mix two trainings
    (:data:`REFUSED_ON_RESUME`); say which other fields changed and what that means. `accepted`: refused fields whose
    change the caller verified carries over (batch_size under an unchanged global batch, a portable engine pair)."""
    changed = _changed_fields(saved, current)
    for dotted, (old, new) in changed.items():
        reason = None if dotted in accepted else _refusal(dotted)
        if reason is not None and old is not _MISSING:  # a field newer than the checkpoint's vlmfast is no change
            raise SpecError(
                f"cannot resume: the checkpoint was written with {dotted}={old!r} but the spec now says {new!r} "
                f"({reason}). Restore {dotted}: {old!r} to continue this run, or start a new one (save.resume: never, "
                "or another save.dir), loading the checkpoint's model weights yourself if you want to keep them."
            )
    _log_allowed_changes(changed, saved)


def _refusal(dotted: str) -> str | None:
    if dotted in ALLOWED_ON_RESUME:
        return None
    for prefix, reason in REFUSED_ON_RESUME.items():
        if dotted == prefix or dotted.startswith(prefix + "."):
            return reason
    return None


def _log_allowed_changes(changed: dict[str, tuple[Any, Any]], saved: dict[str, Any]) -> None:
    if not changed:
        return
    text = ", ".join(f"{k} {old!r} -> {new!r}" for k, (old, new) in changed.items())
    training = [k for k in changed if any(k == p or k.startswith(p + ".") for p in CHANGES_TRAINING_ON_RESUME)]
    if not training:
        log.info("resuming with a changed spec: %s (the state carries over unchanged)", text)
        return
    schedule = _get_dotted(saved, "scheduler.name") not in (None, "constant") and "max_steps" in training
    log.warning("resuming with a changed spec: %s. %s change(s) what is trained from here on%s", text,
                ", ".join(training), "; the lr schedule now spans the new max_steps" if schedule else "")


def _changed_fields(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    old, new = _flatten(saved), _flatten(current)
    keys = sorted(old.keys() | new.keys())
    pairs = {k: (old.get(k, _MISSING), new.get(k, _MISSING)) for k in keys}
    return {k: pair for k, pair in pairs.items() if pair[0] != pair[1]}


def _flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _get_dotted(data: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data
