"""Saving and resuming an OptimizedTrainer across ranks and backends (the file format is vlmfast.checkpoint's).

Sharded backends (DeepSpeed) write every rank's shard into rank 0's staging folder first; rank 0 adds the trainer
state and renames the folder into place, so a checkpoint is complete or absent. On resume rank 0 decides which
checkpoint, so every rank continues from the same step.

Usage::

    path = save_trainer(trainer)             # what trainer.save() does
    resumed_from = resume_trainer(trainer)   # what fit() does first (save.resume)
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from vlmfast.checkpoint import latest_checkpoint, load_checkpoint, resume_path, save_checkpoint, staging_dir
from vlmfast.checkpoint_async import finish_saves, trainer_checkpointer
from vlmfast.save_dir import prepare_save_dir
from vlmfast.spec import SpecError

if TYPE_CHECKING:
    from vlmfast.trainer import OptimizedTrainer


def save_trainer(trainer: OptimizedTrainer, directory: str | Path | None = None) -> Path:
    """Write a checkpoint of `trainer` now (all ranks call it; rank 0 writes) and return its path."""
    directory = Path(directory or trainer.spec.save.dir or "checkpoints")
    step = trainer.state.step
    path, staged = directory / f"step_{step:08d}", None
    if trainer.backend.sharded_checkpoint:  # every rank writes its shard into rank 0's staging folder first
        staged = staging_dir(directory, step, trainer.world_size)
        trainer.backend.save_shards(staged)
        if trainer.world_size > 1:
            torch.distributed.barrier()
    gathers = trainer.backend.name == "fsdp"  # FSDP2 gathers the full state with a collective: every rank joins
    state = trainer.state_dict() if trainer.is_main_process or gathers else None
    if trainer.is_main_process:  # save.async: only the copy to host memory happens here, the write in a thread
        save = trainer_checkpointer(trainer).save if trainer.spec.save.async_ else save_checkpoint
        path = save(directory, step, state, trainer.spec.save.keep_last,
                    meta={"samples_seen": trainer.state.samples_seen}, staged=staged)
        trainer._fire("on_save", path)
    return path


def save_if_configured(trainer: OptimizedTrainer, final: bool = False) -> Path | None:
    """A checkpoint when `save.dir` is set and a step was run; the final one is not written twice."""
    directory, step = trainer.spec.save.dir, trainer.state.step
    if directory is None or step == 0:
        return None
    if final:
        finish_saves(trainer)  # save.async: the save in flight may be this very step
    if final and (latest := latest_checkpoint(directory)) and latest.name == f"step_{step:08d}":
        return latest
    path = save_trainer(trainer)
    if final:
        finish_saves(trainer)  # the run ends with its last checkpoint on disk
    return path


def resume_trainer(trainer: OptimizedTrainer) -> Path | None:
    """Restore the checkpoint `save.resume` names (rank 0 decides for all); returns its path, or None."""
    spec = trainer.spec.save
    prepare_save_dir(trainer)  # one writer per save.dir (a lock, rank 0), room for a checkpoint: before any step
    path = resume_path(spec.resume, spec.dir) if trainer.is_main_process else None
    if trainer.world_size > 1:
        shared = [path]
        torch.distributed.broadcast_object_list(shared, src=0)
        path = shared[0]
    if path is None:
        return None
    try:  # on CPU: load_state_dict copies weights and optimizer state to their device; RNG states stay on CPU
        trainer.backend.load_shards(path)
        trainer.load_state_dict(load_checkpoint(path, map_location="cpu"))
    except SpecError:
        raise
    except Exception as exc:
        raise SpecError(f"save.resume: cannot resume from {path}: {type(exc).__name__}: {exc}. Is it a vlmfast "
                        "checkpoint of this model? Use save.resume: never to start afresh") from exc
    return path
