"""A fingerprint of the training data, saved in every checkpoint and compared on resume.

The saved data position (epoch, batch in epoch) only means something on the same data in the same order: on other
data the run would train on without a word, on another order than the uninterrupted run. The fingerprint holds:

- ``length``: the number of samples (map-style datasets; a stream's ``len()`` when it has one);
- ``lengths_sha``: a hash of the per-sample lengths, when the dataset exposes them cheaply (``lengths`` or
  ``modality_lengths``, as for ``data.group_by_length``);
- ``samples_sha``: a hash of a few samples at fixed indices (first, thirds, last), read twice with the random
  generators seeded (and restored after), so augmentation does not make it differ; a dataset whose samples still
  differ between two reads gets ``samples_unstable`` instead and its content is not compared. Tensors, arrays, PIL
  images, strings, bytes and numbers are hashed by value; anything else (a file handle, an arbitrary object) is
  skipped, and its type named in ``samples_skipped``;
- the sampler's settings: kind (dataset, stream, DataLoader), batch size, shuffle, seed, drop_last, world size,
  length grouping (a user DataLoader: its batch size, drop_last and sampler type).

Usage::

    saved = data_fingerprint(dataset, sampler={"batch_size": 8, "shuffle": True, ...})
    changes = fingerprint_changes(saved, data_fingerprint(new_dataset, sampler=...))   # {} when the same
    text = describe_changes(changes)                                                     # "length 256 -> 40, ..."
"""

from __future__ import annotations

import hashlib
import logging
import random
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

log = logging.getLogger(__name__)

__all__ = ["data_fingerprint", "describe_changes", "fingerprint_changes", "map_position", "sample_indices"]

SAMPLES_HASHED = 4


