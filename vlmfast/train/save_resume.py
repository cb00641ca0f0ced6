"""Saving and resuming a run across ranks and engines (the file format is vlmfast.checkpoints.store's).

Engines that write shards (DeepSpeed) write every rank's part into rank 0's staging folder first; rank 0 adds the
trainer state and renames the folder into place, so a checkpoint is complete or absent. On resume rank 0 decides
which checkpoint, so every rank continues from the same step. Nothing here asks which engine it has.

Usage::

    path = save_run(engine, trainer.state_dict, directory, step=10, keep_last=3)   # what trainer.save() does
    resumed_from = resume_run(engine, trainer.load_state_dict, resume="auto", directory="ckpt")
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlmfast.checkpoints.save_dir import estimate_checkpoint_bytes
from vlmfast.checkpoints.store import latest_checkpoint, load_checkpoint, resume_path, save_checkpoint, staging_dir
from vlmfast.engines.base import Engine
from vlmfast.engines.collectives import barrier, broadcast_object, world_size
from vlmfast.engines.deepspeed import CHECKPOINT_TAG
from vlmfast.engines.zero_state import full_state_from_zero
from vlmfast.spec import SpecError


def save_run(engine: Engine, state_dict: Callable[[], dict[str, Any]], directory: str | Path, step: int,
             keep_last: int | None, meta: dict[str, Any] | None = None,
             write: Callable[..., Path] = save_checkpoint, trainable_only: bool = False) -> Path:
    """Write a checkpoint (all ranks call it; rank 0 writes the file) and return its path. `write` is
    `save_checkpoint`, or an `AsyncCheckpointer.save` (with save.async, only the copy to host memory happens here).
    `trainable_only`: the engine's shards without the frozen parameters (a LoRA run; `state_dict` says it too)."""
    directory = Path(directory)
    rank0 = _rank() == 0
    path, staged = directory / f"step_{step:08d}", None
    if engine.writes_shards:  # every rank writes its shard into rank 0's staging folder first
        staged = staging_dir(directory, step, world_size())
        engine.save_shards(staged, trainable_only=trainable_only)
        barrier()
    state = state_dict()  # on every rank: an engine may gather the full state with a collective
    if rank0:
        path = write(directory, step, state, keep_last, meta=meta, staged=staged)
    return path


def needs_final_save(directory: str | Path | None, step: int) -> bool:
    """Whether a final checkpoint is due: a folder is set, a step was run, and it is not on disk already."""
    if directory is None or step == 0:
        return False
    latest = latest_checkpoint(directory)
    return not (latest and latest.name == f"step_{step:08d}")


def resume_run(engine: Engine, load_state_dict: Callable[[dict[str, Any]], None], resume: str | Path,
               directory: str | Path | None, check: Callable[[dict[str, Any]], None] | None = None) -> Path | None:
    """Restore the checkpoint `resume` names (rank 0 decides for all); returns its path, or None. `check(state)`
    refuses an incompatible checkpoint (another spec, another world size) before the engine loads anything: a
    DeepSpeed engine would otherwise fail on the other world size's shards with its own, less helpful, error."""
    path = resume_path(resume, directory) if _rank() == 0 else None
    path = broadcast_object(path)
    if path is None:
        return None
    try:  # on CPU: load_state_dict copies weights and optimizer state to their device; RNG states stay on CPU
        state = load_checkpoint(path, map_location="cpu")
        if check is not None:
            check(state)
        saved_world = state.get("trainer", {}).get("world_size", 1)
        if (path / CHECKPOINT_TAG).is_dir() and engine.reads_shards(state.get("spec", {}), saved_world):
            engine.load_shards(path)
        elif (path / CHECKPOINT_TAG).is_dir():  # ZeRO-1/2 shards for another engine or layout: merged first
            state["engine"] = full_state_from_zero(path / CHECKPOINT_TAG, trainable_only="frozen" in state)
        # a full state: any engine loads it in load_state_dict (DeepSpeed into its ZeRO partitions)
        load_state_dict(state)
    except SpecError:
        raise
    except Exception as exc:
        raise SpecError(f"save.resume: cannot resume from {path}: {type(exc).__name__}: {exc}. Is it a vlmfast "
                        "checkpoint of this model? Use save.resume: never to start afresh") from exc
    return path


def _rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def run_checkpoint_bytes(directory: str | Path, model: Any, optimizer_name: str, momentum: float,
                         master_weights: bool, trainable_only: bool = False) -> int:
    """The size of the newest checkpoint in `directory`, else an estimate from the model and the optimizer."""
    latest = latest_checkpoint(directory)
    if latest is not None:
        return sum(p.stat().st_size for p in latest.rglob("*") if p.is_file())
    return estimate_checkpoint_bytes(model, optimizer_name, momentum, master_weights=master_weights,
                                     trainable_only=trainable_only)
