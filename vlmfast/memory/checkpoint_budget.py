"""Which blocks to checkpoint, and how, so that activations fit a memory budget with the least recomputation.

Usage::

    costs = measure_block_costs(model, lambda: model(**batch).loss)           # one forward, nothing applied
    plan = plan_checkpointing(costs, budget_bytes=2 * 2**30)                  # per block: none / selective / full
    apply_checkpoint_plan(model, plan)                                        # vlmfast.hooks
    print(plan.describe())      # 'language_model.layers: 20 full, 4 selective; vision_tower.blocks: 24 none ...'

One probe forward records, for every repeated block (``vlmfast.common.module_tree.find_repeated_blocks``, both towers):

- ``none``: the bytes autograd saves inside the block (what the block keeps without checkpointing);
- ``full``: the bytes of the block's inputs (what non-reentrant checkpointing keeps), and the FLOPs of the block's
  whole forward, recomputed in backward;
- ``selective``: op-level checkpointing (``torch.utils.checkpoint.create_selective_checkpoint_contexts``) that keeps
  the outputs of matmuls, convolutions and attention kernels and recomputes everything else: the inputs plus those
  outputs are kept, and only the cheap elementwise ops (norms, activations, rotary, residual adds) are recomputed.

Then a knapsack over the blocks picks, for each, the option that minimises the recomputed FLOPs while everything
kept (outside the blocks too) fits the budget; the plan also reports the backward peak, with the largest checkpointed
block re-materialised during its recomputation (``include_recompute_peak`` plans for that peak instead). FLOPs
are counted as torch's FlopCounterMode counts matmul-type ops, plus one per output element of every other recomputed
op (so a selective block's recomputation is not free). Bytes are storages, each counted once, parameters left out,
as :func:`vlmfast.hooks.saved_tensor_bytes` counts them. Checkpointing every block is one of the plans the knapsack
considers, so the plan never recomputes more than it at the same budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from vlmfast.memory.activations import repeated_blocks, storage_key, tracking_blocks

__all__ = [
    "SAVED_OPS",
    "BlockCost",
    "BlockCosts",
    "CheckpointPlan",
    "every_block_plan",
    "measure_block_costs",
    "plan_checkpointing",
]

MODES = ("none", "selective", "full")
_aten = torch.ops.aten
# Outputs kept by selective checkpointing: the expensive ops (recomputing them is what costs FLOPs).
SAVED_OPS = frozenset(p for p in (
    _aten.mm, _aten.addmm, _aten.bmm, _aten.baddbmm, _aten.convolution, _aten._convolution,
    _aten._scaled_dot_product_flash_attention, _aten._scaled_dot_product_efficient_attention,
    getattr(_aten, "_scaled_dot_product_cudnn_attention", None),
    getattr(_aten, "_scaled_dot_product_flash_attention_for_cpu", None),
    getattr(_aten, "_scaled_dot_product_fused_attention_overrideable", None),
    getattr(_aten, "_flash_attention_forward", None), getattr(_aten, "_efficient_attention_forward", None),
) if p is not None)


@dataclass
class BlockCost:
    """What one repeated block keeps and recomputes under each option (bytes; FLOPs)."""

    path: str
    tower: str
    kept: dict[str, int]  # mode -> bytes kept until backward
    recomputed: dict[str, float]  # mode -> FLOPs recomputed in backward
    internals: int  # bytes re-materialised while the block is recomputed (the backward transient)

    def scaled(self, fixed: BlockCost, factor: float) -> BlockCost:
        """Linear extrapolation ``fixed + factor * (self - fixed)`` (probes at two micro-batch sizes)."""
        def lin(a: float, b: float) -> float:
            return max(b + factor * (a - b), 0.0)

        return BlockCost(self.path, self.tower, {m: math.ceil(lin(self.kept[m], fixed.kept[m])) for m in MODES},
                         {m: lin(self.recomputed[m], fixed.recomputed[m]) for m in MODES},
                         math.ceil(lin(self.internals, fixed.internals)))


@dataclass
class BlockCosts:
    """Every block's costs plus what is kept outside the blocks (embeddings, projector, head, loss)."""

    blocks: list[BlockCost]
    outside: int

    def times(self, factor: float) -> BlockCosts:
        """Costs ``factor`` times as large (a probe at one sample scaled to a micro-batch: linear in the rows)."""
        zero = BlockCosts([BlockCost(b.path, b.tower, dict.fromkeys(MODES, 0), dict.fromkeys(MODES, 0.0), 0)
                           for b in self.blocks], 0)
        return self.extrapolate(zero, factor, this_at=1.0, other_at=0.0)

    def extrapolate(self, other: BlockCosts, at: float, this_at: float = 2.0, other_at: float = 1.0) -> BlockCosts:
        """Costs at micro-batch ``at`` from these (measured at ``this_at``) and ``other`` (at ``other_at``)."""
        factor = (at - other_at) / (this_at - other_at)
        blocks = [b.scaled(o, factor) for b, o in zip(self.blocks, other.blocks, strict=True)]
        outside = max(other.outside + factor * (self.outside - other.outside), 0.0)
        return BlockCosts(blocks, math.ceil(outside))


