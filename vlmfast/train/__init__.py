"""The training loop and what surrounds it: state, save/resume glue, evaluation, the batch-size search.

Usage::

    from vlmfast.train import OptimizedTrainer     # also `from vlmfast import OptimizedTrainer`
"""

from vlmfast.train.loop import OptimizedTrainer
from vlmfast.train.state import FitResult, TrainState

__all__ = ["FitResult", "OptimizedTrainer", "TrainState"]
