"""Content keys of images: a hash of the preprocessed pixels, computed where it costs the step nothing.

A key is the first 16 bytes of SHA-256 over a tag, each tensor's dtype and shape, and its bytes (SHA-256 runs on
the CPU's SHA extensions and releases the GIL). Two images get the same key only if their preprocessed pixels (and
masks, grids) are bit-identical, so a cached feature is never served for other pixels; a random augmentation
cannot make the cache wrong, only useless (every epoch brings new pixels), which :func:`check_deterministic` finds
before training.

:class:`KeyedCollate` computes the keys of a collated batch in the DataLoader workers, off the training thread, and
adds them to the batch under ``vision_cache_keys``: a list with one tuple of keys per row, in the order the model
hands the images to its tower (so micro-batch splitting slices them with the rows), or a :class:`FlatKeys` when the
images cannot be assigned to rows (Qwen2-VL's flat patch tensor). The cache's forward pre-hook takes them out of the
model's keyword arguments before the model sees them.

Usage::

    loader = DataLoader(dataset, batch_size=16, collate_fn=KeyedCollate(collate), num_workers=4)
    reason = check_deterministic(dataset, collate)        # None, or why the images change between reads
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import default_collate

__all__ = ["KEYS_FIELD", "FlatKeys", "KeyedCollate", "batch_image_keys", "check_deterministic", "hash_bytes",
           "image_key", "tensor_key"]

KEYS_FIELD = "vision_cache_keys"
BATCH_TAG = b"batch"  # keys computed on the collated batch (KeyedCollate); the unit's own hashing uses b"unit"


@dataclass(frozen=True)
class FlatKeys:
    """Keys of a batch's images in the order of its image tensor, when images cannot be assigned to rows.

    Not a list, so micro-batch splitting passes it whole (such batches run as one micro-batch).
    """

    keys: tuple[str, ...]


def hash_bytes(*parts: bytes | str | int | float | None) -> bytes:
    """16-byte SHA-256 of a sequence of small values (length-prefixed, so ('ab', 'c') != ('a', 'bc'))."""
    h = hashlib.sha256()
    for part in parts:
        data = part if isinstance(part, bytes) else repr(part).encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.digest()[:16]


def tensor_key(*tensors: Tensor | None, tag: bytes = BATCH_TAG) -> bytes:
    """16-byte key of the exact contents (dtype, shape, bytes) of one image's tensors; CUDA tensors are copied."""
    h = hashlib.sha256(tag)
    for tensor in tensors:
        if tensor is None:
            h.update(b"\0none")
            continue
        t = tensor.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        t = t.contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        flat = t.reshape(-1)
        h.update(flat.view(torch.uint8).numpy() if flat.numel() else b"")
    return h.digest()[:16]


def image_key(image: Tensor) -> bytes:
    """The key of one preprocessed image as :class:`KeyedCollate` computes it (usage: ``image_key(pixels[0])``)."""
    return tensor_key(image)


def batch_image_keys(batch: Mapping[str, Any],
                     image_field: str = "pixel_values") -> list[tuple[str, ...]] | FlatKeys | None:
    """Hex keys of a collated batch's images, per row in tower order (or flat), for the layouts vlmfast knows:

    - ``[B, C, H, W]``: one image per row (the tiny VLM, LLaVA);
    - ``[R, K, C, H, W]`` with ``images_per_row``: packed rows (the first ``images_per_row[r]`` slots are images);
    - ``[B, K, C, H, W]`` (+ ``pixel_attention_mask``): Idefics3 / SmolVLM, padding images included (the tower
      drops them, and so does the cache);
    - ``[patches, D]`` with ``image_grid_thw``: Qwen2-VL, flat;
    - a list of per-row image tensors (raw images for on-device preprocessing).

    Returns None for anything else (the cache then hashes the tower's inputs itself).
    """
    pixels = batch.get(image_field)
    if isinstance(pixels, (list, tuple)) and all(isinstance(p, Tensor) for p in pixels):
        return [(tensor_key(p).hex(),) for p in pixels]
    if not isinstance(pixels, Tensor):
        return None
    grid = batch.get("image_grid_thw")
    if isinstance(grid, Tensor) and pixels.dim() == 2:
        counts = grid.prod(-1).tolist()
        if sum(counts) != pixels.shape[0]:
            return None
        chunks = pixels.split(counts)
        return FlatKeys(tuple(tensor_key(c, g).hex() for c, g in zip(chunks, grid, strict=True)))
    if pixels.dim() == 4:
        return [(tensor_key(p).hex(),) for p in pixels]
    if pixels.dim() == 5:
        per_row = batch.get("images_per_row")
        if isinstance(per_row, Tensor):
            return [tuple(tensor_key(p).hex() for p in row[: int(n)]) for row, n in zip(pixels, per_row, strict=True)]
        mask = batch.get("pixel_attention_mask")
        masks = mask if isinstance(mask, Tensor) and mask.shape[:2] == pixels.shape[:2] else None
        return [tuple(tensor_key(p, None if masks is None else masks[r, j]).hex() for j, p in enumerate(row))
                for r, row in enumerate(pixels)]
    return None


@dataclass
class KeyedCollate:
    """A collate function that adds the batch's image keys (``vision_cache_keys``), computed where it runs: in the
    DataLoader workers. A plain dataclass, so it pickles into worker processes. Use it with the cache on: the cache's
    forward pre-hook takes the keys out of the model's arguments; a model without the cache would receive them.

    Usage: ``DataLoader(dataset, batch_size=8, collate_fn=KeyedCollate(my_collate), num_workers=2)``
    """

    collate_fn: Callable[[list[Any]], Any] | None = None
    image_field: str = "pixel_values"

    def __call__(self, samples: list[Any]) -> Any:
        batch = (self.collate_fn or default_collate)(samples)
        if isinstance(batch, dict) and KEYS_FIELD not in batch:
            keys = batch_image_keys(batch, self.image_field)
            if keys is not None:
                batch[KEYS_FIELD] = keys
        return batch


def check_deterministic(dataset: Any, collate_fn: Callable[[list[Any]], Any] | None = None,
                        image_field: str = "pixel_values", indices: Sequence[int] = (0, 1, 2)) -> str | None:
    """Read a few samples twice and compare their preprocessed images; the reason they differ, or None.

    Same sample, different pixels means a random transform (flip, crop, colour jitter) in the dataset or the
    collate function: cached features would never be reused. Every RNG is restored afterwards, so the run's data
    order and augmentations are those it would have had without the check.

    Usage: ``reason = check_deterministic(dataset, collate)`` -> ``None`` or ``"sample 0 gave different ..."``
    """
    from vlmfast.common.utils import rng_state, set_rng_state

    collate = collate_fn or default_collate
    state = rng_state()
    try:
        size = len(dataset)
        for index in [i for i in indices if i < size]:
            first, second = (batch_image_keys(collate([dataset[index]]), image_field) for _ in range(2))
            if first is None:
                return None  # no image tensor found: nothing to compare (the cache hashes the tower's inputs)
            if first != second:
                return (f"sample {index} gave different pixels on two reads: a random transform (flip, crop, "
                        "colour jitter) in the dataset or collate_fn, so the cache would never be reused; make the "
                        "augmentation a fixed function of the sample, or set vision_cache.enabled: false")
    finally:
        set_rng_state(state)
    return None
