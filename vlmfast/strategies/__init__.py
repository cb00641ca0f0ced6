"""One file per strategy: a plain function usable alone plus a thin class the trainer composes."""

from vlmfast.strategies.accumulation import GradientAccumulation
from vlmfast.strategies.base import Strategy
from vlmfast.strategies.checkpointing import ActivationCheckpointing
from vlmfast.strategies.oom import OOMFallback
from vlmfast.strategies.optimizer import Optimization
from vlmfast.strategies.precision import MixedPrecision

__all__ = [
    "ActivationCheckpointing",
    "GradientAccumulation",
    "MixedPrecision",
    "OOMFallback",
    "Optimization",
    "Strategy",
]
