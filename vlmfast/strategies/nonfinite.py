"""A NaN/Inf loss or gradient: stop with a message naming the step and parameter groups, or skip the step.

`loss.on_nonfinite: stop` (the default) raises :class:`NonFiniteLossError` before the optimizer steps, so the last
checkpoint stays the last good state; `skip` drops the step (parameters untouched) up to
`loss.max_consecutive_skips` steps in a row.

Usage::

    if not math.isfinite(loss):
        handle_nonfinite(state, spec.loss, loss, grad_norm, optimization.nonfinite_groups())  # raises or warns
        optimizer.zero_grad(set_to_none=True)
"""

from __future__ import annotations

import logging
from typing import Any

from vlmfast.spec import LossSpec

log = logging.getLogger(__name__)


class NonFiniteLossError(RuntimeError):
    """The loss or gradient norm became NaN/Inf and the spec says stop."""


def handle_nonfinite(state: Any, policy: LossSpec, loss: float, grad_norm: float | None,
                     groups: list[str]) -> None:
    """Count a non-finite step on `state` (its `step`, `skipped_steps`, `consecutive_skips`); raise or warn."""
    step = state.step + 1
    where = f"; non-finite gradients in {', '.join(groups)}" if groups else ""
    message = f"step {step}: loss is {loss}" + (f", gradient norm {grad_norm}" if grad_norm is not None else "")
    state.skipped_steps += 1
    state.consecutive_skips += 1
    if policy.on_nonfinite == "stop" or state.consecutive_skips > policy.max_consecutive_skips:
        raise NonFiniteLossError(
            f"{message}{where}. Stopped (loss.on_nonfinite={policy.on_nonfinite}, "
            f"{state.consecutive_skips} non-finite step(s) in a row). Try a lower optimizer.lr, grad_clip, "
            "precision bf16 instead of fp16, or loss.on_nonfinite: skip; the last checkpoint is intact."
        )
    log.warning("%s%s: step skipped (loss.on_nonfinite=skip)", message, where)
