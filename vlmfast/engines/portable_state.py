"""A checkpoint continued on another number of ranks or by another engine (issue 37).

Single process, DDP and FSDP2 checkpoints hold the same thing: the full model state (names as the plain module has
them) and the full optimizer state, which FSDP2 gathers on rank 0 (``get_state_dict(full_state_dict=True)``). Only
the optimizer state's keys differ: ``torch.optim.Optimizer.state_dict()`` numbers the parameters in the order of its
param groups, torch's distributed-checkpoint API names them (``torch/distributed/checkpoint/state_dict.py``,
``_state_dict_fn`` / ``_get_optim_state_dict`` with ``full_state_dict``). Both engines build the optimizer with the
same factory over the same named parameters, so number k is the k-th parameter of the loading optimizer's groups:
:func:`optimizer_state_by_name` and :func:`optimizer_state_by_index` translate, and any engine of the three loads what
any other wrote. DeepSpeed writes per-rank ZeRO shards of its own (fp32 partitions, its own optimizer layout): a
ZeRO-1/2/3 checkpoint is merged into that full state (vlmfast.engines.zero_state, DeepSpeed's zero_to_fp32 merge),
so it continues on any rank count with another engine. The other way, a full state is loaded into a ZeRO-1/2/3 engine
through DeepSpeed's own accessors (vlmfast.engines.zero_load), on any rank count. ZeRO-0 in fp32 steps vlmfast's own
optimizer, so its state goes both ways as DDP's does. Refused, naming both sides: ZeRO-0 in bf16 / fp16 (DeepSpeed's
own optimizer wrapper) either way, a full state into ZeRO-1/2/3 with a factored optimizer (Adafactor, whose state
DeepSpeed would compute on flat partitions). A ZeRO-1/2/3 checkpoint on another DeepSpeed rank count or
stage is merged, then loaded into the new layout.

Usage::

    refusal = state_transfer_refusal(saved_spec_dict, saved_world_size, spec, world_size)   # None: it carries over
    state = optimizer_state_by_name(optimizer.state_dict(), optimizer, module)               # ints -> names
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from vlmfast.engines.zero_state import CONVERTIBLE_ZERO_STAGES

PORTABLE_ENGINES = ("ddp", "fsdp")  # full model + optimizer state: any of them loads what another wrote
INTO_ZERO_STAGES = (1, 2, 3)  # DeepSpeed stages a full state is loaded into (vlmfast.engines.zero_load)
ELEMENTWISE_OPTIMIZERS = ("adamw", "sgd")  # state shaped as each parameter: the same on a flat partition


def state_transfer_refusal(saved: Mapping[str, Any], saved_world: int, spec: Any, world_size: int) -> str | None:
    """Why a checkpoint written by the spec `saved` (a dict) on `saved_world` ranks cannot be continued by `spec` on
    `world_size` ranks; None when the state carries over (the global batch is checked apart)."""
    old, new = saved.get("engine", "ddp"), spec.engine
    stage = saved.get("deepspeed", {}).get("zero_stage", 2)
    if old == new == "deepspeed" and (saved_world, stage) != (world_size, spec.deepspeed.zero_stage):
        if _leaves_zero(saved):  # merged into the full state, loaded into the new partitions
            return _into_zero_refusal(f"engine 'deepspeed' (ZeRO-{stage}, {saved_world} rank(s))", spec)
        return (f"engine 'deepspeed' (ZeRO-{stage}) on {saved_world} rank(s) -> ZeRO-{spec.deepspeed.zero_stage} on "
                f"{world_size}: only a ZeRO-1/2/3 checkpoint (flat fp32 partitions per rank) is merged into the full "
                f"state another layout loads; ZeRO-{stage}'s is not. Resume on {saved_world} rank(s) with ZeRO-{stage}")
    if old == new and saved_world == world_size:
        return None
    if old in PORTABLE_ENGINES and new in PORTABLE_ENGINES:
        return None
    if old == "deepspeed" and new in PORTABLE_ENGINES and _leaves_zero(saved):
        return None  # its shards are merged into the full state (vlmfast.engines.zero_state)
    if old in PORTABLE_ENGINES and new == "deepspeed":
        return _into_zero_refusal(f"engine '{old}'", spec)
    if old == "deepspeed" and stage == 0:
        return (f"engine 'deepspeed' (ZeRO-0, precision {saved.get('precision')}) -> '{new}': DeepSpeed wraps the "
                "optimizer in its own bf16 / fp16 optimizer there, whose state vlmfast does not convert (ZeRO-0 in "
                "fp32 and ZeRO-1/2/3 in any precision do). Resume with engine: deepspeed, or start a new run")
    if old == "deepspeed":
        return (f"engine 'deepspeed' (ZeRO-{stage}) -> '{new}': only a ZeRO-1/2/3 checkpoint (flat fp32 partitions "
                f"per rank) is merged into the full state another engine loads; ZeRO-{stage}'s is not. Resume with "
                "engine: deepspeed, or start a new run (save.resume: never) from the model's weights")
    return (f"engine '{old}' -> '{new}': neither engine's state carries over to the other. Resume with engine: "
            f"{old}, or start a new run (save.resume: never) from the model's weights")


def _into_zero_refusal(source: str, spec: Any) -> str | None:
    """Why a full state (one process, DDP, FSDP2, or a merged ZeRO-1/2 checkpoint: `source` names it) cannot continue
    exactly under `spec`'s DeepSpeed engine, or None: ZeRO-1/2/3 take it into their flat fp32 partitions
    (vlmfast.engines.zero_load)."""
    stage, optimizer = spec.deepspeed.zero_stage, spec.optimizer.name
    target = f"{source} -> 'deepspeed' (ZeRO-{stage})"
    if stage == 0 and spec.precision == "fp32":
        return None  # DeepSpeed steps vlmfast's own optimizer over the module: loaded as DDP loads it
    if stage not in INTO_ZERO_STAGES:
        return (f"{target} with precision {spec.precision}: DeepSpeed wraps the optimizer in its own bf16 / fp16 "
                "optimizer there, which vlmfast does not load. Set deepspeed.zero_stage: 1, 2 or 3, precision: fp32, "
                "or resume as the checkpoint was written")
    if optimizer not in ELEMENTWISE_OPTIMIZERS:
        return (f"{target}: optimizer.name '{optimizer}' keeps factored (row / column) state per matrix, which "
                "DeepSpeed would compute over its flat 1-D partitions instead: the continuation could not be exact. "
                "Resume as the checkpoint was written, or start a new run (save.resume: never)")
    return None


def _leaves_zero(saved: Mapping[str, Any]) -> bool:
    """Whether a DeepSpeed checkpoint converts to the full state: ZeRO-1/2/3 (flat fp32 partitions, merged), or
    ZeRO-0 in fp32 (vlmfast's own optimizer's state, as DDP's)."""
    stage = saved.get("deepspeed", {}).get("zero_stage", 2)
    return stage in CONVERTIBLE_ZERO_STAGES or (stage == 0 and saved.get("precision", "fp32") == "fp32")


def transfer_accepts(saved: Mapping[str, Any], spec: Any) -> tuple[str, ...]:
    """The spec fields a resume may change once :func:`state_transfer_refusal` and the global-batch check passed:
    batch_size (the same global batch on another rank count), engine (a pair whose state carries over) and, when
    the checkpoint leaves DeepSpeed or changes its layout, its ZeRO stage (the shards are merged into the full
    state, which any stage from 1 to 3 loads)."""
    through_full_state = saved.get("engine", "ddp") != spec.engine or saved.get("engine") == "deepspeed"
    return ("batch_size", "engine", *(("deepspeed.zero_stage",) if through_full_state else ()))


def describe_transfer(saved: Mapping[str, Any], saved_world: int, spec: Any, world_size: int) -> dict[str, Any] | None:
    """What changed at a resume on another rank count or engine ({"note": text, "world_size", "engine",
    "batch_size", "from_...": ...}); None when nothing did. Usage: in the log, metrics.jsonl and the run report."""
    old_engine, old_batch = saved.get("engine", "ddp"), saved.get("batch_size", spec.batch_size)
    old_label, new_label = _engine_label(old_engine, saved.get("deepspeed", {})), _engine_label(
        spec.engine, spec.deepspeed.model_dump())
    if (saved_world, old_label) == (world_size, new_label):
        return None
    note = (f"resumed on {world_size} rank(s) x batch_size {spec.batch_size} with engine {new_label}, from "
            f"{saved_world} x {old_batch} with engine {old_label}: the same global batch of {old_batch * saved_world}")
    if saved_world != world_size:
        note += "; each rank's generators re-derived from the seed, the step and the rank"
    return {"note": note, "world_size": world_size, "engine": spec.engine, "batch_size": spec.batch_size,
            "from_world_size": saved_world, "from_engine": old_engine, "from_batch_size": old_batch}


def _engine_label(engine: str, deepspeed: Mapping[str, Any]) -> str:
    return f"{engine} (ZeRO-{deepspeed.get('zero_stage', 2)})" if engine == "deepspeed" else engine


def parameter_names(optimizer: torch.optim.Optimizer, module: nn.Module) -> list[str]:
    """The names of the optimizer's parameters, in the order ``Optimizer.state_dict()`` numbers them."""
    names = {id(p): name for name, p in module.named_parameters()}
    order = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if id(param) not in names:
                raise ValueError("the optimizer holds a parameter the model does not name: its state cannot be "
                                 "carried to another engine")
            order.append(names[id(param)])
    return order


def is_named(optimizer_state: Mapping[str, Any]) -> bool:
    """Whether an optimizer state's parameters are named (torch's distributed-checkpoint format), not numbered."""
    groups = optimizer_state.get("param_groups", [])
    return any(isinstance(p, str) for group in groups for p in group.get("params", []))


def optimizer_state_by_name(state: Mapping[str, Any], optimizer: torch.optim.Optimizer,
                            module: nn.Module) -> dict[str, Any]:
    """A numbered optimizer state (``Optimizer.state_dict()``) with each parameter named as in `module`."""
    return name_optimizer_state(state, parameter_names(optimizer, module))


def name_optimizer_state(state: Mapping[str, Any], order: Sequence[str]) -> dict[str, Any]:
    """A numbered optimizer state with parameter k named order[k] (:func:`parameter_names` of the optimizer that
    will load it, taken while it still holds the module's parameters)."""
    return {"state": {order[index]: value for index, value in state["state"].items()},
            "param_groups": [{**group, "params": [order[index] for index in group["params"]]}
                             for group in state["param_groups"]]}


def optimizer_state_by_index(state: Mapping[str, Any], optimizer: torch.optim.Optimizer,
                             module: nn.Module) -> dict[str, Any]:
    """A named optimizer state (torch's distributed-checkpoint format) numbered as `optimizer` numbers its
    parameters, for ``Optimizer.load_state_dict``."""
    index = {name: k for k, name in enumerate(parameter_names(optimizer, module))}
    missing = [name for group in state["param_groups"] for name in group["params"] if name not in index]
    if missing:
        raise ValueError(f"the checkpoint's optimizer holds parameters this model's optimizer does not: {missing[:3]}")
    return {"state": {index[name]: _local(value) for name, value in state["state"].items()},
            # sorted: the loading optimizer's order (Optimizer.load_state_dict pairs a group's parameters by
            # position; a DeepSpeed group may list them in another order)
            "param_groups": [{**group, "params": sorted(index[name] for name in group["params"])}
                             for group in state["param_groups"]]}


def _local(value: Any) -> Any:
    """Per-parameter optimizer state as plain tensors (a full state holds no DTensor, but be sure)."""
    if isinstance(value, Mapping):
        return {k: _local(v) for k, v in value.items()}
    full = getattr(value, "full_tensor", None)
    return full() if callable(full) else value
