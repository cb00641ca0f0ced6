"""Bad samples in a Dataset: skipped and counted, or an error that names the sample and what to do.

A sample is bad when reading it raises (an undecodable image, a truncated file), when it does not fit the rest of
its batch (other keys than the others, or a shape that the collate function cannot stack with theirs), or when it
fails the host-side checks of ``data.check_samples`` (float token ids, ids or labels outside the vocabulary, NaN or
Inf pixels: ``vlmfast.data.sample_checks``). The trainer's
loader drops such samples from the batch and counts them (in shared memory, across DataLoader workers) until more
than ``data.max_bad_sample_fraction`` of the samples read (over at least 100) were bad; then it stops with
:class:`TooManyBadSamplesError`, naming the sample's dataset index and why. An error that the whole batch hits (a
collate function that does not suit this data) is nobody's sample: it propagates unchanged, with the batch's
indices noted.

Usage (the trainer's ResumableLoader does this for every Dataset)::

    checked = CheckedCollate(collate_fn, BadSampleCounts(), max_bad_fraction=0.01)
    loader = DataLoader(IndexedDataset(dataset), batch_size=8, collate_fn=checked)
    checked.counts.as_dict()                        # {"samples": 120, "bad": 1}
"""

from __future__ import annotations

import logging
import random
import sys
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate, get_worker_info

from vlmfast.data.sample_checks import SampleCheck

log = logging.getLogger(__name__)

MIN_WINDOW = 100  # the bad fraction is taken over at least this many samples: one early bad sample is allowed
MAX_COUNT_SLOTS = 257  # one counter row per DataLoader worker (+ the main process): no cross-process races
LOGGED_PER_PROCESS = 5
MAX_SEARCH = 64  # samples; above this a batch whose misfits are not one minority shape is not searched further


class BadSampleError(ValueError):
    """One sample could not be read or used; the message names it."""


class TooManyBadSamplesError(RuntimeError):
    """More samples than the allowed fraction were corrupt or unreadable; the message names the last one."""


@dataclass(frozen=True)
class FailedSample:
    """What :class:`IndexedDataset` yields in place of a sample whose reading raised."""

    reason: str


class IndexedDataset(Dataset):
    """Yields ``(index, sample)``, or ``(index, FailedSample)`` when ``data[index]`` raises, so the collate step
    can name and skip the sample.

    A key may be ``(epoch, index)`` (:class:`~vlmfast.data.run_batches.RunBatches` yields those): in a DataLoader
    worker with a `seed`, the sample's random numbers (torch, random, numpy) are then seeded from the seed, the epoch
    and the index, so an augmentation draws the same numbers whichever worker reads the sample, with any worker
    count, and after a resume. Not in the training process, whose generators drive dropout.
    """

    def __init__(self, data: Dataset, seed: int | None = None) -> None:
        self.data = data
        self.seed = seed

    def __len__(self) -> int:
        return len(self.data)  # type: ignore[arg-type]

    def __getitem__(self, key: int | tuple[int, int]) -> tuple[int, Any]:
        index = self._index(key)
        try:
            return index, self.data[index]
        except Exception as exc:  # any reader error: PIL, OSError, a user's KeyError
            return index, FailedSample(f"reading it raised {_one_line(exc)}")

    def __getitems__(self, keys: Sequence[int | tuple[int, int]]) -> list[tuple[int, Any]]:
        many = getattr(self.data, "__getitems__", None)  # batched readers (Hugging Face datasets) stay batched
        if many is not None:
            indices = [self._index(key) for key in keys]
            try:
                return list(zip(indices, many(indices), strict=True))
            except Exception:
                pass  # one sample spoiled the batch read: find it sample by sample
        return [self[key] for key in keys]

    def _index(self, key: int | tuple[int, int]) -> int:
        if not isinstance(key, tuple):
            return key
        epoch, index = key
        if self.seed is not None and get_worker_info() is not None:
            seed_sample(self.seed, epoch, index)
        return index


def seed_sample(seed: int, epoch: int, index: int) -> None:
    """Seed this process's torch, random and numpy generators for sample `index` of `epoch` (a worker's own)."""
    value = ((seed * 1_000_003 + epoch) * 2_147_483_659 + index) % 2**63
    torch.manual_seed(value)
    random.seed(value)
    numpy = sys.modules.get("numpy")  # only when the data code uses it: importing it here would cost every worker
    if numpy is not None:
        numpy.random.seed(value % 2**32)


