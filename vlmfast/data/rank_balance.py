"""Balanced ranks: each global batch dealt so that the most loaded rank's estimated cost is as low as possible.

Every rank knows the same global batch (``batch_size x world_size`` indices of the epoch's seeded permutation, as
the positional deal takes them) and the samples' metadata (text tokens, images: the dataset's ``lengths`` and
``image_counts`` / ``modality_lengths``, never the pixels). :func:`deal` gives the samples, longest-processing-time
first, each to the rank with the least cost so far: a deterministic greedy partition that every rank computes
alike, with no communication. A rank's share is a set of samples, collated by the user's ``collate_fn``; shares
may differ in sample count (``batch_size`` stays the samples per rank on average). The loss is weighted by loss
tokens counted across ranks, so which rank computes which sample does not change the gradient.

Cost of a sample (:class:`CostModel`): ``tokens x per_token + tokens^2 x per_token_pair + images x per_image``, from
FLOP counts of the model (deterministic, :meth:`CostModel.from_model`) or the spec (``data.rank_balance_cost``);
``tokens`` mode charges text tokens only.

Usage::

    shares = deal(CostModel(per_token=1.0).costs(lengths, images), world_size=8)   # one list of indices per rank
    imbalance([costs[i] for i in share] ...)                                        # max / mean - 1
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Sampler

__all__ = ["CostModel", "RankBalancedBatchSampler", "deal", "imbalance", "positional_shares", "sample_metadata"]


@dataclass(frozen=True)
class CostModel:
    """Estimated cost of a sample: ``tokens x per_token + tokens^2 x per_token_pair + images x per_image``.

    Usage: ``CostModel.from_model(model).costs(lengths, images)``
    """

    per_token: float = 1.0
    per_token_pair: float = 0.0  # attention: a sample's score matrix grows with its length squared
    per_image: float = 0.0  # the vision tower's work per image

    @classmethod
    def from_model(cls, model: Any, tower: str | None = None, batches: Iterable[Any] | None = None) -> CostModel:
        """Coefficients from FLOP counts (fixed by the model, so every run deals alike): 6 FLOPs per parameter per
        token of the language model, 12 x layers x hidden per token pair (attention's QK^T and AV, forward and
        backward), and 6 FLOPs per vision parameter per image patch. Unknown parts count 0. The vision tower: `tower`
        (its module path), else learned (:func:`~vlmfast.common.image_path.find_image_modules`: the first module the
        model's ``get_image_features`` enters, else a probe forward of `batches`); none found: no vision part."""
        from vlmfast.common.image_path import find_image_modules
        from vlmfast.common.utils import unwrap_model
        from vlmfast.strategies.token_budget import image_token_cost

        model = unwrap_model(model)
        try:
            found = find_image_modules(model, batches, tower=tower)
        except ValueError:
            found = None
        vision = sum(p.numel() for p in model.get_submodule(found.tower).parameters()) if found else 0
        language = sum(p.numel() for p in model.parameters()) - vision
        config = getattr(model, "config", None)
        text = getattr(config, "text_config", None) or config
        layers = getattr(text, "num_hidden_layers", 0) or 0
        hidden = getattr(text, "hidden_size", 0) or 0
        patches = image_token_cost(model)
        return cls(per_token=6.0 * language, per_token_pair=12.0 * layers * hidden,
                   per_image=6.0 * vision * patches)

    def costs(self, tokens: Sequence[int], images: Sequence[int]) -> list[float]:
        """Each sample's estimated cost."""
        return [self.per_token * t + self.per_token_pair * t * t + self.per_image * k
                for t, k in zip(tokens, images, strict=True)]


def deal(costs: Sequence[float], world_size: int) -> list[list[int]]:
    """Positions ``0..len(costs)-1`` dealt to ``world_size`` ranks: the costliest first, each to the rank with the
    least total so far (ties: the lower rank; equal costs keep their order). Every position is dealt once, and the
    most loaded rank carries at most the mean plus the costliest sample (LPT's bound).

    Usage: ``deal([5, 1, 3, 3], 2)`` -> ``[[0, 1], [2, 3]]``
    """
    order = sorted(range(len(costs)), key=lambda i: (-costs[i], i))
    loads = [(0.0, rank) for rank in range(world_size)]
    heapq.heapify(loads)
    shares: list[list[int]] = [[] for _ in range(world_size)]
    for position in order:
        load, rank = heapq.heappop(loads)
        shares[rank].append(position)
        heapq.heappush(loads, (load + costs[position], rank))
    return [sorted(share) for share in shares]


def positional_shares(count: int, world_size: int) -> list[list[int]]:
    """The positional deal (strided, as ``rank_balance: off`` and DistributedSampler deal)."""
    return [list(range(rank, count, world_size)) for rank in range(world_size)]


def imbalance(costs: Sequence[float], shares: Sequence[Sequence[int]]) -> float:
    """``max / mean - 1`` of the per-rank costs of a deal (0: perfectly even)."""
    loads = [sum(costs[i] for i in share) for share in shares]
    mean = sum(loads) / max(len(loads), 1)
    return max(loads) / mean - 1.0 if mean > 0 else 0.0


def sample_metadata(dataset: Any) -> tuple[list[int], list[int]]:
    """(text tokens, images) of every sample, from the dataset's metadata: ``lengths`` (or the absolute value of
    ``modality_lengths``), and ``image_counts`` (else 1 for a positive ``modality_lengths``, else 0). Never reads a
    sample. Usage: ``tokens, images = sample_metadata(dataset)``"""
    from vlmfast.data.samplers import dataset_lengths

    try:
        tokens = [abs(n) for n in dataset_lengths(dataset, "length")]
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"data.rank_balance needs each sample's length without reading it: give the dataset a "
                         f"'lengths' attribute (a list, one token count per sample) ({exc})") from exc
    counts = getattr(dataset, "image_counts", None)
    if counts is not None:
        images = [int(c) for c in (counts.tolist() if isinstance(counts, torch.Tensor) else counts)]
    else:
        try:
            images = [1 if n > 0 else 0 for n in dataset_lengths(dataset, "modality_length")]
        except (ValueError, TypeError, AttributeError):
            images = [0] * len(tokens)
    return tokens, images


