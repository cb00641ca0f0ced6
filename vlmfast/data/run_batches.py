"""The whole run's batches in one DataLoader iteration: epoch after epoch, and not one batch past the run's end.

Why one iteration, not one per epoch: a DataLoader forks its worker processes when an iteration starts (and, with
``persistent_workers``, still waits for every worker and re-primes the queue at each new epoch). Started from a
process holding GBs of memory, each fork holds the GIL for tens of ms, so the training thread cannot launch work and
the device idles (issue 33: a ~0.7 s stall on an H200 at the end of the data). Chaining the epochs in the sampler
starts the workers once, before the first step, and their read-ahead runs straight across the epoch boundary.

Why a limit: a DataLoader reads ``prefetch_factor x num_workers`` batches ahead and a device prefetcher more; at the
end of a run those reads are wasted work that competes with the last steps. With ``limit`` the sampler yields only
the batches the run still needs (after a resume too), so nothing past ``max_steps`` is ever loaded.

Keys are ``(epoch, index)``: a worker seeds each sample's random numbers from the run's seed, the epoch and the index
(:class:`~vlmfast.data.bad_samples.IndexedDataset`), so random augmentations do not depend on the worker count, on
which worker got the batch, or on where a resume started.

Usage::

    batches = RunBatches(EpochSampler(len(data), seed=0, shuffle=True), batch_size=8, drop_last=True)
    batches.start_at(epoch=0, batch=0, limit=100)       # the next 100 batches, across as many epochs as it takes
    loader = DataLoader(IndexedDataset(data, seed=0), batch_sampler=batches, collate_fn=...)
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

from torch.utils.data import Sampler


class EpochOrder(Protocol):
    """A per-epoch sampler that can start at any sample of an epoch (EpochSampler, LengthGroupedSampler) or any
    batch of it (RankBalancedBatchSampler: it yields lists of indices)."""

    def set_position(self, epoch: int, start: int) -> None: ...
    def __iter__(self) -> Iterator[Any]: ...


class RunBatches(Sampler[list[tuple[int, int]]]):
    """Batches of ``(epoch, index)`` keys from a position on, epoch after epoch, at most ``limit`` of them."""

    def __init__(self, epochs: EpochOrder, batch_size: int, drop_last: bool, yields_batches: bool = False) -> None:
        self.epochs, self.batch_size, self.drop_last = epochs, batch_size, drop_last
        self.yields_batches = yields_batches  # the epoch sampler yields index lists (a batch sampler)
        self.epoch, self.batch, self.limit = 0, 0, None

    def start_at(self, epoch: int, batch: int, limit: int | None = None) -> None:
        """The next iteration starts at batch `batch` of epoch `epoch` and yields `limit` batches (None: no end)."""
        self.epoch, self.batch, self.limit = epoch, batch, limit

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, batch, left = self.epoch, self.batch, self.limit
        while left is None or left > 0:
            yielded = 0
            for indices in self._epoch_batches(epoch, batch):
                yield [(epoch, index) for index in indices]
                yielded += 1
                if left is not None:
                    left -= 1
                    if left == 0:
                        return
            if yielded == 0 and batch == 0:
                return  # an epoch without a batch: the loader names the problem, never loops here forever
            epoch, batch = epoch + 1, 0

    def _epoch_batches(self, epoch: int, batch: int) -> Iterator[list[int]]:
        self.epochs.set_position(epoch, batch * self.batch_size)
        if self.yields_batches:
            yield from self.epochs
            return
        indices: list[int] = []
        for index in self.epochs:
            indices.append(index)
            if len(indices) == self.batch_size:
                yield indices
                indices = []
        if indices and not self.drop_last:
            yield indices

    def __len__(self) -> int:
        """The batches of the next iteration when limited; a run without an end has no length (as a stream)."""
        if self.limit is None:
            raise TypeError("RunBatches without a limit yields epochs without end: it has no length")
        return self.limit