def _tower(path: str) -> str:
    segments = path.split(".")
    return "vision" if any("vision" in s or s == "visual" for s in segments) else "language"


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    for leaf in tree_flatten(value)[0]:
        if isinstance(leaf, torch.Tensor):
            yield leaf


class _Recorder(TorchDispatchMode):
    """Attributes every op to the innermost block running it: FLOPs, outputs of saved ops, elementwise work."""

    def __init__(self, stack: list[int], blocks: int) -> None:
        super().__init__()
        self.stack = stack
        self.flops = [0.0] * blocks
        self.elementwise = [0.0] * blocks  # output elements of ops selective checkpointing recomputes
        self.cached: list[dict[int, int]] = [{} for _ in range(blocks)]
        self.keep: list[torch.Tensor] = []

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.stack:
            return out
        block = self.stack[-1]
        packet = func.overloadpacket
        if packet in flop_registry:
            self.flops[block] += float(flop_registry[packet](*args, **kwargs, out_val=out))
        if packet in SAVED_OPS:
            for tensor in _tensors(out):
                key, nbytes = storage_key(tensor)
                self.cached[block][key] = nbytes
                self.keep.append(tensor)
        elif not getattr(func, "is_view", False):
            self.elementwise[block] += sum(t.numel() for t in _tensors(out))
        return out


def measure_block_costs(model: nn.Module, run: Callable[[], Any],
                        blocks: Sequence[tuple[str, nn.Module]] | None = None) -> BlockCosts:
    """Costs of every repeated block of ``model`` under each option, from one forward ``run()`` (no checkpointing
    applied; call it in train mode with the precision of training).

    Usage: ``costs = measure_block_costs(model, lambda: model(**batch).loss)``
    """
    blocks = repeated_blocks(model) if blocks is None else list(blocks)
    resident = {storage_key(t)[0] for t in (*model.parameters(), *model.buffers())}
    stack: list[int] = []
    saved: list[dict[int, int]] = [{} for _ in blocks]
    inputs: list[dict[int, int]] = [{} for _ in blocks]
    outside: dict[int, int] = {}
    recorder = _Recorder(stack, len(blocks))
    keep: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key, nbytes = storage_key(tensor)
        if key not in resident:
            keep.append(tensor)
            (saved[stack[-1]] if stack else outside)[key] = nbytes
        return tensor

    with (tracking_blocks(blocks, resident, keep, stack, inputs), torch.enable_grad(),
          torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), recorder):
        result = run()
    del result
    _share_common(saved, inputs, recorder.cached, outside)
    costs = []
    for i, (path, _) in enumerate(blocks):
        held = dict(inputs[i]) if saved[i] else {}  # a block that saved nothing (no grad flowing) keeps nothing
        kept = {"none": sum(saved[i].values()), "full": sum(held.values()),
                "selective": sum((held | recorder.cached[i]).values()) if saved[i] else 0}
        recomputed = {"none": 0.0, "full": recorder.flops[i] + recorder.elementwise[i],
                      "selective": recorder.elementwise[i] if saved[i] else 0.0}
        costs.append(BlockCost(path, _tower(path), kept, recomputed, sum(saved[i].values())))
    keep.clear()
    recorder.keep.clear()
    return BlockCosts(costs, sum(outside.values()))


def _share_common(saved: list[dict[int, int]], inputs: list[dict[int, int]], cached: list[dict[int, int]],
                  outside: dict[int, int]) -> None:
    """Storages several blocks use (rotary cos/sin, an attention mask, a shared embedding) are kept once whatever
    the modes: count them outside the blocks, once, rather than in every block's sums."""
    seen: dict[int, int] = {}
    for i in range(len(saved)):
        for key in {*saved[i], *inputs[i], *cached[i]}:
            seen[key] = seen.get(key, 0) + 1
    for key, count in seen.items():
        if count < 2:
            continue
        for sets in (saved, inputs, cached):
            for table in sets:
                if key in table:
                    outside[key] = table.pop(key)


# ----------------------------------------------------------------------------------------------------------------
# the plan


@dataclass
class CheckpointPlan:
    """A mode per block and what it keeps and recomputes (planned, from the measured costs)."""

    modes: dict[str, str]
    budget_bytes: int
    kept_bytes: int  # outside + every block's kept bytes
    peak_bytes: int  # kept + the largest block re-materialised while recomputed
    recomputed_flops: float
    costs: BlockCosts = field(repr=False)
    fits: bool = True

    def counts(self) -> dict[str, dict[str, int]]:
        """``{list path: {mode: blocks}}``, e.g. ``{'language_model.layers': {'full': 2, 'selective': 1}}``."""
        out: dict[str, dict[str, int]] = {}
        for path, mode in self.modes.items():
            group = out.setdefault(path.rpartition(".")[0] or path, {})
            group[mode] = group.get(mode, 0) + 1
        return out

    def describe(self) -> str:
        groups = "; ".join(f"{g}: " + ", ".join(f"{n} {m}" for m, n in sorted(c.items())) for g, c in
                           self.counts().items())
        verdict = "" if self.fits else " (does NOT fit: every block checkpointed is the least this can keep)"
        return (f"budget {_gib(self.budget_bytes)}{verdict}: {groups}; keeps {_gib(self.kept_bytes)} "
                f"(+ {_gib(self.peak_bytes - self.kept_bytes)} while one block is recomputed), recomputes "
                f"{self.recomputed_flops / 1e9:.3g} GFLOP")