class RankBalancedBatchSampler(Sampler[list[int]]):
    """This rank's share of each global batch: the epoch's seeded permutation cut into global batches of
    ``batch_size x world_size``, each dealt by :func:`deal` on the samples' costs. Yields lists of indices (shares
    may differ in size). ``set_position(epoch, start)`` resumes at batch ``start // batch_size`` of the epoch.
    ``deals`` records, per batch of the epoch, the imbalance of the deal and of the positional one.

    With ``group_lengths`` (``data.group_by_length``), the epoch's order is grouping's
    (:func:`~vlmfast.data.samplers.grouped_order`): grouping decides which samples form each global batch, exactly
    those :class:`~vlmfast.data.samplers.LengthGroupedSampler` gives the ranks together, and the deal decides which
    rank computes which.

    Usage: ``DataLoader(data, batch_sampler=RankBalancedBatchSampler(costs, 8, seed=0, rank=r, world_size=w))``
    """

    def __init__(self, costs: Sequence[float], batch_size: int, seed: int, shuffle: bool = True, rank: int = 0,
                 world_size: int = 1, group_lengths: Sequence[int] | None = None, group_mode: str = "length") -> None:
        self.costs, self.batch_size, self.seed, self.shuffle = list(costs), batch_size, seed, shuffle
        self.rank, self.world_size = rank, world_size
        self.group_lengths, self.group_mode = group_lengths, group_mode
        self.epoch, self.start_batch = 0, 0
        # (epoch, batch of the epoch) -> (imbalance dealt, positional); the loader reads ahead across epochs
        self.deals: dict[tuple[int, int], tuple[float, float]] = {}

    def set_position(self, epoch: int, start: int) -> None:
        self.epoch, self.start_batch = epoch, start // self.batch_size

    def _order(self) -> list[int]:
        n = len(self.costs)
        if self.group_lengths is not None:  # grouping's global batches (the same seeding as the permutation's)
            from vlmfast.data.samplers import grouped_order

            return grouped_order(self.group_lengths, self.batch_size * self.world_size, mode=self.group_mode,
                                 seed=self.seed, epoch=self.epoch, shuffle=self.shuffle)
        if not self.shuffle:
            return list(range(n))
        generator = torch.Generator().manual_seed(self.seed * 100_003 + self.epoch)  # as EpochSampler
        return torch.randperm(n, generator=generator).tolist()

    def __len__(self) -> int:
        return len(self.costs) // self.world_size // self.batch_size - self.start_batch

    def share(self, batch: int, order: list[int] | None = None) -> list[int]:
        """This rank's samples of batch `batch` of the epoch (records both deals' imbalance in ``deals``)."""
        order, width = order if order is not None else self._order(), self.batch_size * self.world_size
        indices = order[batch * width:(batch + 1) * width]
        costs = [self.costs[i] for i in indices]
        shares = deal(costs, self.world_size)
        positional = positional_shares(len(costs), self.world_size)
        self.deals[(self.epoch, batch)] = (imbalance(costs, shares), imbalance(costs, positional))
        return [indices[p] for p in shares[self.rank]]

    def __iter__(self) -> Iterator[list[int]]:
        order = self._order()
        batches = len(self.costs) // self.world_size // self.batch_size  # as the positional deal, drop_last
        for b in range(self.start_batch, batches):
            yield self.share(b, order)
