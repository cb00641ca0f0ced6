"""The cheapest spec changes that make an estimate fit, in the reference guide's order.

Usage: ``plan = est.plan_fixes(24); plan.changes, plan.estimate.fits(24)`` (or ``est.cheapest_fixes(24)``)

A smaller micro-batch first (gradient accumulation keeps the effective batch), then chunked cross-entropy (no
logits kept), activation checkpointing (a budget when all of it is not needed),
mixed precision, freezing the vision tower, ZeRO-2, ZeRO-3, optimizer offload and parameter offload, each kept
only if it saves memory, until the estimate fits; then the largest micro-batch that still fits.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

from vlmfast.memory.options import EstimateOptions

__all__ = ["FIX_STEPS", "SPEC_KEYS", "Estimate", "FixPlan", "plan_fixes"]

# The spec fields the fixes name; deepspeed.* is not in TrainSpec yet (DESIGN.md lists the section).
SPEC_KEYS = {
    "micro_batch_size": "micro_batch_size",
    "linear_cross_entropy": "linear_cross_entropy.enabled",
    "checkpointing": "activation_checkpointing.enabled",
    "checkpoint_budget": "activation_checkpointing.budget_gb",
    "precision": "precision",
    "freeze": "optimizer.freeze",
    "zero_stage": "deepspeed.zero_stage",
    "offload_optimizer": "deepspeed.offload_optimizer",
    "offload_params": "deepspeed.offload_param",
}


class _Component(Protocol):
    """What a fix reads of one component row (``vlmfast.memory.estimator.ComponentMemory``)."""

    @property
    def name(self) -> str: ...
    @property
    def trainable(self) -> int: ...
    @property
    def roots(self) -> tuple[str, ...]: ...


E = TypeVar("E", bound="Estimate")


class Estimate(Protocol):
    """What planning needs of an estimate; ``vlmfast.memory.estimator.MemoryEstimate`` is one.

    A protocol, not an import of the estimator: the estimator calls the planner, the planner never imports it.
    Usage: ``def plan(est: Estimate) -> ...``
    """

    options: EstimateOptions
    gpu_memory_gb: float | None

    @property
    def components(self) -> Sequence[_Component]: ...
    @property
    def gpu_bytes(self) -> int: ...
    def fits(self, gpu_memory_gb: float | None = None, headroom: float = ...) -> bool: ...
    def reestimate(self: E, **changes: Any) -> E: ...


@dataclass
class FixPlan(Generic[E]):
    """The cheapest cumulative spec changes and the estimate with all of them applied.

    Usage: ``plan = est.plan_fixes(24); plan.changes, plan.estimate.fits(24)``
    """

    changes: list[str]
    estimate: E
    fits: bool


_Step = Callable[[Estimate], tuple[str, dict[str, Any]] | None]


def _fix_linear_cross_entropy(est: Estimate) -> tuple[str, dict[str, Any]] | None:
    if est.options.linear_cross_entropy:
        return None
    return (f"{SPEC_KEYS['linear_cross_entropy']}: true (the loss keeps no [tokens, vocab] logits)",
            {"linear_cross_entropy": True})


def _fix_checkpointing(est: Estimate) -> tuple[str, dict[str, Any]] | None:
    if est.options.checkpoint_scope is not None:
        return None
    return f"{SPEC_KEYS['checkpointing']}: true", {"activation_checkpointing": True}


def _fix_precision(est: Estimate) -> tuple[str, dict[str, Any]] | None:
    if est.options.precision != "fp32":
        return None
    return f"{SPEC_KEYS['precision']}: bf16", {"precision": "bf16"}


def _fix_freeze_vision(est: Estimate) -> tuple[str, dict[str, Any]] | None:
    vision = next((c for c in est.components if c.name == "vision_tower" and c.trainable), None)
    if vision is None:
        return None
    roots = list(vision.roots) or ["vision_tower"]
    return f"{SPEC_KEYS['freeze']}: [{', '.join(roots)}]", {"frozen": (*est.options.frozen, *roots)}


def _fix_zero(stage: int) -> _Step:
    def step(est: Estimate) -> tuple[str, dict[str, Any]] | None:
        n = est.options.world_size
        if est.options.zero_stage >= stage or n == 1:  # on one GPU sharding saves nothing
            return None
        what = "optimizer states and gradients" if stage == 2 else "weights, gradients and optimizer states"
        return f"{SPEC_KEYS['zero_stage']}: {stage} ({what} sharded over {n} GPUs)", {"zero_stage": stage}
    return step


def _fix_offload_optimizer(est: Estimate) -> tuple[str, dict[str, Any]] | None:
    if est.options.offload_optimizer:
        return None
    stage = max(est.options.zero_stage, 2)
    text = f"{SPEC_KEYS['offload_optimizer']}: cpu (optimizer states in host RAM)"
    if stage != est.options.zero_stage:
        text = f"{SPEC_KEYS['zero_stage']}: {stage} + {text}"
    return text, {"zero_stage": stage, "offload_optimizer": True}


def _fix_offload_params(est: Estimate) -> tuple[str, dict[str, Any]] | None:
    if est.options.offload_params:
        return None
    text = f"{SPEC_KEYS['offload_params']}: cpu (weights in host RAM, gathered layer by layer)"
    if est.options.zero_stage != 3:
        text = f"{SPEC_KEYS['zero_stage']}: 3 + {text}"
    return text, {"zero_stage": 3, "offload_optimizer": True, "offload_params": True}


# The reference guide's order after the micro-batch: checkpointing, mixed precision, freezing, ZeRO / offload.
FIX_STEPS: tuple[_Step, ...] = (
    _fix_linear_cross_entropy, _fix_checkpointing, _fix_precision, _fix_freeze_vision, _fix_zero(2), _fix_zero(3),
    _fix_offload_optimizer, _fix_offload_params,
)


def _largest_fitting_mbs(est: E, gpu_gb: float, upper: int) -> tuple[int, E]:
    """The largest micro-batch in upper, upper/2, ..., 1 that fits, or 1 with its estimate."""
    size = upper
    while True:
        candidate = est.reestimate(micro_batch_size=size)
        if size == 1 or candidate.fits(gpu_gb):
            return size, candidate
        size = max(size // 2, 1)


def plan_fixes(est: E, gpu_gb: float) -> FixPlan[E]:
    """Spec changes in the reference guide's priority order, applied cumulatively until ``est`` fits ``gpu_gb``.

    Usage: ``plan_fixes(est, 24).changes`` (what ``MemoryEstimate.plan_fixes(24)`` calls)
    """
    if est.fits(gpu_gb):
        return FixPlan([], est, True)
    original = est.options.micro_batch_size
    # First the cheapest fix: a smaller micro-batch, the effective batch kept by gradient accumulation.
    mbs, current = _largest_fitting_mbs(est, gpu_gb, max(original // 2, 1)) if original > 1 else (1, est)
    changes: list[str] = []
    for step in FIX_STEPS:
        if current.fits(gpu_gb):
            break
        proposal = step(current)
        if proposal is None:
            continue
        text, overrides = proposal
        candidate = current.reestimate(**overrides)
        if candidate.gpu_bytes < current.gpu_bytes:  # a change that saves nothing is not worth making
            current = candidate
            changes.append(text)
    if original > 1:
        # Later fixes may have freed room for a larger micro-batch than the first step settled on.
        mbs, current = _largest_fitting_mbs(current, gpu_gb, original)
        if mbs < original:
            changes.insert(0, f"{SPEC_KEYS['micro_batch_size']}: {mbs} (was {original}; keep batch_size, gradient "
                              "accumulation keeps the effective batch)")
    current, changes = _checkpoint_only_what_fits(current, changes, gpu_gb)
    current.gpu_memory_gb = gpu_gb  # the table of the plan's estimate judges against the GPU planned for
    return FixPlan(changes, current, current.fits(gpu_gb))


def _checkpoint_only_what_fits(est: Estimate, changes: list[str],
                               gpu_gb: float) -> tuple[Estimate, list[str]]:
    """Checkpointing every block was needed and it fits with room to spare: a budget of the room left for
    activations recomputes fewer blocks (activation_checkpointing.budget_gb), kept only if it still fits."""
    o = est.options
    text = f"{SPEC_KEYS['checkpointing']}: true"
    if text not in changes or not est.fits(gpu_gb) or o.checkpoint_budget_gb or o.checkpoint_scope != "all":
        return est, changes
    room = est.usable_bytes(gpu_gb) - (est.gpu_bytes - est.activation_bytes)
    budget_gb = math.floor(room / 2**30 * 10) / 10  # GiB, rounded down
    if room <= est.activation_bytes or budget_gb <= 0:
        return est, changes
    candidate = est.reestimate(checkpoint_budget_gb=budget_gb)
    if not candidate.fits(gpu_gb):
        return est, changes
    note = (f"{text} + {SPEC_KEYS['checkpoint_budget']}: {budget_gb:g} (only the blocks needed to fit are "
            "checkpointed: less recomputation)")
    return candidate, [note if change == text else change for change in changes]