def sample_indices(length: int, count: int = SAMPLES_HASHED) -> list[int]:
    """The indices hashed for a dataset of `length` samples: the first, the last, and evenly between."""
    if length <= 0:
        return []
    return sorted({(length - 1) * k // max(count - 1, 1) for k in range(count)})


def data_fingerprint(data: Dataset | DataLoader, sampler: dict[str, Any],
                     read: Callable[[Callable[[], Any], int], Any] | None = None) -> dict[str, Any]:
    """The fingerprint of `data` (see the module docstring). `sampler`: the loader's settings, stored as given.
    `read(fn, index)` runs a sample read (the loader passes one that enforces data.timeout_s); default: directly."""
    fingerprint: dict[str, Any] = {"version": 1, **sampler}
    dataset: Any = data
    if isinstance(data, DataLoader):
        fingerprint.update(kind="dataloader", loader_batch_size=data.batch_size,
                           loader_drop_last=data.drop_last, loader_sampler=type(data.sampler).__name__)
        dataset = data.dataset
    else:
        fingerprint["kind"] = "stream" if isinstance(data, IterableDataset) else "dataset"
    fingerprint["dataset_type"] = type(dataset).__name__
    length = _length(dataset)
    if length is not None:
        fingerprint["length"] = length
    if isinstance(dataset, IterableDataset) or length is None:
        return fingerprint  # a stream is not read ahead: that would consume it
    lengths = _cheap_lengths(dataset)
    if lengths is not None:
        fingerprint["lengths_sha"] = _sha(_Hasher().update(lengths).digest())
    fingerprint.update(_content(dataset, length, read or (lambda fn, index: fn())))
    return fingerprint


def _length(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None


def _cheap_lengths(dataset: Any) -> Any:
    for name in ("lengths", "modality_lengths"):
        value = getattr(type(dataset), name, None)
        if isinstance(value, property):  # a property may compute (read every sample): not "cheap" to know
            continue
        value = getattr(dataset, name, None)
        if value is None or callable(value):
            continue
        if isinstance(value, torch.Tensor):
            return value.tolist()
        try:
            return [int(v) for v in value]
        except (TypeError, ValueError):
            return None
    return None


def _content(dataset: Any, length: int, read: Callable[[Callable[[], Any], int], Any]) -> dict[str, Any]:
    indices = sample_indices(length)
    digests, skipped = [], set()
    for _ in range(2):
        hasher = _Hasher()
        for index in indices:
            sample = read(lambda i=index: _seeded_read(dataset, i), index)
            if isinstance(sample, BaseException):  # an unreadable sample: the bad-sample handling names it later
                hasher.update(f"unreadable {type(sample).__name__}")
            else:
                hasher.update(sample)
        digests.append(hasher.digest())
        skipped |= hasher.skipped
    out: dict[str, Any] = {"samples_hashed": indices}
    if digests[0] != digests[1]:
        log.info("data fingerprint: samples %s differ between two reads with seeded generators (random "
                 "augmentation that does not use torch, numpy or random?): their content is not compared", indices)
        out["samples_unstable"] = True
        return out
    out["samples_sha"] = _sha(digests[0])
    if skipped:
        out["samples_skipped"] = sorted(skipped)
        log.info("data fingerprint: values of type %s in the samples cannot be hashed stably and are left out",
                 ", ".join(sorted(skipped)))
    return out


def _seeded_read(dataset: Any, index: int) -> Any:
    """`dataset[index]` with torch, numpy and random seeded, then restored (training's random stream is untouched)."""
    py_state = random.getstate()
    np_random, np_state = _numpy_random()
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(index)
            random.seed(index)
            if np_random is not None:
                np_random.seed(index)
            try:
                return dataset[index]
            except Exception as exc:  # counted as unreadable, not raised here
                return exc
    finally:
        random.setstate(py_state)
        if np_random is not None:
            np_random.set_state(np_state)


def _numpy_random() -> tuple[Any, Any]:
    try:
        import numpy
    except ImportError:
        return None, None
    return numpy.random, numpy.random.get_state()


class _Hasher:
    """A stable hash of nested samples: type tags, shapes and dtypes, and the bytes of each value."""

    def __init__(self) -> None:
        self._hash = hashlib.sha256()
        self.skipped: set[str] = set()

    def digest(self) -> bytes:
        return self._hash.digest()

    def _tag(self, text: str) -> None:
        self._hash.update(text.encode() + b"\0")

    def update(self, value: Any) -> _Hasher:
        if isinstance(value, dict):
            self._tag(f"dict{len(value)}")
            for key in sorted(value, key=str):
                self._tag(str(key))
                self.update(value[key])
        elif isinstance(value, (list, tuple)):
            self._tag(f"seq{len(value)}")
            for item in value:
                self.update(item)
        elif isinstance(value, torch.Tensor):
            self._tag(f"tensor{tuple(value.shape)}{value.dtype}")
            try:
                tensor = value.detach().to("cpu").contiguous()
                self._hash.update(tensor.reshape(-1).view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
            except (RuntimeError, TypeError):  # sparse, quantized, nested: no plain bytes
                self.skipped.add(f"{value.layout} tensor")
        elif isinstance(value, (bytes, bytearray, memoryview)):
            self._tag("bytes")
            self._hash.update(bytes(value))
        elif isinstance(value, str):
            self._tag("str")
            self._hash.update(value.encode("utf-8", "surrogatepass"))
        elif value is None or isinstance(value, (bool, int, float, complex)):
            self._tag(f"{type(value).__name__}:{value!r}")
        elif _is_array(value):
            self._tag(f"array{tuple(value.shape)}{value.dtype}")
            self._hash.update(value.tobytes() if value.dtype != object else repr(value.tolist()).encode())
        elif _is_image(value):  # PIL: mode and size, then the decoded pixels
            self._tag(f"image{value.mode}{tuple(value.size)}")
            self._hash.update(value.tobytes())
        elif isinstance(value, Mapping):
            self.update(dict(value))  # a mapping (Hugging Face BatchFeature / BatchEncoding)
        else:  # no stable bytes (an object's repr may hold its address): left out, named
            self.skipped.add(type(value).__name__)
            self._tag("skipped")
        return self


def _is_array(value: Any) -> bool:
    return type(value).__module__ == "numpy" and hasattr(value, "tobytes") and hasattr(value, "dtype")


def _is_image(value: Any) -> bool:
    return hasattr(value, "mode") and hasattr(value, "size") and hasattr(value, "tobytes") and \
        type(value).__module__.startswith("PIL")


def _sha(digest: bytes) -> str:
    return digest.hex()[:16]


# The keys compared, in the order they are named, with how each reads in a message. `dataset_type` is kept for the
# reader but not compared: a renamed class or a wrapper around the same samples is no change of data.
_COMPARED = {
    "kind": "data kind", "length": "length", "lengths_sha": "per-sample lengths",
    "samples_sha": "sample content", "shuffle": "data.shuffle", "seed": "seed",
    "drop_last": "data.drop_last", "group_by_length": "data.group_by_length",
    "loader_batch_size": "DataLoader batch_size", "loader_drop_last": "DataLoader drop_last",
    "loader_sampler": "DataLoader sampler",
}


def fingerprint_changes(saved: dict[str, Any], current: dict[str, Any]) -> dict[str, tuple[Any, Any]]:
    """What differs between two fingerprints: {label: (old, new)}. A value one side lacks is not compared (an older
    fingerprint, or content that could not be hashed stably on one side)."""
    changes = {}
    for key, label in _COMPARED.items():
        if key in saved and key in current and saved[key] != current[key]:
            changes[label] = (saved[key], current[key])
    # The global batch is what the data position counts: 2 ranks x 4 continue on 1 rank x 8 (or 4 x 2) exactly.
    old_global, new_global = _global_batch(saved), _global_batch(current)
    if old_global is not None and new_global is not None and old_global != new_global:
        changes["global batch (ranks x batch_size)"] = (old_global, new_global)
    if "sample content" in changes:
        content = changes.pop("sample content")
        if saved.get("samples_hashed") == current.get("samples_hashed"):  # else: the length change says it already
            changes[f"content of samples {current.get('samples_hashed')} (hash)"] = content
    return changes


def _global_batch(fingerprint: dict[str, Any]) -> int | None:
    if "batch_size" not in fingerprint:
        return None
    return int(fingerprint["batch_size"]) * int(fingerprint.get("world_size", 1))


def describe_changes(changes: dict[str, tuple[Any, Any]]) -> str:
    return ", ".join(f"{label} {old!r} -> {new!r}" for label, (old, new) in changes.items())


def map_position(position: dict[str, int], old_batches: int | None, new_batches: int | None) -> dict[str, int]:
    """The data position on changed data: the same share of the same epoch (batch b of B becomes b * B' // B); with
    one count unknown, batch b clamped to the new epoch (a stream's count is unknown: it keeps its position)."""
    batch = position["batch_in_epoch"]
    if new_batches is None:
        return dict(position)
    if old_batches:
        batch = batch * new_batches // old_batches
    return {**position, "batch_in_epoch": max(min(batch, new_batches), 0)}  # == new_batches: the epoch is done
