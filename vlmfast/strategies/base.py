"""The small protocol every strategy follows, and the `Step` it acts on.

The loop calls the points in one fixed order (docs/architecture.md)::

    apply(model)                      once, before the engine wraps the model
    forward_context()                 around every micro-batch's forward and loss
    after_backward(step)              all micro-batches done: unscale, loss-weight correction, clipping
    before_step(step) -> bool         after the step's one host read; False vetoes the update (non-finite)
    after_step(step)                  the update happened (or was vetoed): schedules, EMA, counters
    eval_contexts()                   extra evaluations to run ({"ema": swap-in-the-averaged-weights})
    state_dict() / load_state_dict()  what a checkpoint keeps
    describe()                        one report line

Every point has a do-nothing default, so a strategy implements only what it needs. Strategies never import each
other; what several need (find the repeated blocks, unwrap a model) lives in shared modules.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn


@dataclass
class Step:
    """One optimizer step as the strategies see it.

    Device values a strategy wants on the host (the loss, the gradient norm, a found-inf flag) are registered with
    :meth:`defer` and read together by the loop in one transfer (:meth:`read`): one host sync per step.
    """

    number: int  # the optimizer step being taken, from 1
    engine: Any  # the Engine: gradients are scaled, clipped and stepped through it
    loss: torch.Tensor  # the global-batch loss (device)
    plan: Any = None  # the accumulation plan of this step
    values: dict[str, float] = field(default_factory=dict)  # host values, after read()
    metrics: dict[str, Any] = field(default_factory=dict)  # extra per-step metrics strategies report
    applied: bool = False  # whether the optimizer update happened
    _deferred: dict[str, torch.Tensor] = field(default_factory=dict)

    def defer(self, name: str, value: torch.Tensor) -> None:
        """Ask for a device scalar on the host; it arrives in `values[name]` after the loop's one read."""
        self._deferred[name] = value

    def scale_gradients(self, factor: float) -> None:
        """Correct gradients and the loss by `factor` (known only after backward)."""
        self.engine.scale_gradients(factor)
        self.loss = self.loss * factor

    def read(self) -> dict[str, float]:
        """The one device-to-host transfer of the step: the loss and everything deferred, stacked."""
        names = ["loss", *self._deferred]
        # float64 when a deferred value is (counts past 2**24 stay exact); float32 otherwise (MPS has no float64)
        dtype = torch.float64 if any(t.dtype == torch.float64 for t in self._deferred.values()) else torch.float32
        tensors = [self.loss.detach().to(dtype).reshape(())]
        tensors += [t.detach().to(dtype).reshape(()).to(self.loss.device) for t in self._deferred.values()]
        self.values.update(zip(names, torch.stack(tensors).tolist(), strict=True))
        self._deferred.clear()
        return self.values


class Strategy:
    """Base class: every point is optional (see the module docstring for the order the loop calls them in)."""

    name: str = "strategy"

    def apply(self, model: nn.Module) -> nn.Module:
        """Change or wrap the model once, before the engine wraps it and the optimizer is built."""
        return model

    def forward_context(self) -> AbstractContextManager[Any]:
        """Context entered around every micro-batch forward pass (and the loss)."""
        return nullcontext()

    def after_backward(self, step: Step) -> None:
        """All micro-batches of the step are done: gradients may be unscaled, corrected, clipped."""

    def before_step(self, step: Step) -> bool:
        """After the step's host read (`step.values`): return False to veto the update."""
        return True

    def after_step(self, step: Step) -> None:
        """The step is over (`step.applied` says whether the update happened)."""

    def eval_contexts(self) -> dict[str, AbstractContextManager[Any]]:
        """Extra evaluations: a name and a context to evaluate under (e.g. the EMA weights swapped in)."""
        return {}

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (empty when the strategy is stateless)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def describe(self) -> str:
        """One line for the end-of-run report: what this strategy changed."""
        return self.name


def overrides(strategy: Strategy, point: str) -> bool:
    """Whether `strategy` implements `point` itself (the loop skips do-nothing contexts)."""
    return getattr(type(strategy), point) is not getattr(Strategy, point)
