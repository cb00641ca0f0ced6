"""Batches as nested dicts / lists / tuples of tensors: size, split into micro-batches, move to a device.

A batch is either collated (a dict / tuple of tensors) or a :class:`~vlmfast.data.micro_batches.SampleBatch` from
vlmfast's loader (samples plus their collated micro-batches); every function here takes both.

Usage::

    for micro in split_batch(batch, micro_batch_size=4, model=model):   # key-aware: images stay with their sample
        micro = move_to_device(micro, device)
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from accelerate.utils import send_to_device
from torch import nn

from vlmfast.data.batch_layout import BatchLayout, num_samples
from vlmfast.data.micro_batches import SampleBatch, split_micro_batches


def batch_size_of(batch: Any) -> int:
    """The number of samples: a SampleBatch's, else dim 0 of the text keys (input_ids...) or of the first tensor."""
    if isinstance(batch, SampleBatch):
        return len(batch)
    try:
        return num_samples(batch)
    except TypeError:
        raise TypeError(f"cannot find the batch size of a {type(batch).__name__}: it holds no tensor") from None


def split_batch(batch: Any, micro_batch_size: int, model: nn.Module | None = None,
                layout: BatchLayout | None = None) -> list[Any]:
    """Micro-batches of ``micro_batch_size`` samples (the last may be smaller): :func:`split_micro_batches`.

    Collated batches are split by key-aware rules (images stay with their sample; a key whose layout is unknown
    is refused, naming it). ``model`` (or ``layout``) gives the image / video token ids those rules count.
    Slices are views: no copy. Usage: ``split_batch(batch, 4, model=model)``
    """
    if layout is None and model is not None:
        layout = BatchLayout.from_model(model)
    return split_micro_batches(batch, micro_batch_size, layout)


def move_to_device(batch: Any, device: torch.device, non_blocking: bool = True) -> Any:
    """Copy every tensor of a nested batch to `device` (non-blocking, so pinned batches overlap compute)."""
    return send_to_device(batch, device, non_blocking=non_blocking)


def host_micro_batches(batch: Any, micro_batch_size: int | Any, layout: BatchLayout | None = None,
                       host: Any = None, keys: Sequence[str] | None = None) -> list[Any] | None:
    """:func:`split_batch`'s micro-batches of ``batch`` as host copies, in the same order, or None when ``batch`` is
    itself on the host (or its host copy was not kept). Counting tokens on them reads no device value.

    A SampleBatch keeps its host micro-batches when moved (also those collated again after an OOM resize); any
    other batch needs ``host``, the host batch it was copied from (``DevicePrefetcher.host_batch(batch)``), which is
    split by the same rules. A size object (a TokenBudget) gives its last split's micro-batches of ``host``, only
    ``keys`` (rows are gathered: a copy, where slices are views). Usage:
    ``host_micro_batches(batch, 4, host=prefetcher.host_batch(batch))``
    """
    if hasattr(micro_batch_size, "host_micro_batches"):  # a TokenBudget: its last split's, planned on the host
        moved = isinstance(batch, SampleBatch) or (host is not None and host is not batch)
        return micro_batch_size.host_micro_batches(host, keys) if moved else None
    if isinstance(batch, SampleBatch):
        return batch.host_micro_batches_at(micro_batch_size)
    if host is None or host is batch:
        return None
    return split_micro_batches(host, micro_batch_size, layout)


def count_input_tokens(batch: Any) -> int:
    """Real input tokens of a host batch: the attention mask's sum, else input_ids' size, else 0 (a SampleBatch's
    host micro-batches are counted, so a moved one is counted without a device read)."""
    if isinstance(batch, SampleBatch):
        return sum(count_input_tokens(mb) for mb in batch.host_micro_batches)
    if not isinstance(batch, Mapping):
        return 0
    mask = batch.get("attention_mask")
    if isinstance(mask, torch.Tensor):
        return int(mask.sum())
    ids = batch.get("input_ids")
    return ids.numel() if isinstance(ids, torch.Tensor) else 0