def _gib(n: float) -> str:
    return f"{n / 2**30:.3g} GiB" if n >= 2**28 else f"{n / 2**20:.3g} MiB"


def _knapsack(blocks: list[BlockCost], capacity: int, allowed: Callable[[BlockCost, str], bool],
              steps: int = 2048) -> tuple[float, list[str]] | None:
    """Least recomputation with the kept bytes within ``capacity`` (bytes rounded up: never over), or None."""
    if capacity < 0:
        return None
    unit = max(capacity / steps, 1.0)
    size = int(capacity // unit)
    inf = float("inf")
    best = [0.0] * (size + 1)  # best[c]: least FLOPs with at most c units used (blocks so far)
    choices: list[list[int]] = []
    for block in blocks:
        new = [inf] * (size + 1)
        pick = [-1] * (size + 1)
        for m, mode in enumerate(MODES):
            if not allowed(block, mode):
                continue
            w = math.ceil(block.kept[mode] / unit)
            f = block.recomputed[mode]
            for c in range(w, size + 1):
                candidate = best[c - w] + f
                if candidate < new[c]:
                    new[c], pick[c] = candidate, m
        best = new
        choices.append(pick)
    if best[size] == inf:
        return None
    modes, c = [], size
    for block, pick in zip(reversed(blocks), reversed(choices), strict=True):
        mode = MODES[pick[c]]
        modes.append(mode)
        c -= math.ceil(block.kept[mode] / unit)
    return best[size], modes[::-1]


def plan_checkpointing(costs: BlockCosts, budget_bytes: int, *, selective: bool = True,
                       towers: Sequence[str] = ("vision", "language"),
                       include_recompute_peak: bool = False) -> CheckpointPlan:
    """The plan with the least recomputed FLOPs whose kept bytes fit the budget.

    Usage: ``plan = plan_checkpointing(measure_block_costs(model, run), budget_bytes=2**30)``

    The budget is on the bytes kept for backward (what ``saved_tensor_bytes`` measures after the forward).
    ``include_recompute_peak`` also reserves room for the largest checkpointed block re-materialised during its
    recomputation in backward (``plan.peak_bytes``), which the plan reports either way. ``selective`` False leaves
    only none / full per block; blocks of towers not in ``towers`` stay unchecked. When nothing fits, the plan
    checkpoints everything it may (the least it can keep) and says it does not fit.
    """
    blocks = costs.blocks

    def allowed_with(limit: int) -> Callable[[BlockCost, str], bool]:
        def allowed(block: BlockCost, mode: str) -> bool:
            if mode == "none":
                return True
            return block.tower in towers and (mode != "selective" or selective) and block.internals <= limit
        return allowed

    best: tuple[float, list[str], int] | None = None
    # The backward transient is the largest block recomputed: try each possible largest one, keep the cheapest plan.
    limits = sorted({0, *(b.internals for b in blocks)}) if include_recompute_peak else [max(
        (b.internals for b in blocks), default=0)]
    for limit in limits:
        reserve = limit if include_recompute_peak else 0
        found = _knapsack(blocks, budget_bytes - costs.outside - reserve, allowed_with(limit))
        if found is not None and (best is None or found[0] < best[0]):
            best = (found[0], found[1], limit)
    if best is None:  # nothing fits: keep the least possible
        modes = ["full" if b.tower in towers else "none" for b in blocks]
        return _make_plan(costs, modes, budget_bytes, fits=False)
    return _make_plan(costs, best[1], budget_bytes, fits=True)


def _make_plan(costs: BlockCosts, modes: list[str], budget: int, fits: bool) -> CheckpointPlan:
    kept = costs.outside + sum(b.kept[m] for b, m in zip(costs.blocks, modes, strict=True))
    transient = max((b.internals for b, m in zip(costs.blocks, modes, strict=True) if m != "none"), default=0)
    flops = sum(b.recomputed[m] for b, m in zip(costs.blocks, modes, strict=True))
    return CheckpointPlan({b.path: m for b, m in zip(costs.blocks, modes, strict=True)}, budget, kept,
                          kept + transient, flops, costs, fits)


def every_block_plan(costs: BlockCosts, budget_bytes: int = 0) -> CheckpointPlan:
    """Checkpointing every block fully (what ``activation_checkpointing.enabled`` alone does), for comparison."""
    return _make_plan(costs, ["full"] * len(costs.blocks), budget_bytes, fits=True)
