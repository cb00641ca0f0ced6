"""A NaN/Inf loss or gradient: stop with a message naming the step and parameter groups, or skip the step.

`loss.on_nonfinite: stop` (the default) raises :class:`NonFiniteLossError` before the optimizer steps, so the last
checkpoint stays the last good state; `skip` drops the step (parameters untouched) up to
`loss.max_consecutive_skips` steps in a row. Under fp16 an overflowing gradient is the GradScaler's business (it
skips the step and backs off), so only the loss is checked there.

Usage in a hand-written loop::

    if not math.isfinite(loss):
        handle_nonfinite(step, spec.loss, loss, grad_norm, nonfinite_groups(optimizer, model), consecutive)
        optimizer.zero_grad(set_to_none=True)
"""

from __future__ import annotations

import logging
import math
from typing import Any

import torch
from torch import nn

from vlmfast.spec import LossSpec
from vlmfast.strategies.base import Step, Strategy

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/Inf and the spec says stop."""


def handle_nonfinite(step: int, policy: LossSpec, loss: float, grad_norm: float | None, groups: list[str],
                     consecutive: int) -> None:
    """Raise :class:`NonFiniteLossError` or warn, for the `consecutive`-th non-finite step in a row at `step`."""
    where = f"; non-finite gradients in {', '.join(groups)}" if groups else ""
    message = f"step {step}: loss is {loss}" + (f", gradient norm {grad_norm}" if grad_norm is not None else "")
    if policy.on_nonfinite == "stop" or consecutive > policy.max_consecutive_skips:
        raise NonFiniteLossError(
            f"{message}{where}. Stopped (loss.on_nonfinite={policy.on_nonfinite}, "
            f"{consecutive} non-finite step(s) in a row). Try a lower optimizer.lr, grad_clip, "
            "precision bf16 instead of fp16, or loss.on_nonfinite: skip; the last checkpoint is intact."
        )
    log.warning("%s%s: step skipped (loss.on_nonfinite=skip)", message, where)


def nonfinite_groups(optimizer: torch.optim.Optimizer, model: nn.Module) -> list[str]:
    """'group label (parameter names)' for every group holding NaN/Inf gradients (error path only: syncs)."""
    names = {id(p): name for name, p in model.named_parameters()}
    bad = []
    for group in optimizer.param_groups:
        hits = [names.get(id(p), "?") for p in group["params"]
                if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
        if hits:
            shown = ", ".join(hits[:4]) + (f" +{len(hits) - 4}" if len(hits) > 4 else "")
            bad.append(f"group '{group.get('label', '?')}' ({shown})")
    return bad


class NonFiniteGuard(Strategy):
    """Vetoes the update of a step whose loss (or, without a GradScaler, gradient norm) is NaN/Inf."""

    name = "nonfinite"

    def __init__(self, policy: LossSpec) -> None:
        self.policy = policy
        self.consecutive = 0

    def before_step(self, step: Step) -> bool:
        loss, norm = step.values["loss"], step.values.get("grad_norm")
        scaler_owns_gradients = "found_inf" in step.values
        if math.isfinite(loss) and (scaler_owns_gradients or norm is None or math.isfinite(norm)):
            self.consecutive = 0
            return True
        self.consecutive += 1
        groups = nonfinite_groups(step.engine.optimizer, step.engine.module)
        handle_nonfinite(step.number, self.policy, loss, norm, groups, self.consecutive)
        return False

    def state_dict(self) -> dict[str, Any]:
        return {"consecutive": self.consecutive}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.consecutive = state.get("consecutive", 0)

    def describe(self) -> str:
        if self.policy.on_nonfinite == "stop":
            return ""  # the default: nothing to report unless it fires (then the run stops with the reason)
        return f"non-finite steps: skipped (at most {self.policy.max_consecutive_skips} in a row)"
