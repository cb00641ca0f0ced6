"""FSDP2 (`torch.distributed.fsdp.fully_shard`) as the training backend: parameters, gradients and optimizer
states sharded across ranks, with the spec's precision as FSDP's mixed-precision policy.

Usage::

    model = shard_model(model, FSDPSpec(enabled=True), precision="bf16")   # each repeated block, then the root
    optimizer = torch.optim.AdamW(model.parameters())                       # built after sharding (DTensors)
    model_state, optim_state = full_state_dict(model, optimizer)            # on every rank; full on rank 0

torchtitan's recipe: each transformer block is its own FSDP unit (its parameters are gathered just before it runs
and freed after), the root holds the rest. bf16 is FSDP's `MixedPrecisionPolicy` (bf16 compute, fp32 gradient
reduction), not autocast on top. Accumulation uses `set_requires_gradient_sync(False)` on non-final micro-batches
(:meth:`FSDPEngine.sync_context`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

from vlmfast.common.module_tree import find_repeated_blocks, matches
from vlmfast.engines.base import Engine, OptimizerFactory, check_trainable_names
from vlmfast.engines.portable_state import is_named, optimizer_state_by_name
from vlmfast.engines.process_group import ensure_process_group
from vlmfast.spec import FSDPSpec, SpecError
from vlmfast.strategies.precision import EnginePrecision


def shard_model(model: nn.Module, spec: FSDPSpec, precision: str) -> nn.Module:
    """Apply `fully_shard` to each repeated block (or `spec.blocks`), then to the root; returns the same module."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if precision == "fp16":
        raise SpecError("engine: fsdp with precision fp16 is not supported (it needs a sharded gradient scaler): "
                        "use precision: bf16")
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) \
        if precision == "bf16" else MixedPrecisionPolicy()
    broadcast_from_rank0(model)
    blocks = _blocks(model, spec.blocks)
    for block in blocks:
        fully_shard(block, mp_policy=policy, reshard_after_forward=spec.reshard_after_forward)
    # The root's parameters (embeddings, head) are needed again right at the start of backward: keep them gathered.
    fully_shard(model, mp_policy=policy, reshard_after_forward=False)
    model.fsdp_units = len(blocks) + 1  # for describe()
    return model


def broadcast_from_rank0(model: nn.Module) -> None:
    """Rank 0's parameters and buffers on every rank, before sharding. ``fully_shard`` keeps each rank's own slice of
    its local tensor (FSDP2 has no ``sync_module_states``), so weights that differ across ranks - LoRA adapters,
    initialised after the trainer seeds each rank differently - would silently make a model no rank built. DDP and
    DeepSpeed (``DeepSpeedEngine._broadcast_model``) broadcast from rank 0 too. Bytes, so any dtype crosses gloo."""
    if not torch.distributed.is_initialized() or torch.distributed.get_world_size() == 1:
        return
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.device.type == "meta" or tensor.numel() == 0:
            continue
        data = tensor.data.contiguous()  # itself when contiguous
        torch.distributed.broadcast(data.reshape(-1).view(torch.uint8), src=0)
        if data.data_ptr() != tensor.data.data_ptr():
            tensor.data.copy_(data)


def _blocks(model: nn.Module, patterns: list[str]) -> list[nn.Module]:
    if not patterns:
        return [block for blocks in find_repeated_blocks(model).values() for block in blocks]
    found = [module for name, module in model.named_modules()
             if name and (any(matches(name, p) for p in patterns) or type(module).__name__ in patterns)]
    if not found:
        raise SpecError(f"fsdp.blocks {patterns} match no module (give module paths, globs or class names)")
    return found


