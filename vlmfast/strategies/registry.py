"""Which strategies a spec turns on, built in the order the loop calls them.

Adding a strategy: a new file (its spec section, a plain function, a thin class with a `from_spec`), its section in
:class:`vlmfast.spec.TrainSpec`, and one line in :data:`OPTIONAL_STRATEGIES`. The loop is not touched.

Usage::

    strategies = build_strategies(spec, BuildContext(device=device, world_size=1))
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vlmfast.strategies.activation_checkpointing import ActivationCheckpointing
from vlmfast.strategies.attention import AttentionBackend
from vlmfast.strategies.base import Strategy
from vlmfast.strategies.clipping import GradientClipping
from vlmfast.strategies.compile import TorchCompile
from vlmfast.strategies.linear_cross_entropy import LinearCrossEntropy
from vlmfast.strategies.nonfinite import NonFiniteGuard


@dataclass
class BuildContext:
    """What strategies may need besides the spec."""

    device: torch.device
    world_size: int = 1


def _attention(spec: Any, ctx: BuildContext) -> Strategy | None:
    return AttentionBackend(spec.attention, precision=spec.precision) if spec.attention.backend is not None else None


def _activation_checkpointing(spec: Any, ctx: BuildContext) -> Strategy | None:
    # After the optimizer's freezing (the loop applies it first): frozen towers keep no graph.
    if not spec.activation_checkpointing.enabled:
        return None
    return ActivationCheckpointing(spec.activation_checkpointing, micro_batch_size=spec.resolved_micro_batch_size,
                                   micro_batch_tokens=spec.micro_batch_tokens, precision=spec.precision,
                                   chunked_loss=spec.linear_cross_entropy.enabled)


def _linear_cross_entropy(spec: Any, ctx: BuildContext) -> Strategy | None:
    # Before compile (it traces the replaced forward); after checkpointing (independent of it).
    return LinearCrossEntropy(spec.linear_cross_entropy) if spec.linear_cross_entropy.enabled else None


def _clipping(spec: Any, ctx: BuildContext) -> Strategy | None:
    return GradientClipping(spec.grad_clip) if spec.grad_clip else None


def _nonfinite(spec: Any, ctx: BuildContext) -> Strategy | None:
    return NonFiniteGuard(spec.loss)


def _compile(spec: Any, ctx: BuildContext) -> Strategy | None:
    # Last to apply: it traces the checkpointed blocks; the engine (DDP) wraps the compiled model.
    return TorchCompile(spec.compile) if spec.compile.enabled else None


# In order: `apply` runs top to bottom, and so does every step point (clipping after the loss corrections).
OPTIONAL_STRATEGIES: list[Callable[[Any, BuildContext], Strategy | None]] = [
    _attention,
    _activation_checkpointing,
    _linear_cross_entropy,
    _clipping,
    _nonfinite,
    _compile,
]


def build_strategies(spec: Any, ctx: BuildContext) -> list[Strategy]:
    """The optional strategies `spec` turns on, in the order of :data:`OPTIONAL_STRATEGIES`."""
    return [s for build in OPTIONAL_STRATEGIES if (s := build(spec, ctx)) is not None]
