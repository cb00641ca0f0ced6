"""Micro-batches of samples: the loop's one way to split an optimizer batch, whatever the model and its inputs.

A micro-batch is a set of *samples* collated by the user's own ``collate_fn`` (a processor knows its layout; vlmfast
does not need to). Two kinds of batch reach :func:`split_micro_batches`:

- a :class:`SampleBatch`, which vlmfast's loader hands over: the samples, still uncollated, plus their micro-batches
  already collated in the loader workers at the micro-batch size of the time. They are used as they are, or, when the
  size changed since (the OOM fallback shrank it), collated again from the samples on the spot - once: the loader
  is told the new size, and batches collated after that come at it;
- an already collated batch (the user's own DataLoader): split by the key-aware rules of
  :mod:`vlmfast.data.batch_layout`, which know the common image layouts and refuse, naming the key, what they
  cannot prove.

Any micro-batch size works (8 at 3 = 3 + 3 + 2): micro-batches are weighted by their loss tokens or samples, so the
split does not change the gradient.

Usage::

    for micro_batch in split_micro_batches(batch, micro_batch_size=3):       # batch: SampleBatch or collated
        loss = model(**move_to_device(micro_batch, device)).loss
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import send_to_device
from torch.utils.data import default_collate

from vlmfast.data.batch_layout import BatchLayout, split_collated, take_samples

__all__ = ["SampleBatch", "SampleCollate", "split_micro_batches"]

Collate = Callable[[list[Any]], Any]


def _chunks(samples: Sequence[Any], size: int) -> list[list[Any]]:
    return [list(samples[i:i + size]) for i in range(0, len(samples), size)]


class SampleBatch:
    """One optimizer batch as samples, plus its micro-batches collated at ``micro_batch_size``.

    Built in the loader workers by :class:`SampleCollate`; the loader attaches the collate function (not pickled
    with every batch) and a callback for a changed size. ``to`` / ``map`` act on the collated micro-batches and are
    remembered, so micro-batches collated again later get the same device copy and transforms. The host micro-batches
    (as collated, before ``to`` / ``map``) are kept too: :meth:`host_micro_batches_at` counts tokens on them, so the
    loop never reads the device copy to weight micro-batches (device prefetch). With ``whole`` (the batch collated at
    once by torch's default_collate, which only stacks) micro-batches of any size are slices of it.

    The samples cross the worker queue as one bytes object and are unpacked only if a micro-batch is collated again
    (after the OOM fallback): shared-memory tensors cost a round trip each, and samples are rarely needed.
    Usage: ``batch.micro_batches_at(3)`` -> a list of collated micro-batches of 3 samples (the last may be smaller).
    """

    def __init__(self, samples: Sequence[Any] | None, micro_batches: list[Any], micro_batch_size: int,
                 collate_fn: Collate | None = None, *, whole: Any = None, length: int | None = None) -> None:
        self._samples = list(samples) if samples is not None else None
        self._blob: bytes | None = None
        self._length = len(self._samples) if self._samples is not None else int(length or 0)
        self.whole = whole
        self.micro_batches = [whole] if whole is not None else micro_batches  # the collated tensors
        self._host: list[Any] | None = None  # the same micro-batches on the host, once map / to replaced them
        self.micro_batch_size = micro_batch_size
        self.collate_fn = collate_fn
        self.on_resize: Callable[[int], None] | None = None  # the loader's: collate later batches at the new size
        self._steps: list[Callable[[Any], Any]] = []  # device copy and transforms, replayed on re-collated ones
        self.group_host_micro_batches: list[Any] = []  # the host micro-batches of the last collate_groups

    @classmethod
    def from_samples(cls, samples: Sequence[Any], collate_fn: Collate | None = None) -> SampleBatch:
        """A batch of these samples, collated per micro-batch when asked (e.g. an estimator probe).

        Usage: ``estimate_memory(model, activation_probe=SampleBatch.from_samples(samples, collate))``
        """
        return cls(list(samples), [], len(samples), collate_fn)

    @property
    def samples(self) -> list[Any]:
        """The samples, as the dataset gave them (unpacked on first use)."""
        if self._samples is None:
            self._samples = torch.load(io.BytesIO(self._blob or b""), weights_only=False) if self._blob else []
            self._blob = None
        return self._samples

    def __len__(self) -> int:
        return self._length

    def __repr__(self) -> str:
        return (f"SampleBatch({self._length} samples, {len(self.micro_batches)} micro-batch(es) of "
                f"{self.micro_batch_size})")

    def __getstate__(self) -> dict[str, Any]:
        # Crosses the worker queue once per batch: the collate function and callbacks stay on the loader's side.
        blob = self._blob
        if blob is None and self._samples is not None:
            buffer = io.BytesIO()
            torch.save(self._samples, buffer)
            blob = buffer.getvalue()
        return {"blob": blob, "micro_batches": None if self.whole is not None else self.micro_batches,
                "whole": self.whole, "micro_batch_size": self.micro_batch_size, "length": self._length}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(None, state["micro_batches"], state["micro_batch_size"],  # type: ignore[misc]
                      whole=state["whole"], length=state["length"])
        self._blob = state["blob"]

    def micro_batches_at(self, micro_batch_size: int) -> list[Any]:
        """The micro-batches at this size: the collated ones when the size matches, else collated again now."""
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
        if self.whole is not None:  # stacked: a slice is exactly what collating those samples would give
            return split_collated(self.whole, micro_batch_size, host=self.host_micro_batches[0])  # reads the host
        size = min(micro_batch_size, self._length)
        if size == min(self.micro_batch_size, self._length) and self.micro_batches:
            return list(self.micro_batches)
        collate = self.collate_fn or default_collate
        host = [collate(chunk) for chunk in _chunks(self.samples, size)]
        fresh = []
        for micro_batch in host:
            for step in self._steps:
                micro_batch = step(micro_batch)
            fresh.append(micro_batch)
        self.micro_batches, self.micro_batch_size = fresh, micro_batch_size
        self._host = host if self._steps else None
        if self.on_resize is not None:
            self.on_resize(micro_batch_size)
        return list(fresh)

    @property
    def host_micro_batches(self) -> list[Any]:
        """The collated micro-batches as they are on the host (``micro_batches`` until ``to`` / ``map``)."""
        return list(self._host if self._host is not None else self.micro_batches)

    def host_micro_batches_at(self, micro_batch_size: int) -> list[Any]:
        """:meth:`micro_batches_at`'s micro-batches as collated on the host, in the same order: what to count
        tokens on without a device read once ``to`` moved them. Usage: ``batch.host_micro_batches_at(3)``"""
        if self.whole is not None:
            return split_collated(self.host_micro_batches[0], micro_batch_size)
        self.micro_batches_at(micro_batch_size)  # collated again (host and device) if the size changed
        return self.host_micro_batches

    def collate_groups(self, groups: Sequence[Sequence[int]]) -> list[Any]:
        """One micro-batch per group of sample indices (a token budget's plan), each collated from its own samples
        by the collate function (a default_collate batch: gathered from the stacked whole, the same thing), with the
        device copy and transforms replayed. Their host versions are :attr:`group_host_micro_batches` (counting).
        Usage: ``batch.collate_groups([[7, 2], [0, 1, 3]])``"""
        if self.whole is not None:
            host_whole = self.host_micro_batches[0]
            self.group_host_micro_batches = take_samples(host_whole, groups)
            return take_samples(self.whole, groups, host=host_whole)
        collate = self.collate_fn or default_collate
        host = [collate([self.samples[i] for i in group]) for group in groups]
        self.group_host_micro_batches = host
        fresh = []
        for micro_batch in host:
            for step in self._steps:
                micro_batch = step(micro_batch)
            fresh.append(micro_batch)
        return fresh

    def first(self, samples: int) -> Any:
        """The first ``samples`` samples collated as one micro-batch, leaving this batch as it is (probes)."""
        if self.whole is not None:
            return split_collated(self.whole, samples)[0]
        return (self.collate_fn or default_collate)(self.samples[:samples])

    def map(self, fn: Callable[[Any], Any]) -> SampleBatch:
        """Apply ``fn`` to every collated micro-batch (now, and to those collated again later)."""
        if self._host is None:
            self._host = list(self.micro_batches)  # kept for counting: see host_micro_batches_at
        self.micro_batches = [fn(mb) for mb in self.micro_batches]
        if self.whole is not None:
            self.whole = self.micro_batches[0]
        self._steps.append(fn)
        return self

    def to(self, device: torch.device | str, non_blocking: bool = False) -> SampleBatch:
        """Copy the collated micro-batches to ``device`` (the samples stay on the host, for re-collation)."""
        return self.map(lambda mb: send_to_device(mb, device, non_blocking=non_blocking))

    def pin_memory(self) -> SampleBatch:
        """Pin the collated micro-batches (DataLoader's pin_memory thread calls this)."""
        from torch.utils.data._utils.pin_memory import pin_memory

        self.micro_batches = [pin_memory(mb) for mb in self.micro_batches]
        if self.whole is not None:
            self.whole = self.micro_batches[0]
        return self


@dataclass
class SampleCollate:
    """The loader's collate: a :class:`SampleBatch` of the samples with micro-batches collated by ``collate_fn``.

    ``size`` is a one-element tensor in shared memory, so a size the trainer changes reaches the workers (and their
    next batches come at it). A plain dataclass: it pickles into DataLoader workers.
    Usage: ``DataLoader(data, batch_size=8, collate_fn=SampleCollate(collate, torch.tensor([4]).share_memory_()))``
    """

    collate_fn: Collate | None
    size: torch.Tensor

    def __call__(self, samples: list[Any]) -> SampleBatch:
        micro_batch_size = int(self.size[0])
        if self.collate_fn is None:
            # torch's default_collate stacks: slices of the whole batch are exactly the micro-batches it would
            # collate, and collating the whole batch keeps every sample checked against all the others (a sample
            # with a missing key or another shape is found and skipped, as before micro-batches of samples).
            return SampleBatch(None, [], micro_batch_size, whole=default_collate(samples), length=len(samples))
        micro_batches = [self.collate_fn(chunk) for chunk in _chunks(samples, micro_batch_size)]
        return SampleBatch(samples, micro_batches, micro_batch_size)


def split_micro_batches(batch: Any, micro_batch_size: int, layout: BatchLayout | None = None,
                        host: Any = None) -> list[Any]:
    """The micro-batches of ``batch`` at ``micro_batch_size`` samples each (the last one may be smaller).

    A :class:`SampleBatch` gives its collated micro-batches (collated again if the size changed); a collated batch
    is split by the key-aware rules of :func:`vlmfast.data.batch_layout.split_collated` (``layout``: the model's
    image / video token ids, :meth:`BatchLayout.from_model`), which refuse naming the key what they cannot prove.
    ``host``: the host batch a device ``batch`` was copied from; the rules read it, not the device copy.
    Usage: ``split_micro_batches(batch, 3, BatchLayout.from_model(model))``
    """
    if micro_batch_size < 1:
        raise ValueError(f"micro_batch_size must be at least 1, got {micro_batch_size}")
    if isinstance(batch, SampleBatch):
        return batch.micro_batches_at(micro_batch_size)
    return split_collated(batch, micro_batch_size, layout, host=host)
