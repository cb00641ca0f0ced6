"""Gradient clipping: the global gradient norm clipped to `grad_clip`, measured after every loss correction.

Usage in a hand-written loop::

    norm = clip_gradients(list(model.parameters()), max_norm=1.0)    # vlmfast.hooks; returns the pre-clip norm
"""

from __future__ import annotations

import torch

from vlmfast.strategies.base import Step, Strategy


def clip_gradients(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm; returns the norm before clipping (a device tensor: no sync)."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor, the same on all ranks


class GradientClipping(Strategy):
    """Clips through the engine (FSDP2's DTensor norm; DeepSpeed clips inside its own step and reports the norm)."""

    name = "clipping"

    def __init__(self, max_norm: float) -> None:
        self.max_norm = max_norm

    def after_backward(self, step: Step) -> None:
        norm = step.engine.clip_gradients(self.max_norm)
        if norm is not None:
            step.defer("grad_norm", norm)  # read with the loss: the step's one host read

    def describe(self) -> str:
        return f"grad clip: global norm {self.max_norm:g}"
