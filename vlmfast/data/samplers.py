"""Length / modality grouping: optimizer batches of samples of similar length, the longest batch first.

Usage::

    sampler = LengthGroupedSampler(dataset_lengths(dataset, "modality_length"), batch_size=16, seed=0,
                                   mode="modality_length", rank=rank, world_size=world_size)
    loader = DataLoader(dataset, batch_size=16, sampler=sampler, collate_fn=collate, drop_last=True)
    padding_waste(dataset_lengths(dataset, "length"), list(sampler), 16)     # fraction of padded tokens

A batch is padded to its longest sample, so a random batch of short and long captions is mostly padding. Like
Hugging Face's ``group_by_length``, each epoch's seeded permutation is cut into windows of up to 50 optimizer batches
(fewer for small data, so the order stays random), each window is sorted by length and cut into batches, and the
batches are shuffled. The batch holding the longest sample goes first, so a run that will run out of memory does so
at step 1, not hours in. ``modality_length`` is LLaVA's ``group_by_modality_length``: lengths are positive for samples
with an image and negative for text-only ones, and the two are batched apart (only the few left over at the end of
an epoch share a batch), so a batch never runs the vision tower on a single image.

Distributed: batches are formed over the global batch (``batch_size x world_size``) and dealt to ranks strided, as
:class:`~vlmfast.data.loader.EpochSampler` does, so a 2-rank run sees at each step exactly the samples a 1-process
run with the global batch sees, every rank gets as many samples, and ``set_position(epoch, start)`` resumes exactly.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, Subset

__all__ = ["GROUPING_MODES", "LengthGroupedSampler", "check_groupable", "dataset_lengths", "grouped_order",
           "padding_waste"]

GROUPING_MODES = ("length", "modality_length")
MAX_WINDOW_BATCHES = 50  # as Hugging Face: sorting windows of at most 50 batches keep the epoch order random

Lengths = Sequence[int] | torch.Tensor | Callable[[int], int]


def dataset_lengths(dataset: Dataset, mode: str, lengths: Lengths | None = None) -> list[int]:
    """Per-sample lengths for grouping: ``lengths`` if given (a sequence, or a callable of the sample index), else
    the dataset's ``modality_lengths`` (mode 'modality_length') or ``lengths`` (mode 'length'; falls back to
    ``modality_lengths``), as a list, a tensor, or a method returning one. A ``Subset`` uses its parent's lengths.

    Usage: ``dataset_lengths(dataset, "length", lengths=lambda i: len(captions[i]))``
    """
    if mode not in GROUPING_MODES:
        raise ValueError(f"data.group_by_length must be one of {('none', *GROUPING_MODES)}, got '{mode}'")
    size = len(dataset)  # type: ignore[arg-type]
    if lengths is None:
        found = _lengths_attribute(dataset, mode)
    elif callable(lengths):
        found = [lengths(i) for i in range(size)]
    else:
        found = lengths
    values = [int(v) for v in (found.tolist() if isinstance(found, torch.Tensor) else found)]
    if len(values) != size:
        raise ValueError(f"data.group_by_length: got {len(values)} lengths for a dataset of {size} samples; "
                         "give one length per sample")
    if mode == "modality_length" and 0 in values:
        raise ValueError(f"data.group_by_length 'modality_length': sample {values.index(0)} has length 0; use a "
                         "positive length for samples with an image and a negative one for text-only samples")
    return values


def _lengths_attribute(dataset: Dataset, mode: str) -> Any:
    if isinstance(dataset, Subset):
        parent = dataset_lengths(dataset.dataset, mode)
        return [parent[i] for i in dataset.indices]
    names = ("modality_lengths",) if mode == "modality_length" else ("lengths", "modality_lengths")
    for name in names:
        value = getattr(dataset, name, None)
        if value is not None:
            return value() if callable(value) else value
    wanted = ("a `modality_lengths` attribute (per sample: token count, positive with an image, negative "
              "text-only; LLaVA's convention)" if mode == "modality_length" else
              "a `lengths` attribute (token count per sample)")
    raise ValueError(f"data.group_by_length '{mode}' needs per-sample lengths, but {type(dataset).__name__} has "
                     f"no {' or '.join(names)}: give the dataset {wanted}, as a list or a property (cheap: without "
                     "loading images), or pass lengths= to LengthGroupedSampler / dataset_lengths")


def check_groupable(data: Any, mode: str) -> None:
    """Fail clearly when grouping is asked for data vlmfast does not index (an IterableDataset or a DataLoader)."""
    if mode != "none" and isinstance(data, (DataLoader, IterableDataset)):
        raise ValueError(f"data.group_by_length '{mode}' needs a map-style Dataset (with __len__ and __getitem__) "
                         f"to reorder, got a {type(data).__name__}: pass the Dataset, or set group_by_length: none")


def grouped_order(
    lengths: Sequence[int] | torch.Tensor,
    global_batch_size: int,
    *,
    mode: str = "length",
    seed: int = 0,
    epoch: int = 0,
    shuffle: bool = True,
    window_batches: int | None = None,
) -> list[int]:
    """One epoch's sample order for all ranks; each run of ``global_batch_size`` indices is one optimizer step.

    Usage: ``order = grouped_order(lengths, global_batch_size=32, seed=0, epoch=3)``

    Full batches come first (shuffled, the one holding the longest sample in front), then the batches made of the
    samples left over from each modality (sorted, mixed modalities, the last one partial).
    """
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be >= 1, got {global_batch_size}")
    lengths = torch.as_tensor(lengths, dtype=torch.long)
    size = lengths.abs()
    generator = torch.Generator().manual_seed(seed * 100_003 + epoch)  # EpochSampler's seeding
    order = torch.randperm(len(lengths), generator=generator) if shuffle else torch.arange(len(lengths))
    groups = [order[lengths[order] > 0], order[lengths[order] <= 0]] if mode == "modality_length" else [order]
    full: list[torch.Tensor] = []  # per group: [batches, global_batch_size]
    leftovers: list[torch.Tensor] = []
    for group in groups:
        group = _longest_to_front(group, size)  # so it lands in a full batch, never in the partial tail
        n_batches = len(group) // global_batch_size
        window = window_batches or max(1, min(MAX_WINDOW_BATCHES, n_batches // 4))
        sorted_group = _sort_windows(group[:n_batches * global_batch_size], size, window * global_batch_size)
        full.append(sorted_group.view(n_batches, global_batch_size))
        leftovers.append(group[n_batches * global_batch_size:])
    batches = torch.cat(full)
    if shuffle:
        batches = batches[torch.randperm(len(batches), generator=generator)]
    if len(batches):  # the batch holding the longest sample first: an OOM shows at step 1
        longest = int(size[batches].amax(dim=1).argmax())
        batches[[0, longest]] = batches[[longest, 0]]
    rest = torch.cat(leftovers)
    tail = rest[torch.sort(size[rest], descending=True, stable=True).indices]
    return torch.cat([batches.flatten(), tail]).tolist()


def _longest_to_front(group: torch.Tensor, size: torch.Tensor) -> torch.Tensor:
    if len(group) < 2:
        return group
    group = group.clone()
    longest = int(torch.argmax(size[group]))
    group[[0, longest]] = group[[longest, 0]]
    return group


def _sort_windows(indices: torch.Tensor, size: torch.Tensor, window: int) -> torch.Tensor:
    """Sort each run of ``window`` indices by length, longest first (stable: ties keep the shuffled order)."""
    if not len(indices):
        return indices
    lengths = size[indices]
    # One stable sort on (window number, -length): every window sorted longest first, windows kept in order.
    key = torch.arange(len(indices)) // window * (int(lengths.max()) + 1) - lengths
    return indices[torch.sort(key, stable=True).indices]


class LengthGroupedSampler(Sampler[int]):
    """This rank's share of :func:`grouped_order`, resumable at any sample of the epoch (as ``EpochSampler``).

    Usage: ``LengthGroupedSampler(lengths, batch_size=16, seed=0, mode="modality_length", rank=1, world_size=2)``

    ``batch_size`` is the per-rank optimizer batch; the loader must batch with the same size.
    """

    def __init__(
        self,
        lengths: Sequence[int] | torch.Tensor,
        batch_size: int,
        seed: int = 0,
        shuffle: bool = True,
        rank: int = 0,
        world_size: int = 1,
        mode: str = "length",
        window_batches: int | None = None,
    ) -> None:
        if mode not in GROUPING_MODES:
            raise ValueError(f"data.group_by_length must be one of {('none', *GROUPING_MODES)}, got '{mode}'")
        self.lengths = torch.as_tensor(lengths, dtype=torch.long)
        self.num_samples = len(self.lengths)
        self.batch_size, self.seed, self.shuffle, self.mode = batch_size, seed, shuffle, mode
        self.rank, self.world_size, self.window_batches = rank, world_size, window_batches
        self.epoch = 0
        self.start = 0  # samples of this rank's share already consumed
        self._cache: tuple[int, list[int]] | None = None

    def set_position(self, epoch: int, start: int) -> None:
        self.epoch, self.start = epoch, start

    def _indices(self) -> list[int]:
        if self._cache is None or self._cache[0] != self.epoch:
            order = grouped_order(self.lengths, self.batch_size * self.world_size, mode=self.mode, seed=self.seed,
                                  epoch=self.epoch, shuffle=self.shuffle, window_batches=self.window_batches)
            per_rank = self.num_samples // self.world_size  # equal shares: no rank waits at the epoch end
            self._cache = (self.epoch, order[self.rank::self.world_size][:per_rank])
        return self._cache[1]

    def __iter__(self) -> Iterator[int]:
        return iter(self._indices()[self.start:])

    def __len__(self) -> int:
        return self.num_samples // self.world_size - self.start


def padding_waste(lengths: Sequence[int] | torch.Tensor, indices: Sequence[int], batch_size: int) -> float:
    """Fraction of the tokens in right-padded batches that are padding, for ``indices`` batched in order.

    Usage: ``padding_waste(lengths, list(sampler), batch_size=16)`` -> 0.42
    """
    size = torch.as_tensor(lengths, dtype=torch.long).abs()
    order = torch.as_tensor(list(indices), dtype=torch.long)
    real = padded = 0
    for batch in torch.split(order, batch_size):
        batch_sizes = size[batch]
        real += int(batch_sizes.sum())
        padded += int(batch_sizes.max()) * len(batch)
    return 1.0 - real / padded if padded else 0.0
