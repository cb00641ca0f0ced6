"""FSDP2 (`torch.distributed.fsdp.fully_shard`) as the training backend: parameters, gradients and optimizer
states sharded across ranks, with the spec's precision as FSDP's mixed-precision policy.

Usage::

    model = shard_model(model, FSDPSpec(enabled=True), precision="bf16")   # each repeated block, then the root
    optimizer = torch.optim.AdamW(model.parameters())                       # built after sharding (DTensors)
    model_state, optim_state = full_state_dict(model, optimizer)            # on every rank; full on rank 0

torchtitan's recipe: each transformer block is its own FSDP unit (its parameters are gathered just before it runs
and freed after), the root holds the rest. bf16 is FSDP's `MixedPrecisionPolicy` (bf16 compute, fp32 gradient
reduction), not autocast on top. Accumulation uses `set_requires_gradient_sync(False)` on non-final micro-batches
(see `vlmfast.strategies.accumulation.sync_context`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from vlmfast.spec import FSDPSpec, SpecError
from vlmfast.strategies.checkpointing import find_repeated_blocks
from vlmfast.strategies.optimizer import matches


def shard_model(model: nn.Module, spec: FSDPSpec, precision: str) -> nn.Module:
    """Apply `fully_shard` to each repeated block (or `spec.blocks`), then to the root; returns the same module."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if precision == "fp16":
        raise SpecError("fsdp.enabled with precision fp16 is not supported (it needs a sharded gradient scaler): "
                        "use precision: bf16")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    blocks = _blocks(model, spec.blocks)
    for block in blocks:
        fully_shard(block, mp_policy=policy, reshard_after_forward=spec.reshard_after_forward)
    # The root's parameters (embeddings, head) are needed again right at the start of backward: keep them gathered.
    fully_shard(model, mp_policy=policy, reshard_after_forward=False)
    model.fsdp_units = len(blocks) + 1  # for describe()
    return model


def _blocks(model: nn.Module, patterns: list[str]) -> list[nn.Module]:
    if not patterns:
        return [block for blocks in find_repeated_blocks(model).values() for block in blocks]
    found = [module for name, module in model.named_modules()
             if name and (any(matches(name, p) for p in patterns) or type(module).__name__ in patterns)]
    if not found:
        raise SpecError(f"fsdp.blocks {patterns} match no module (give module paths, globs or class names)")
    return found


def full_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, Any]]:
    """Unsharded model and optimizer state on CPU: full on rank 0, empty elsewhere. A collective: every rank calls."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def load_full_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any],
                         optimizer_state: dict[str, Any]) -> None:
    """Shard a full state (as :func:`full_state_dict` wrote it, read by every rank) back into `model`/`optimizer`."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state,
                   options=StateDictOptions(full_state_dict=True))


def describe(model: nn.Module, spec: FSDPSpec, precision: str) -> str:
    mode = "reshard after forward" if spec.reshard_after_forward else "keep gathered until backward"
    return f"fsdp2: {getattr(model, 'fsdp_units', '?')} sharded units ({mode}), {precision} policy"
