"""Callbacks: objects with any of these methods, passed as ``OptimizedTrainer(..., callbacks=[...])``.

Usage::

    class StopAtLoss(Callback):
        def on_step_end(self, trainer, metrics):
            if metrics["loss"] < 0.5:
                trainer.should_stop = True
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vlmfast.train.state import FitResult

OptimizedTrainer = Any  # the trainer (vlmfast.OptimizedTrainer) that calls the hooks: not imported, it imports these


class Callback:
    """Every hook is optional; the trainer calls the ones a callback defines."""

    def on_fit_start(self, trainer: OptimizedTrainer) -> None: ...

    def on_step_end(self, trainer: OptimizedTrainer, metrics: dict[str, Any]) -> None: ...

    def on_save(self, trainer: OptimizedTrainer, path: Path) -> None: ...

    def on_eval(self, trainer: OptimizedTrainer, metrics: dict[str, Any]) -> None: ...

    def on_fit_end(self, trainer: OptimizedTrainer, result: FitResult) -> None: ...
