"""Engines: one process, DDP, FSDP2 or DeepSpeed behind one protocol (:class:`vlmfast.engines.base.Engine`), the
process group from the launcher, gradient-communication hooks, and every collective of the step.

Usage::

    engine = build_engine(spec, device, world_size)      # the spec's `engine` field picks it
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from vlmfast.engines.base import Engine, StepResult
from vlmfast.engines.comm_hooks import CommCounter, count_bytes, register_comm_hook, register_comm_hook_from_spec
from vlmfast.engines.ddp import DDPEngine, explain_ddp_error, wrap_ddp
from vlmfast.engines.process_group import (
    NCCL_PRESETS,
    DistributedEnv,
    apply_nccl_presets,
    distributed_env,
    init_distributed,
)
from vlmfast.engines.single import SingleEngine
from vlmfast.spec import TrainSpec
from vlmfast.strategies.precision import MixedPrecision


@dataclass(frozen=True)
class EngineTraits:
    """What strategies need to know about the engine a spec builds, answered before it is built (strategies are
    built first). The one place outside an engine class that reads ``spec.engine``.

    Usage: ``if engine_traits(spec, world_size).shards_parameters: ...``
    """

    shards_parameters: bool  # a rank holds part of each weight (FSDP2, ZeRO-3): every forward all-gathers
    reduces_in_backward: bool  # gradients are reduced by hooks during backward (not averaged by hand afterwards)
    needs_every_parameter: bool  # every trainable parameter must get a gradient in every backward (DDP's reducer)
    reduces_unused_parameters: bool  # a parameter no forward used still joins the reduction (find_unused_parameters)


def engine_traits(spec: Any, world_size: int) -> EngineTraits:
    """The traits of the engine :func:`build_engine` builds for `spec` on `world_size` ranks."""
    if world_size == 1:
        return EngineTraits(False, False, False, False)
    if spec.engine == "fsdp":
        return EngineTraits(True, True, False, False)
    if spec.engine == "deepspeed":
        return EngineTraits(spec.deepspeed.zero_stage == 3, True, False, False)
    manual = bool(spec.oom.enabled)  # DDPEngine(manual_sync=...): finish_gradients averages after the ranks agree
    unused = bool(spec.ddp.find_unused_parameters)
    return EngineTraits(False, not manual, not (manual or unused), unused)


def build_engine(spec: TrainSpec, device: torch.device, world_size: int) -> Engine:
    """The engine `spec.engine` names: ddp (one process, or DDP when launched on several ranks), fsdp, deepspeed."""
    if spec.engine == "deepspeed":
        from vlmfast.engines.deepspeed import DeepSpeedEngine

        return DeepSpeedEngine(spec, world_size)
    if spec.engine == "fsdp":
        from vlmfast.engines.fsdp import FSDPEngine

        return FSDPEngine(spec.fsdp, spec.precision, world_size)
    precision = MixedPrecision(spec.precision, device, tf32=spec.tf32)
    if world_size == 1:
        return SingleEngine(precision)
    return DDPEngine(spec.ddp, device, precision, world_size, manual_sync=spec.oom.enabled)


__all__ = [
    "NCCL_PRESETS",
    "CommCounter",
    "DDPEngine",
    "DistributedEnv",
    "Engine",
    "EngineTraits",
    "SingleEngine",
    "StepResult",
    "apply_nccl_presets",
    "build_engine",
    "count_bytes",
    "distributed_env",
    "engine_traits",
    "explain_ddp_error",
    "init_distributed",
    "register_comm_hook",
    "register_comm_hook_from_spec",
    "wrap_ddp",
]
