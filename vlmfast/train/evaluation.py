"""Held-out loss, weighted the way training weights it (by loss tokens or samples), so the two are comparable.

Usage::

    loss = trainer.evaluate(eval_dataset)       # or, in your own loop:
    loss = evaluate_loss(model, loader, GradientAccumulation(), to_device=lambda b: b, micro_batch_size=8)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any

import torch
from torch import nn

from vlmfast.data.batch import batch_size_of
from vlmfast.strategies.accumulation import GradientAccumulation


@torch.no_grad()
def evaluate_loss(
    model: nn.Module,
    batches: Iterable[Any],
    accumulation: GradientAccumulation,
    *,
    to_device: Callable[[Any], Any],
    forward_context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    max_batches: int | None = None,
    micro_batch_size: int | None = None,
) -> float:
    """Loss-token-weighted mean loss over `batches`, in eval mode (the model's mode is restored afterwards)."""
    was_training = model.training
    model.eval()
    loss_sum, items = None, 0.0
    try:
        for index, batch in enumerate(batches):
            if max_batches is not None and index >= max_batches:
                break
            plan = accumulation.plan(batch, micro_batch_size or batch_size_of(batch))
            for i, micro_batch in enumerate(plan.micro_batches):
                with forward_context():
                    share = accumulation.micro_batch_loss(model, to_device(micro_batch), plan, i)
                part = share.float() * plan.divisor  # this micro-batch's loss sum
                loss_sum = part if loss_sum is None else loss_sum + part
            items += accumulation.local_items(plan)  # every rank evaluates all data: count local items
    finally:
        model.train(was_training)
    return float(loss_sum if loss_sum is not None else 0.0) / max(items, 1.0)
