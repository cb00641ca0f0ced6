"""Atomic checkpoints: a run killed at any moment leaves its last complete checkpoint intact.

A checkpoint is a folder ``step_00000100/`` holding ``state.pt`` and ``meta.json``. It is written under a
temporary name, flushed to disk, then renamed: a folder with the final name is always complete.

Usage::

    path = save_checkpoint("ckpt", step=100, state=trainer_state, keep_last=3)
    state = load_checkpoint(latest_checkpoint("ckpt"))
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import torch

STEP_DIR = re.compile(r"^step_(\d{8})$")
STATE_FILE = "state.pt"
META_FILE = "meta.json"


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
    return torch.load(file, map_location=map_location, weights_only=True)


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


def check_resume_compatible(saved: dict[str, Any], current: dict[str, Any], fields: tuple[str, ...]) -> None:
    """Refuse to continue a run whose spec changed in a field that would silently mix two trainings."""
    from vlmfast.spec import SpecError

    for dotted in fields:
        old, new = _get_dotted(saved, dotted), _get_dotted(current, dotted)
        if old != new:
            raise SpecError(
                f"cannot resume: the checkpoint was written with {dotted}={old!r} but the spec now says {new!r}. "
                f"Restore {dotted}, or start a fresh run (save.resume: never, or another save.dir)."
            )


def _get_dotted(data: dict[str, Any], dotted: str) -> Any:
    for part in dotted.split("."):
        data = data.get(part) if isinstance(data, dict) else None
    return data
