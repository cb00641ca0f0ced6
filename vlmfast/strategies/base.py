"""The small protocol every trainer strategy follows.

A strategy acts at a few named points and owns its own state; the trainer calls them in order and never reaches
inside. Every method has a do-nothing default, so a strategy implements only the points it needs.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import nn


class Strategy:
    """Base class: `apply` at setup, `forward_context` around each micro-batch forward, state for checkpoints."""

    name: str = "strategy"

    def apply(self, model: nn.Module) -> nn.Module:
        """Change or wrap the model once, before the optimizer is built."""
        return model

    def forward_context(self) -> AbstractContextManager[Any]:
        """Context entered around every micro-batch forward pass (and the loss)."""
        return nullcontext()

    def state_dict(self) -> dict[str, Any]:
        """State to checkpoint (empty when the strategy is stateless)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def describe(self) -> str:
        """One line for the end-of-run report: what this strategy changed."""
        return self.name