class BadSampleCounts:
    """Samples delivered and bad samples skipped, summed over the DataLoader's processes."""

    def __init__(self) -> None:
        self.table = torch.zeros(MAX_COUNT_SLOTS, 2, dtype=torch.int64).share_memory_()

    def add(self, good: int, bad: int) -> None:
        """Count this process's samples (its own row: no cross-process race)."""
        info = get_worker_info()
        slot = (info.id + 1) % MAX_COUNT_SLOTS if info is not None else 0
        if good:
            self.table[slot, 0] += good
        if bad:
            self.table[slot, 1] += bad

    def as_dict(self) -> dict[str, int]:
        """Totals over all processes."""
        good, bad = (int(v) for v in self.table.sum(dim=0))
        return {"samples": good, "bad": bad}

    def too_many(self, max_bad_fraction: float) -> bool:
        """More bad samples than `max_bad_fraction` of those read (over at least MIN_WINDOW)?"""
        good, bad = (int(v) for v in self.table.sum(dim=0))
        return bad > max_bad_fraction * max(good + bad, MIN_WINDOW)

    def reset(self) -> None:
        self.table.zero_()


@dataclass
class CheckedCollate:
    """Collate that drops bad samples (counted, logged) and names them; see the module docstring.

    `indexed`: the items are ``(index, sample)`` pairs from :class:`IndexedDataset` (else raw samples of a stream,
    named by their position in the batch).
    """

    collate_fn: Callable[[list[Any]], Any] | None
    counts: BadSampleCounts
    max_bad_fraction: float = 0.01
    indexed: bool = True
    logged: int = 0
    check: SampleCheck | None = None  # host-side checks of ids, labels and pixels (data.check_samples)
    check_mode: str = "skip"  # skip: drop and count a sample that fails them; error: stop naming it

    def __call__(self, items: list[Any]) -> Any:
        indices, samples = self._unpack(items)
        bad = {k: s.reason for k, s in enumerate(samples) if isinstance(s, FailedSample)}
        good = [k for k in range(len(samples)) if k not in bad]
        batch = None
        if good:
            try:
                batch = self._collate([samples[k] for k in good])
            except Exception as exc:
                misfits = find_misfits([samples[k] for k in good], self._collate)
                if not misfits:
                    _note(
                        exc,
                        f"while collating samples {self._names(indices, good)}; every sample alone or "
                        "together hits it, so it is not a bad sample: check collate_fn against this data",
                    )
                    raise
                bad.update({good[j]: why for j, why in misfits.items()})
                good = [k for k in good if k not in bad]
                batch = self._collate([samples[k] for k in good])
        if self.check is not None and batch is not None:
            batch, good = self._checked(batch, samples, good, bad, indices)
        self._account(bad, indices, len(good))
        return batch

    def _checked(self, batch: Any, samples: list[Any], good: list[int], bad: dict[int, str],
                 indices: list[int | None]) -> tuple[Any, list[int]]:
        """One cheap check of the whole batch; only when it fails, each sample alone, to name the ones at fault."""
        problem = self.check.problem(batch)
        if problem is None:
            return batch, good
        culprits = {k: why for k in good if (why := self._sample_problem(samples[k])) is not None}
        if not culprits:  # the batch fails but no sample alone does: the collate function made it so
            raise BadSampleError(f"the batch of samples {self._names(indices, good)} fails the sample checks "
                                 f"({problem}) though no sample alone does: check collate_fn (or set "
                                 "data.check_samples: off)")
        if self.check_mode == "error":
            k, why = next(iter(culprits.items()))
            raise BadSampleError(f"{self._name(indices, k)}: {why}. Fix or filter it in the dataset, or set "
                                 "data.check_samples: skip to drop and count such samples")
        bad.update(culprits)
        good = [k for k in good if k not in culprits]
        return (self._collate([samples[k] for k in good]) if good else None), good

    def _sample_problem(self, sample: Any) -> str | None:
        try:
            return self.check.problem(self._collate([sample]))
        except Exception:  # a sample that does not collate alone was judged above (find_misfits)
            return None

    def _collate(self, samples: list[Any]) -> Any:
        return (self.collate_fn or default_collate)(samples)

    def _unpack(self, items: list[Any]) -> tuple[list[int | None], list[Any]]:
        if not self.indexed:
            return [None] * len(items), list(items)
        return [i for i, _ in items], [s for _, s in items]

    def _name(self, indices: list[int | None], k: int) -> str:
        index = indices[k]
        return f"sample {index}" if index is not None else f"sample {k} of its batch"

    def _names(self, indices: list[int | None], positions: list[int]) -> str:
        shown = [str(indices[k]) if indices[k] is not None else f"#{k}" for k in positions[:16]]
        return "[" + ", ".join(shown) + (", ...]" if len(positions) > 16 else "]")

    def _account(self, bad: dict[int, str], indices: list[int | None], kept: int) -> None:
        """Count the batch; raise once bad samples exceed the allowed fraction, else log the first few."""
        self.counts.add(kept, len(bad))
        if not bad:
            return
        totals = self.counts.as_dict()
        good_total, bad_total = totals["samples"], totals["bad"]
        what = "; ".join(f"{self._name(indices, k)}: {why}" for k, why in list(bad.items())[:3])
        read = good_total + bad_total
        if kept == 0:
            raise BadSampleError(f"every sample of a batch is bad ({what}): check the dataset and collate_fn")
        if self.counts.too_many(self.max_bad_fraction):
            raise TooManyBadSamplesError(
                f"{what}. {bad_total} of {read} samples read so far were bad, above data.max_bad_sample_fraction "
                f"{self.max_bad_fraction:g} (over at least {MIN_WINDOW} samples). Fix or filter that sample in the "
                "dataset, or raise data.max_bad_sample_fraction to skip more"
            )
        if self.logged < LOGGED_PER_PROCESS:
            self.logged += 1
            more = " (further ones counted, not logged)" if self.logged == LOGGED_PER_PROCESS else ""
            log.warning("skipped bad %s (%d bad of %d read)%s", what, bad_total, read, more)


