"""The training loop and what surrounds it: state, save/resume glue, evaluation, the batch-size search.

Usage::

    from vlmfast.train import OptimizedTrainer     # also `from vlmfast import OptimizedTrainer`
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # loaded on first use (PEP 562): `vlmfast.train.interrupt`, which the data loader imports, must
    # not pull in the loop (which imports the data loader) through this package
    from vlmfast.train.loop import OptimizedTrainer
    from vlmfast.train.state import FitResult, TrainState

__all__ = ["FitResult", "OptimizedTrainer", "TrainState"]

_LAZY = {"FitResult": "vlmfast.train.state", "OptimizedTrainer": "vlmfast.train.loop",
         "TrainState": "vlmfast.train.state"}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
