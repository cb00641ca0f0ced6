"""Atomic checkpoints: a run killed at any moment leaves its last complete checkpoint intact.

A checkpoint is a folder ``step_00000100/`` holding ``state.pt`` and ``meta.json``. It is written under a
temporary name, flushed to disk, then renamed: a folder with the final name is always complete.

Usage::

    path = save_checkpoint("ckpt", step=100, state=trainer_state, keep_last=3)
    state = load_checkpoint(latest_checkpoint("ckpt"))
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^step_(\d{8})$")
STATE_FILE = "state.pt"
META_FILE = "meta.json"


class CorruptCheckpointError(RuntimeError):
    """A checkpoint file that torch.load cannot read; the message names it."""


def checkpoint_name(step: int) -> str:
    return f"step_{step:08d}"


def save_checkpoint(directory: str | Path, step: int, state: dict[str, Any], keep_last: int = 3,
                    meta: dict[str, Any] | None = None, staged: Path | None = None) -> Path:
    """Write `state` atomically as checkpoint `step` in `directory`; keep the newest `keep_last`.

    `staged`: a folder from :func:`staging_dir` that other ranks already wrote their shards into; it becomes the
    checkpoint together with `state`, in the same atomic rename.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    final = directory / checkpoint_name(step)
    tmp = staged or directory / f".tmp-{checkpoint_name(step)}-{os.getpid()}"
    if staged is None:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
    _write_synced(tmp / STATE_FILE, lambda f: torch.save(state, f))
    info = {"step": step, "time": time.time(), **(meta or {})}
    _write_synced(tmp / META_FILE, lambda f: f.write(json.dumps(info, indent=2).encode()))
    if final.exists():  # re-saving the same step: move the old one aside so the swap stays atomic
        old = directory / f".old-{final.name}-{os.getpid()}"
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    _fsync_dir(directory)
    prune_checkpoints(directory, keep_last)
    return final


def staging_dir(directory: str | Path, step: int, world_size: int = 1) -> Path:
    """The temporary folder all ranks write a sharded checkpoint into (rank 0's name: a collective when sharded)."""
    directory = Path(directory)
    name = [f".tmp-{checkpoint_name(step)}-{os.getpid()}"]
    if world_size > 1:
        torch.distributed.broadcast_object_list(name, src=0)
    staged = directory / name[0]
    if world_size == 1 or torch.distributed.get_rank() == 0:
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(parents=True)
    if world_size > 1:
        torch.distributed.barrier()
    return staged


def _write_synced(path: Path, write: Any) -> None:
    with open(path, "wb") as f:
        write(f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(directory: str | Path) -> list[Path]:
    """Complete checkpoints in `directory`, oldest first (temporary folders of killed writers are ignored)."""
    directory = Path(directory)
    if not directory.is_dir():
        return []
    found = [p for p in directory.iterdir() if p.is_dir() and STEP_DIR.match(p.name) and (p / STATE_FILE).is_file()]
    return sorted(found, key=lambda p: int(STEP_DIR.match(p.name).group(1)))


def latest_checkpoint(directory: str | Path) -> Path | None:
    """The newest complete checkpoint, or None."""
    found = list_checkpoints(directory)
    return found[-1] if found else None


def prune_checkpoints(directory: str | Path, keep_last: int) -> None:
    """Delete all but the newest `keep_last` complete checkpoints, and leftovers of interrupted writes."""
    directory = Path(directory)
    for stale in directory.glob(".tmp-step_*"):
        pid = stale.name.rsplit("-", 1)[-1]
        if pid != str(os.getpid()):
            shutil.rmtree(stale, ignore_errors=True)
    for old in list_checkpoints(directory)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint folder (or its state.pt) written by :func:`save_checkpoint`."""
    path = Path(path)
    file = path / STATE_FILE if path.is_dir() else path
    if not file.is_file():
        raise FileNotFoundError(f"no checkpoint at {path}: expected a folder with {STATE_FILE}")
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
    """The checkpoint `save.resume` asks for: 'auto' (newest in `directory`, if any), 'never', or a path."""
    from vlmfast.spec import SpecError

    if resume == "never":
        return None
    if resume == "auto":
        return latest_checkpoint(directory) if directory else None
    path = Path(resume)
    if not path.exists():
        raise SpecError(f"save.resume: checkpoint {path} does not exist; use 'auto', 'never' or a path")
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
ALLOWED_ON_RESUME = ("optimizer.implementation",)  # the kernel choice: not part of the optimizer state
# Allowed, but they change what is trained from here on: said in a warning (other changes are logged as info).
CHANGES_TRAINING_ON_RESUME = ("max_steps", "precision", "grad_clip", "loss.weighting", "loss.shift_labels",
                              "loss.ignore_index", "loss.label_key", "packing.enabled", "packing.max_tokens")


def check_same_world_size(saved: int, current: int) -> None:
    """Refuse a resume on another number of ranks: `batch_size` is per rank, so the global batch, the data shards
    and the per-rank generators would all change silently."""
    from vlmfast.spec import SpecError

    if saved != current:
        raise SpecError(
            f"save.resume: the checkpoint was written by {saved} rank(s), this run has {current}: batch_size counts "
            f"samples per rank, so the global batch ({saved} x batch_size) and the data position would change. Resume "
            f"on {saved} rank(s), or start afresh (save.resume: never) with batch_size chosen for {current} rank(s)")


class _Absent:
    """A spec field that the checkpoint's vlmfast version did not have yet."""

    def __repr__(self) -> str:
        return "(absent)"


_MISSING = _Absent()


def check_resume_compatible(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Refuse to continue a run whose spec changed in a field that would silently mix two trainings
    (:data:`REFUSED_ON_RESUME`); say which other fields changed and what that means."""
    from vlmfast.spec import SpecError

    changed = _changed_fields(saved, current)
    for dotted, (old, new) in changed.items():
        reason = _refusal(dotted)
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
