"""Document boundaries of packed rows: which tokens may attend to which.

A packed row holds several documents back to back; attention must never cross from one to another. The boundaries
come from per-document ``position_ids`` (a new document starts wherever the position does not go up by one, the
rule Hugging Face uses), from flash-attn style ``cu_seqlens`` over a flattened row, or from per-row document lengths
known on the host (``document_lengths``, which vlmfast's packing collator adds for models that take them). They are
turned into whatever a backend needs, once per forward pass, and shared by every layer: a dense boolean mask (SDPA,
eager), a ``BlockMask`` (flex) or ``cu_seqlens`` with the longest document (varlen kernels).

Host-device syncs: the document ids, masks and block masks are computed on the device without reading anything back.
Varlen kernels also need the boundaries and the longest length as host values: from ``document_lengths`` they are
free; from ``position_ids`` or ``cu_seqlens`` they cost one read of the boundary flags per forward (``.cpu()`` of B*T
booleans), after which ``cu_seqlens`` goes back with a non-blocking copy from pinned memory.

Qwen-VL style 3-D (mRoPE) position ids, ``[3, B, T]``, are not packing information: their height/width channels
restart inside an image, so they never mark documents. ``[4, B, T]`` follows Hugging Face's convention that
channel 0 holds the text positions, which do.

Usage::

    docs = PackedDocuments.from_position_ids(position_ids)       # once per forward
    docs = PackedDocuments.from_lengths([[3, 5], [8]], seq_len=8, device=device)   # host lengths: no sync at all
    mask = docs.dense_mask(causal=True)                          # [B, 1, T, T] bool, True = may attend
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["PackedDocuments", "host_to_device", "is_mrope_position_ids", "text_position_ids"]


def host_to_device(values: Any, device: torch.device | str, dtype: torch.dtype = torch.long) -> Tensor:
    """Python values as a tensor on `device` without a blocking copy: staged in pinned memory on CUDA, then copied
    with ``non_blocking=True`` (torch.tensor(values, device=cuda) copies from pageable memory and waits)."""
    device = torch.device(device)
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def is_mrope_position_ids(position_ids: Tensor) -> bool:
    """Whether position ids are multimodal-RoPE ones (``[3, B, T]`` or ``[4, B, T]``), not ``[B, T]``."""
    return position_ids.dim() == 3 and position_ids.shape[0] in (3, 4)


def text_position_ids(position_ids: Tensor) -> Tensor | None:
    """The ``[B, T]`` text positions that delimit documents, or None when there are none (plain 3-D mRoPE)."""
    if position_ids.dim() == 2:
        return position_ids
    if position_ids.dim() == 1:
        return position_ids.unsqueeze(0)
    if is_mrope_position_ids(position_ids):
        return position_ids[0] if position_ids.shape[0] == 4 else None
    raise ValueError(f"position_ids of shape {tuple(position_ids.shape)}: expected [B, T], or [3|4, B, T] (mRoPE)")


@dataclass(eq=False)
class PackedDocuments:
    """Per-token document ids ``[B, T]`` (ids only compare within a row) plus lazily built masks.

    Build it once per forward (``from_position_ids`` / ``from_cu_seqlens``) and pass it to every layer: the masks
    are cached on the object, so a 32-layer model builds each one once.
    """

    ids: Tensor
    _cache: dict[Any, Any] = field(default_factory=dict, repr=False)

    @classmethod
    def from_position_ids(cls, position_ids: Tensor) -> PackedDocuments | None:
        """Documents from per-document positions; None for mRoPE ids without text channel (not packing)."""
        positions = text_position_ids(position_ids)
        if positions is None:
            return None
        starts = torch.ones_like(positions, dtype=torch.bool)
        starts[:, 1:] = positions[:, 1:] != positions[:, :-1] + 1
        return cls(starts.long().cumsum(-1))

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: Tensor, seq_len: int) -> PackedDocuments:
        """Documents of one flattened row of ``seq_len`` tokens from cumulative lengths ``[0, l1, l1+l2, ...]``."""
        if cu_seqlens.dim() != 1:
            raise ValueError(f"cu_seqlens must be 1-D, got shape {tuple(cu_seqlens.shape)}")
        # Checked on the device: reading cu_seqlens[-1] here would make the host wait for the GPU.
        torch._assert_async(cu_seqlens[-1] == seq_len, f"cu_seqlens must end at the sequence length {seq_len}")
        tokens = torch.arange(seq_len, device=cu_seqlens.device)
        ids = torch.bucketize(tokens, cu_seqlens[1:].to(tokens.dtype), right=True)
        return cls(ids.unsqueeze(0))

    @classmethod
    def from_lengths(cls, lengths: Any, seq_len: int, device: torch.device | str) -> PackedDocuments:
        """Documents from per-row document lengths known on the host (``[[l1, l2, ...], ...]``, one list per row):
        nothing is read back from the device, and varlen kernels get their boundaries for free. A row's trailing
        padding (``seq_len - sum(row)``) is a document of its own, as with ``position_ids``."""
        rows = []
        for r, row in enumerate(lengths):
            used = sum(int(n) for n in row)
            if used > seq_len or any(int(n) <= 0 for n in row):
                raise ValueError(f"document_lengths row {r} is {list(row)}: lengths must be positive and sum to at "
                                 f"most the row's {seq_len} tokens")
            rows.append([int(n) for n in row] + ([seq_len - used] if used < seq_len else []))
        ids = [doc for row in rows for doc, n in enumerate(row) for _ in range(n)]
        docs = cls(host_to_device(ids, device).view(len(rows), seq_len))
        begins = [r * seq_len + start for r, row in enumerate(rows) for start in _starts(row)]
        docs._cache["host"] = (begins, len(rows) * seq_len)
        return docs

    @property
    def seq_len(self) -> int:
        return self.ids.shape[-1]

    def to(self, device: torch.device) -> PackedDocuments:
        if self.ids.device == device:
            return self
        moved = PackedDocuments(self.ids.to(device, non_blocking=True))
        if "host" in self._cache:
            moved._cache["host"] = self._cache["host"]
        return moved

    def dense_mask(self, causal: bool) -> Tensor:
        """``[B, 1, T, T]`` boolean mask, True where query t may attend to key s (same document, s <= t if causal)."""
        key = ("dense", causal)
        if key not in self._cache:
            mask = self.ids[:, None, :, None] == self.ids[:, None, None, :]
            if causal:
                t = self.seq_len
                mask = mask & torch.ones(t, t, dtype=torch.bool, device=mask.device).tril()
            self._cache[key] = mask
        return self._cache[key]

    def block_mask(self, causal: bool, num_heads: int | None = None) -> Any:
        """A flex-attention ``BlockMask`` for the same rule (blocks that cross documents are skipped entirely)."""
        key = ("block", causal)
        if key not in self._cache:
            ids = self.ids

            def same_document(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
                allowed = ids[b, q] == ids[b, kv]
                return allowed & (q >= kv) if causal else allowed

            b, t = ids.shape
            self._cache[key] = block_mask_for(same_document, b, t, t, ids.device)
        return self._cache[key]

    def _host_boundaries(self) -> tuple[list[int], int]:
        """(start of every document over the flattened B*T tokens, B*T) on the host: one read of B*T flags."""
        if "host" not in self._cache:
            flat = self.ids.reshape(-1)
            starts = torch.ones_like(flat, dtype=torch.bool)
            starts[1:] = flat[1:] != flat[:-1]
            starts[:: self.seq_len] = True  # every row starts a document
            begins = starts.cpu().nonzero().flatten().tolist()  # the one device read, then host work only
            self._cache["host"] = (begins, flat.numel())
        return self._cache["host"]

    def cu_seqlens(self) -> tuple[Tensor, int]:
        """``(cu_seqlens int32 [N + 1], max_seqlen)`` over the flattened ``B * T`` tokens, for varlen kernels."""
        if "cu" not in self._cache:
            begins, total = self._host_boundaries()
            bounds = [*begins, total]
            longest = max(b - a for a, b in itertools.pairwise(bounds))
            self._cache["cu"] = (host_to_device(bounds, self.ids.device, torch.int32), longest)
        return self._cache["cu"]

    def spans(self) -> list[tuple[int, int]]:
        """``(start, end)`` of every document over the flattened ``B * T`` tokens, as host integers."""
        begins, total = self._host_boundaries()
        return list(itertools.pairwise([*begins, total]))


def _starts(row: list[int]) -> list[int]:
    return list(itertools.accumulate(row[:-1], initial=0))


@functools.cache
def _compiled_create_block_mask() -> Callable[..., Any]:
    """``torch.compile(create_block_mask)``: what torch 2.13 recommends over its deprecated ``_compile=True`` (the
    uncompiled version materialises the [B, H, Q, KV] mask to find the blocks, per forward)."""
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask, dynamic=None)


def block_mask_for(mask_mod: Callable[..., Tensor], b: int | None, q_len: int, k_len: int,
                   device: torch.device | str) -> Any:
    """A flex ``BlockMask``: built by the compiled ``create_block_mask`` on CUDA, eagerly elsewhere."""
    from torch.nn.attention.flex_attention import create_block_mask

    build = _compiled_create_block_mask() if torch.device(device).type == "cuda" else create_block_mask
    return build(mask_mod, b, None, q_len, k_len, device=device)
