"""Mixed precision: fp32, bf16 autocast, or fp16 autocast with a GradScaler (CUDA only); optional TF32.

Usage in a hand-written loop::

    precision = MixedPrecision("bf16", device)
    with precision.forward_context():
        loss = model(**batch).loss
    precision.backward(loss)
    precision.optimizer_step(optimizer)

In the trainer it is the precision plugin of the single-process and DDP engines (Lightning Fabric's design): the
engine calls `backward` and `optimizer_step`, the loop calls `forward_context` and `after_backward` (unscale).
"""

from __future__ import annotations

from collections import defaultdict
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch

from vlmfast.common.utils import PRECISION_DTYPES
from vlmfast.strategies.base import Step, Strategy


def autocast_context(precision: str, device: torch.device) -> AbstractContextManager[Any]:
    """The autocast context for `precision` on `device` (a no-op for fp32)."""
    if precision == "fp32":
        return nullcontext()
    return torch.autocast(device.type, dtype=PRECISION_DTYPES[precision])


def enable_tf32(enabled: bool = True) -> None:
    """Let CUDA matmuls and convolutions use TF32 tensor cores (fp32 range, ~10-bit mantissa)."""
    from vlmfast.common.tf32 import set_tf32  # never the legacy allow_tf32 flags: see that module

    set_tf32(enabled)


class MixedPrecision(Strategy):
    """Fabric-style precision plugin: forward context, backward, unscale, optimizer step, scaler state."""

    name = "precision"

    def __init__(self, precision: str, device: torch.device, tf32: bool = False) -> None:
        if precision == "fp16" and device.type != "cuda":
            raise ValueError("precision 'fp16' needs a CUDA device; on CPU use 'bf16'")
        self.precision = precision
        self.device = device
        self.tf32 = tf32 and device.type == "cuda"
        self.scaler = torch.amp.GradScaler("cuda") if precision == "fp16" else None
        self._found_inf = False  # this step's overflow, read with the step's one host read
        if self.tf32:
            enable_tf32(True)

    def forward_context(self) -> AbstractContextManager[Any]:
        return autocast_context(self.precision, self.device)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def unscale_gradients(self, optimizer: torch.optim.Optimizer) -> torch.Tensor | None:
        """Bring gradients to their true scale (before clipping or inspecting them); returns the found-inf flag
        (a device tensor, no sync) or None without a scaler."""
        if self.scaler is None:
            return None
        self.scaler.unscale_(optimizer)
        found = self.scaler._per_optimizer_states[id(optimizer)]["found_inf_per_device"].values()
        return torch.stack([f.reshape(()).to(self.device) for f in found]).sum()

    def after_backward(self, step: Step) -> None:
        found_inf = self.unscale_gradients(step.engine.optimizer)
        if found_inf is not None:
            step.defer("found_inf", found_inf)

    def before_step(self, step: Step) -> bool:
        self._found_inf = bool(step.values.get("found_inf", 0.0))
        return True

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Step the optimizer; returns False when the gradients overflowed (fp16: the scaler backs off instead).

        The overflow flag was read with the step's one host read (`after_backward`), so unlike GradScaler.step this
        needs no `.item()` and no `get_scale()` before and after (torch/amp/grad_scaler.py `_maybe_opt_step`)."""
        if self.scaler is None:
            optimizer.step()
            return True
        if self.scaler._per_optimizer_states[id(optimizer)]["stage"].name != "UNSCALED":
            self._found_inf = bool(self.unscale_gradients(optimizer))  # a hand-written loop: one read here
        if not self._found_inf:
            optimizer.step()
        self.scaler.update()
        return not self._found_inf

    def skip_step(self) -> None:
        """A step abandoned after unscale_: let the scaler back off and forget this step's state."""
        if self.scaler is not None:
            self.scaler.update()

    def reset_after_oom(self) -> None:
        """Forget per-step scaler state (found-inf, unscaled) of an aborted step, as update() would."""
        if self.scaler is not None and hasattr(self.scaler, "_per_optimizer_states"):
            from torch.amp.grad_scaler import _refresh_per_optimizer_state

            self.scaler._per_optimizer_states = defaultdict(_refresh_per_optimizer_state)

    def state_dict(self) -> dict[str, Any]:
        return {"scaler": self.scaler.state_dict()} if self.scaler else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])

    def describe(self) -> str:
        what = {"fp32": "fp32 (no autocast)", "bf16": "bf16 autocast", "fp16": "fp16 autocast + GradScaler"}
        tf32 = ", TF32 matmuls" if self.tf32 else ""
        return f"precision: {what[self.precision]} on {self.device.type}{tf32}"


class EnginePrecision(Strategy):
    """The precision plugin of engines that run bf16/fp16 themselves (FSDP2's policy, DeepSpeed's config): no
    autocast on top, plain backward and step; `describe` says who does it."""

    name = "precision"

    def __init__(self, precision: str, owner: str) -> None:
        self.precision, self.owner = precision, owner

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> bool:
        optimizer.step()
        return True

    def skip_step(self) -> None:
        """Nothing to back off."""

    def reset_after_oom(self) -> None:
        """No per-step state."""

    def describe(self) -> str:
        return f"precision: {self.precision} by {self.owner}"
