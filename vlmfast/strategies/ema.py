"""Exponential moving average (EMA) of the weights: a smoother model for evaluation and for the final checkpoint.

`ema: {enabled, decay, every_steps, update_after_step}`. After each applied optimizer step (every `every_steps`),
``ema = decay * ema + (1 - decay) * weights`` over the trainable parameters, in one foreach kernel on the device
the weights live on (sharded FSDP2 parameters are averaged shard by shard). Before `update_after_step` the average
simply tracks the weights. It is evaluated next to the weights (`eval_loss_ema`) and saved in checkpoints.

Usage in a hand-written loop::

    ema = ExponentialMovingAverage(list(model.parameters()), decay=0.999)
    for batch in loader:
        ...; optimizer.step()
        ema.update()
    with ema.swapped_in():
        evaluate(model)
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager
from typing import Any

import torch

from vlmfast.common.sections import Field, Section
from vlmfast.strategies.base import Step, Strategy

__all__ = ["EMA", "EMASpec", "ExponentialMovingAverage", "update_ema"]


class EMASpec(Section):
    """Exponential moving average of the trainable weights, evaluated and checkpointed next to them."""

    enabled: bool = Field(False, description="keep an EMA of the trainable weights (eval_loss_ema is reported)")
    decay: float = Field(0.999, gt=0, lt=1, description="weight of the old average at each update")
    every_steps: int = Field(1, ge=1, description="update the average every this many optimizer steps")
    update_after_step: int = Field(0, ge=0, description="until this step the average copies the weights")


@torch.no_grad()
def update_ema(average: list[torch.Tensor], weights: list[torch.Tensor], decay: float) -> None:
    """``average = decay * average + (1 - decay) * weights``, in place (one foreach lerp)."""
    torch._foreach_lerp_(average, weights, 1.0 - decay)


class ExponentialMovingAverage:
    """The average of `parameters` (its own copies), updated in place; `swapped_in()` evaluates with it."""

    def __init__(self, parameters: list[torch.Tensor], decay: float = 0.999) -> None:
        self.parameters, self.decay = parameters, decay
        self.average = [p.detach().clone() for p in parameters]
        self.updates = 0

    @torch.no_grad()
    def update(self, decay: float | None = None) -> None:
        update_ema(self.average, [p.detach() for p in self.parameters], self.decay if decay is None else decay)
        self.updates += 1

    @torch.no_grad()
    def copy_weights(self) -> None:
        torch._foreach_copy_(self.average, [p.detach() for p in self.parameters])

    @contextmanager
    def swapped_in(self) -> Iterator[None]:
        """The averaged weights in the model inside the block; the trained ones restored after (a swap: no copy)."""
        with torch.no_grad():
            self._swap()
        try:
            yield
        finally:
            with torch.no_grad():
                self._swap()

    def _swap(self) -> None:
        for param, average in zip(self.parameters, self.average, strict=True):
            param.data, average.data = average.data, param.data


class EMA(Strategy):
    """The EMA strategy: created over the engine's trainable parameters at the first applied step."""

    name = "ema"

    def __init__(self, spec: EMASpec) -> None:
        self.spec = spec
        self.ema: ExponentialMovingAverage | None = None
        self._restored: dict[str, Any] | None = None

    def after_step(self, step: Step) -> None:
        if not step.applied:
            return
        if self.ema is None:
            self._start([p for p in step.engine.module.parameters() if p.requires_grad])
        if step.number <= self.spec.update_after_step:
            self.ema.copy_weights()
        elif step.number % self.spec.every_steps == 0:
            self.ema.update()

    def _start(self, parameters: list[torch.Tensor]) -> None:
        self.ema = ExponentialMovingAverage(parameters, self.spec.decay)
        if self._restored is not None:  # a checkpoint loaded before the first step: its average wins
            torch._foreach_copy_(self.ema.average, [t.to(p.device) for t, p in
                                                    zip(self._restored["average"], self.ema.average, strict=True)])
            self.ema.updates = self._restored["updates"]
            self._restored = None

    def eval_contexts(self) -> dict[str, AbstractContextManager[Any]]:
        return {"ema": self.ema.swapped_in()} if self.ema is not None else {}

    def state_dict(self) -> dict[str, Any]:
        if self.ema is None:
            return self._restored or {}
        return {"average": [t.detach().cpu() for t in self.ema.average], "updates": self.ema.updates}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state:
            self._restored = state  # applied when the parameters are known (the first step after the resume)

    def describe(self) -> str:
        updates = self.ema.updates if self.ema is not None else 0
        return (f"ema: decay {self.spec.decay:g} every {self.spec.every_steps} step(s) after step "
                f"{self.spec.update_after_step}; {updates} update(s); eval_loss_ema reported")
