"""Calling a model the way its batch is shaped, and reading the loss out of whatever it returns.

Usage::

    loss = extract_loss(call_model(model, batch))       # dict batch -> model(**batch); HF output -> .loss
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["NoLossError", "call_model", "extract_loss"]

# Where the CLI takes a loss_fn from: said in the no-loss error, so `vlmfast train --task` users learn they can.
LOSS_FN_HINT = ("pass loss_fn=lambda model, batch: ... to OptimizedTrainer (with the CLI's --task: return it as the "
                "task's 4th item, or as 'loss_fn' in its dict)")


class NoLossError(TypeError, ValueError):
    """The model's output holds no loss (logits only, or loss=None): no spec field can fix that, a loss_fn can.
    A TypeError as before, and a ValueError so the CLI prints it in one line."""


def extract_loss(output: Any) -> torch.Tensor:
    """The loss of a model output: a tensor, a dict with "loss", an object with `.loss`, or a tuple led by it."""
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, Mapping) and "loss" in output:
        loss = output["loss"]
    elif hasattr(output, "loss"):
        loss = output.loss
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        loss = output[0]
    else:
        raise NoLossError(f"the model returned a {type(output).__name__} without a 'loss': return a loss tensor, a "
                          f"dict with 'loss' or an object with .loss, or {LOSS_FN_HINT}")
    if loss is None:
        raise NoLossError(f"the model returned loss=None: does the batch have labels? Otherwise {LOSS_FN_HINT}")
    if loss.dim() != 0:
        raise ValueError(f"the loss must be a scalar, got shape {tuple(loss.shape)}: reduce it (mean or sum)")
    return loss


def call_model(model: nn.Module, batch: Any, **extra: Any) -> Any:
    """Call a model the way its batch is shaped: keywords for a dict, positional for a tuple/list."""
    if isinstance(batch, Mapping):
        return model(**batch, **extra)
    if isinstance(batch, (tuple, list)):
        return model(*batch, **extra)
    return model(batch, **extra)