def full_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer,
                    trainable_only: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """Unsharded model and optimizer state on CPU: full on rank 0, empty elsewhere. A collective: every rank calls.
    `trainable_only`: no frozen parameter (buffers stay). torch's ``ignore_frozen_params`` drops them from the local
    state dict before anything is gathered (``_get_model_state_dict``), so the frozen base is never all-gathered; the
    optimizer's state holds the trainable parameters only in any case."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    return get_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True,
                                                                     ignore_frozen_params=trainable_only))


def load_full_state_dict(model: nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any],
                         optimizer_state: dict[str, Any], trainable_only: bool = False) -> None:
    """Shard a full state (as :func:`full_state_dict` wrote it, read by every rank) back into `model`/`optimizer`.
    `trainable_only`: the state holds no frozen parameter (checked here; they keep the model's own values)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    if trainable_only:
        check_trainable_names(model, model_state, also=(name for name, _ in model.named_buffers()))
    # strict=False for the frozen parameters the state lacks (torch fills them from the model's local tensors).
    set_model_state_dict(model, model_state, options=StateDictOptions(full_state_dict=True, strict=not trainable_only))
    # torch's full-state optimizer load (`_load_optim_state_dict`) takes the device to scatter to from the local
    # optimizer state's tensors of dim > 0 and asserts "Expected device to be set" when there are none: a stateless
    # optimizer (SGD without momentum) on any device. With no such tensor there is nothing sharded to scatter: the
    # plain load (hyperparameters, scalar states) is the same state.
    set_optimizer_state_dict(model, optimizer, optimizer_state,
                             options=StateDictOptions(full_state_dict=_has_tensor_state(optimizer_state)))


def _has_tensor_state(optimizer_state: dict[str, Any]) -> bool:
    """Whether a full optimizer state holds a tensor to shard (torch's test: a tensor of dim > 0)."""
    from torch.utils._pytree import tree_leaves

    return any(isinstance(leaf, torch.Tensor) and leaf.dim() > 0
               for leaf in tree_leaves(optimizer_state.get("state", {})))


def describe(model: nn.Module, spec: FSDPSpec, precision: str) -> str:
    mode = "reshard after forward" if spec.reshard_after_forward else "keep gathered until backward"
    return f"fsdp2: {getattr(model, 'fsdp_units', '?')} sharded units ({mode}), {precision} policy"


class FSDPEngine(Engine):
    """FSDP2: parameters, gradients and optimizer states sharded; full state gathered to rank 0 for checkpoints."""

    name = "fsdp"
    can_probe = False
    local_state_dict = False  # the full state is all-gathered
    shards_parameters = True

    def __init__(self, spec: FSDPSpec, precision: str, world_size: int) -> None:
        super().__init__(EnginePrecision(precision, "FSDP2's MixedPrecisionPolicy"), world_size)
        self.spec, self.precision_name = spec, precision

    def setup(self, model: nn.Module, build_optimizer: OptimizerFactory) -> nn.Module:
        ensure_process_group()  # a one-rank group when run without a launcher
        self.module = shard_model(model, self.spec, self.precision_name)
        self.optimizer = build_optimizer(self.module)  # after sharding: the optimizer holds the DTensors
        return self.module

    def sync_context(self, model: nn.Module, last_micro_batch: bool) -> AbstractContextManager[Any]:
        return nullcontext() if last_micro_batch and not self._local else _no_gradient_sync(model)

    keeps_trainable_only = True  # StateDictOptions.ignore_frozen_params: the frozen base is neither gathered nor saved

    def state_dict(self, trainable_only: bool = False) -> dict[str, Any]:
        model_state, optimizer_state = full_state_dict(self.module, self.optimizer, trainable_only)  # a collective
        return {"model": model_state, "optimizer": optimizer_state,
                **({"trainable_only": True} if trainable_only else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        optimizer_state = state["optimizer"]
        if not is_named(optimizer_state):  # written by one process or DDP (Optimizer.state_dict()): named here
            optimizer_state = optimizer_state_by_name(optimizer_state, self.optimizer, self.module)
        load_full_state_dict(self.module, self.optimizer, state["model"], optimizer_state,
                             trainable_only=bool(state.get("trainable_only")))

    def describe(self) -> list[str]:
        return [describe(self.module, self.spec, self.precision_name)]


@contextmanager
def _no_gradient_sync(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)