def find_misfits(samples: list[Any], collate: Callable[[list[Any]], Any]) -> dict[int, str]:
    """Positions of the few samples that keep `samples` from collating, with why; {} if it is not a few samples'
    fault (then the collate error is the batch's, not a sample's)."""
    if len(samples) < 2:
        return {}
    for search in (_failing_alone, _odd_keys, _odd_shapes):
        misfits = search(samples, collate)
        if misfits and len(misfits) < len(samples) / 2 and _collates(collate, _without(samples, misfits)):
            return misfits
    return {}


def _failing_alone(samples: list[Any], collate: Callable[[list[Any]], Any]) -> dict[int, str]:
    errors = {j: _error(collate, [s]) for j, s in enumerate(samples)}
    return {j: f"collate fails on it alone: {e}" for j, e in errors.items() if e is not None}


def _odd_keys(samples: list[Any], collate: Callable[[list[Any]], Any]) -> dict[int, str]:
    if not all(isinstance(s, Mapping) for s in samples):
        return {}
    keys = [frozenset(map(str, s)) for s in samples]
    common, _ = Counter(keys).most_common(1)[0]
    misfits = {}
    for j, own in enumerate(keys):
        if own != common:
            missing, extra = sorted(common - own), sorted(own - common)
            parts = [f"missing {missing}"] * bool(missing) + [f"unexpected {extra}"] * bool(extra)
            misfits[j] = f"wrong keys ({'; '.join(parts)}; the other samples have {sorted(common)})"
    return misfits


def _odd_shapes(samples: list[Any], collate: Callable[[list[Any]], Any]) -> dict[int, str]:
    signatures = [_signature(s) for s in samples]
    common, _ = Counter(signatures).most_common(1)[0]
    reference = samples[signatures.index(common)]
    misfits = {j: _shape_difference(s, reference) for j, s in enumerate(samples) if signatures[j] != common}
    if misfits and _collates(collate, _without(samples, misfits)):
        return misfits
    if len(samples) > MAX_SEARCH:
        return {}
    accepted: list[Any] = []  # greedy, most common shapes first: a sample that breaks the accepted ones is odd
    misfits = {}
    for j in sorted(range(len(samples)), key=lambda j: signatures[j] != common):
        error = _error(collate, [*accepted, samples[j]])
        if error is None:
            accepted.append(samples[j])
        else:
            misfits[j] = _shape_difference(samples[j], reference) if accepted else error
    return misfits


def _signature(sample: Any) -> tuple[Any, ...]:
    """Keys (or positions) and tensor shapes of a sample: samples that collate together usually share it."""
    if isinstance(sample, Mapping):
        return tuple(sorted((str(k), _shape(v)) for k, v in sample.items()))
    if isinstance(sample, (list, tuple)):
        return tuple((str(i), _shape(v)) for i, v in enumerate(sample))
    return (("", _shape(sample)),)


def _shape(value: Any) -> Any:
    return tuple(value.shape) if hasattr(value, "shape") else type(value).__name__


def _shape_difference(sample: Any, reference: Any) -> str:
    own, other = dict(_signature(sample)), dict(_signature(reference))
    diffs = [
        f"'{k}' has shape {own[k]} where the others have {other[k]}" for k in own if k in other and own[k] != other[k]
    ]
    return "wrong shape: " + "; ".join(diffs) if diffs else "it does not collate with the other samples"


def _without(samples: list[Any], positions: dict[int, str]) -> list[Any]:
    return [s for j, s in enumerate(samples) if j not in positions]


def _collates(collate: Callable[[list[Any]], Any], samples: list[Any]) -> bool:
    return bool(samples) and _error(collate, samples) is None


def _error(collate: Callable[[list[Any]], Any], samples: list[Any]) -> str | None:
    try:
        collate(samples)
    except Exception as exc:
        return _one_line(exc)
    return None


def _one_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"[:300]


def _note(exc: BaseException, text: str) -> None:
    if hasattr(exc, "add_note"):  # Python >= 3.11
        exc.add_note(text)
