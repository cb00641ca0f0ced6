"""Batches as nested dicts / lists / tuples of tensors: size, split into micro-batches, move to a device.

Usage::

    for micro in split_batch(batch, micro_batch_size=4):
        micro = move_to_device(micro, device)
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from accelerate.utils import send_to_device


def batch_size_of(batch: Any) -> int:
    """The number of samples: dim 0 of the first tensor found in the batch."""
    tensor = _first_tensor(batch)
    if tensor is None:
        if isinstance(batch, (list, tuple)):
            return len(batch)
        raise TypeError(f"cannot find the batch size of a {type(batch).__name__}: it holds no tensor")
    return tensor.shape[0]


def split_batch(batch: Any, micro_batch_size: int) -> list[Any]:
    """Slice every per-sample tensor (and per-sample list) of a batch into micro-batches along dim 0.

    Entries whose leading size is not the batch size (e.g. a scalar or a shared lookup table) are passed to every
    micro-batch unchanged. Slices are views: no copy.
    """
    size = batch_size_of(batch)
    if micro_batch_size >= size:
        return [batch]
    return [_slice(batch, start, start + micro_batch_size, size) for start in range(0, size, micro_batch_size)]


def _slice(obj: Any, start: int, stop: int, size: int) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj[start:stop] if obj.dim() > 0 and obj.shape[0] == size else obj
    if isinstance(obj, Mapping):
        return type(obj)({k: _slice(v, start, stop, size) for k, v in obj.items()})
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):  # namedtuple
        return type(obj)(*(_slice(v, start, stop, size) for v in obj))
    if isinstance(obj, (list, tuple)):
        if len(obj) == size and not any(isinstance(v, torch.Tensor) for v in obj):
            return obj[start:stop]  # per-sample list, e.g. captions
        return type(obj)(_slice(v, start, stop, size) for v in obj)
    return obj


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Copy every tensor of a nested batch to `device` (non-blocking, so pinned batches overlap compute)."""
    return send_to_device(batch, device, non_blocking=non_blocking)


def _first_tensor(obj: Any) -> torch.Tensor | None:
    if isinstance(obj, torch.Tensor):
        return obj if obj.dim() > 0 else None
    values = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (list, tuple)) else ()
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None


def count_input_tokens(batch: Any) -> int:
    """Real input tokens of a host batch: the attention mask's sum, else input_ids' size, else 0."""
    if not isinstance(batch, Mapping):
        return 0
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return int(mask.sum())
    ids = batch.get("input_ids")
    return ids.numel() if isinstance(ids, torch.Tensor) else 0
