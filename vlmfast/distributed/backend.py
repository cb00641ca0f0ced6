"""The training backend: who wraps the model, reduces gradients and holds the weights.

Usage::

    backend = build_backend(spec, device, world_size)   # torch (one process or DDP), DeepSpeed or FSDP2
    model = backend.wrap(model, optimization)            # last, after every strategy changed the plain model
    state = backend.weights_state_dict(model, optimizer) # what a checkpoint stores of the weights

The trainer's loop is the same for all three; a backend only answers at these few points. DeepSpeed also owns
backward and the optimizer step (see `vlmfast.distributed.deepspeed_engine`).
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vlmfast.distributed import fsdp
from vlmfast.distributed.ddp import wrap_ddp
from vlmfast.distributed.process_group import ensure_process_group
from vlmfast.spec import TrainSpec
from vlmfast.strategies.accumulation import sync_context

if TYPE_CHECKING:
    from vlmfast.strategies.optimizer import Optimization


class TorchBackend:
    """One process, or DDP when launched on several (the default)."""

    name = "torch"
    owns_precision = False  # True: the backend runs bf16/fp16 itself, no autocast on top
    sharded_checkpoint = False  # True: every rank writes its shard (save_shards / load_shards)

    def __init__(self, spec: TrainSpec, device: torch.device, world_size: int) -> None:
        self.spec, self.device, self.world_size = spec, device, world_size

    def wrap(self, model: nn.Module, optimization: Optimization) -> nn.Module:
        return wrap_ddp(model, self.spec.ddp, self.device) if self.world_size > 1 else model

    def sync_context(self, model: nn.Module, is_last: bool) -> AbstractContextManager[Any]:
        """Around a micro-batch's forward and backward: reduce gradients only on the last one (DDP / FSDP2)."""
        return sync_context(model, is_last)

    def prepare_inputs(self, batch: Any) -> Any:
        """A device micro-batch as the wrapped model expects it (DeepSpeed: floats in the engine's dtype)."""
        return batch

    def weights_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Model weights (and the optimizer state when the backend gathers it); a collective for FSDP."""
        return {"model": getattr(model, "module", model).state_dict()}

    def load_weights_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                state: dict[str, Any]) -> None:
        getattr(model, "module", model).load_state_dict(state["model"])

    def save_shards(self, directory: Path) -> None:
        """Sharded backends write every rank's part into `directory` (all ranks call it)."""

    def load_shards(self, directory: Path) -> None:
        """Read back what :meth:`save_shards` wrote (all ranks call it)."""

    def describe(self) -> list[str]:
        if self.world_size == 1:
            return []
        ddp = self.spec.ddp
        hook = "" if ddp.comm_hook == "none" else f", comm hook {ddp.comm_hook}"
        return [f"ddp: {self.world_size} ranks, buckets {ddp.bucket_cap_mb:g} MB{hook}"]


class FSDPBackend(TorchBackend):
    """FSDP2: parameters, gradients and optimizer states sharded; full state gathered to rank 0 for checkpoints."""

    name = "fsdp"
    owns_precision = True  # FSDP's MixedPrecisionPolicy

    def wrap(self, model: nn.Module, optimization: Optimization) -> nn.Module:
        ensure_process_group()  # a one-rank group when run without a launcher
        model = fsdp.shard_model(model, self.spec.fsdp, self.spec.precision)
        optimization.apply(model)  # again: the optimizer must hold the sharded (DTensor) parameters
        optimization.owns_optimizer_state = False  # gathered with the model in weights_state_dict
        self.model = model
        return model

    def weights_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        model_state, optimizer_state = fsdp.full_state_dict(model, optimizer)
        return {"model": model_state, "optimizer": optimizer_state}

    def load_weights_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer,
                                state: dict[str, Any]) -> None:
        fsdp.load_full_state_dict(model, optimizer, state["model"], state["optimizer"])

    def describe(self) -> list[str]:
        return [fsdp.describe(self.model, self.spec.fsdp, self.spec.precision)]


def build_backend(spec: TrainSpec, device: torch.device, world_size: int) -> TorchBackend:
    """The backend the spec asks for (`deepspeed.enabled`, `fsdp.enabled`, else torch)."""
    if spec.backend == "deepspeed":
        from vlmfast.distributed.deepspeed_engine import DeepSpeedBackend

        return DeepSpeedBackend(spec, device, world_size)
    return FSDPBackend(spec, device, world_size) if spec.backend == "fsdp" else TorchBackend(spec, device, world_size)
