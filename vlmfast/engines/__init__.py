"""Engines: one process, DDP, FSDP2 or DeepSpeed behind one protocol (:class:`vlmfast.engines.base.Engine`), the
process group from the launcher, gradient-communication hooks, and every collective of the step.

Usage::

    engine = build_engine(spec, device, world_size)      # the spec's `engine` field picks it
"""

from __future__ import annotations

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
    "SingleEngine",
    "StepResult",
    "apply_nccl_presets",
    "build_engine",
    "count_bytes",
    "distributed_env",
    "explain_ddp_error",
    "init_distributed",
    "register_comm_hook",
    "register_comm_hook_from_spec",
    "wrap_ddp",
]
