"""Load DeepSpeed's checkpoint shards with torch's weights-only unpickler, so a crafted shard cannot run code.

DeepSpeed (0.19.8) reads every shard through ``engine.checkpoint_engine.load(path, map_location)``
(``deepspeed/runtime/engine.py``: ``_load_checkpoint`` via ``state_dict_factory.SDLoader`` for the model states,
``_get_all_zero_checkpoint_state_dicts`` for the ZeRO optimizer states), and its ``TorchCheckpointEngine.load``
calls ``torch.load(..., weights_only=False)``: a pickle in a shard may call any Python function. While
:func:`weights_only_loading` is active, the engine's checkpoint engine is replaced by one that calls
``torch.load(..., weights_only=True)`` with an allow-list of the few DeepSpeed classes its own optimizer state
holds (:data:`DEEPSPEED_SAFE_GLOBALS`, found by saving ZeRO 0-3 checkpoints in fp32 and bf16 and listing
``torch.serialization.get_unsafe_globals_in_checkpoint``; the loss scalers of fp16 too). Each file is read once,
by the safe unpickler itself, so nothing can swap it between a check and the load. A shard that needs anything
else is refused, naming the file and the global; nothing in it runs.

Usage::

    with weights_only_loading(engine):
        engine.load_checkpoint(folder, tag="deepspeed", load_lr_scheduler_states=False)
"""

from __future__ import annotations

import importlib
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from vlmfast.checkpoints.store import CorruptCheckpointError

# Plain data classes and enums: unpickling them builds an object from stored fields and runs none of their code.
DEEPSPEED_SAFE_GLOBALS = (
    "deepspeed.runtime.zero.config:ZeroStageEnum",          # ZeRO optimizer state: "zero_stage"
    "deepspeed.utils.tensor_fragment:fragment_address",     # bf16 / ZeRO-1/2 fragment offsets
    "deepspeed.runtime.fp16.loss_scaler:LossScaler",        # static loss scaler (bf16 / fp32 keep one too)
    "deepspeed.runtime.fp16.loss_scaler:DynamicLossScaler",  # fp16 on GPUs
    "deepspeed.runtime.fp16.loss_scaler:LossScaleConfig",
    "deepspeed.runtime.fp16.loss_scaler:LossScaleProfile",
)


def deepspeed_safe_globals() -> list[Any]:
    """The allow-listed DeepSpeed classes that this DeepSpeed version has (a missing one is skipped)."""
    found = []
    for target in DEEPSPEED_SAFE_GLOBALS:
        module, _, name = target.partition(":")
        try:
            found.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            continue
    return found


def load_weights_only(path: str | Path, map_location: Any = "cpu", allowed: list[Any] | None = None) -> Any:
    """One DeepSpeed shard, unpickled weights-only with the allow-list (`allowed`: deepspeed_safe_globals()); a
    shard that needs anything else is refused naming the file and the global (CorruptCheckpointError)."""
    try:
        with torch.serialization.safe_globals(deepspeed_safe_globals() if allowed is None else allowed):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as exc:
        reason = next((line.strip() for line in str(exc).splitlines() if "GLOBAL" in line or "global" in line),
                      str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
        raise CorruptCheckpointError(
            f"{path}: refused: unpickling it needs something other than tensors and DeepSpeed's own state "
            f"({reason[:300]}). It was read with torch's weights-only unpickler, so nothing in it ran. Only resume "
            "from checkpoints this run (or someone you trust) wrote; delete that checkpoint folder to resume from "
            "the previous one"
        ) from exc
    except (RuntimeError, EOFError, ValueError, OSError) as exc:
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise CorruptCheckpointError(f"{path} cannot be read ({type(exc).__name__}: {first}): it is truncated or "
                                     "corrupt. Delete that checkpoint folder to resume from the previous one"
                                     ) from exc


class WeightsOnlyCheckpointEngine:
    """Stands in for DeepSpeed's checkpoint engine while loading: ``load`` unpickles weights-only; the rest is the
    wrapped engine's."""

    def __init__(self, wrapped: Any) -> None:
        self._wrapped = wrapped
        self._allowed = deepspeed_safe_globals()

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_weights_only(path, map_location, self._allowed)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._wrapped, name)


@contextmanager
def weights_only_loading(engine: Any) -> Iterator[None]:
    """Within the block, every shard `engine` (a DeepSpeedEngine) loads is unpickled weights-only."""
    original = engine.checkpoint_engine
    engine.checkpoint_engine = WeightsOnlyCheckpointEngine(original)
    try:
        yield
    finally:
        engine.checkpoint_engine = original
