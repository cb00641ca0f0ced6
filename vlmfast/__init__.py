"""vlmfast: fast, out-of-memory-proof PyTorch training for vision-language models, one flag at a time.

Usage::

    from vlmfast import OptimizedTrainer, TrainSpec
    result = OptimizedTrainer(model, dataset, TrainSpec.from_file("run.yaml"), collate_fn=collate).fit()
"""

import vlmfast.attention as attention  # callable: vlmfast.attention(q, k, v, ...) dispatches to the active backend
from vlmfast.callbacks import Callback
from vlmfast.spec import SpecError, TrainSpec
from vlmfast.strategies.nonfinite import NonFiniteLossError
from vlmfast.train.loop import OptimizedTrainer
from vlmfast.train.state import FitResult, TrainState

__version__ = "0.1.0"

__all__ = [
    "Callback",
    "FitResult",
    "NonFiniteLossError",
    "OptimizedTrainer",
    "SpecError",
    "TrainSpec",
    "TrainState",
    "__version__",
    "attention",
]
