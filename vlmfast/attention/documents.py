"""Document boundaries of packed rows: which tokens may attend to which.

A packed row holds several documents back to back; attention must never cross from one to another. The boundaries
come from per-document ``position_ids`` (a new document starts wherever the position does not go up by one, the
rule Hugging Face uses) or from flash-attn style ``cu_seqlens`` over a flattened row. They are turned into whatever
a backend needs, once per forward pass, and shared by every layer: a dense boolean mask (SDPA, eager), a
``BlockMask`` (flex) or ``cu_seqlens`` (varlen kernels).

Qwen-VL style 3-D (mRoPE) position ids, ``[3, B, T]``, are not packing information: their height/width channels
restart inside an image, so they never mark documents. ``[4, B, T]`` follows Hugging Face's convention that
channel 0 holds the text positions, which do.

Usage::

    docs = PackedDocuments.from_position_ids(position_ids)       # once per forward
    mask = docs.dense_mask(causal=True)                          # [B, 1, T, T] bool, True = may attend
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["PackedDocuments", "is_mrope_position_ids", "text_position_ids"]


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
        if cu_seqlens.dim() != 1 or int(cu_seqlens[-1]) != seq_len:
            raise ValueError(f"cu_seqlens must be 1-D and end at the sequence length {seq_len}, got {cu_seqlens}")
        tokens = torch.arange(seq_len, device=cu_seqlens.device)
        ids = torch.bucketize(tokens, cu_seqlens[1:].to(tokens.dtype), right=True)
        return cls(ids.unsqueeze(0))

    @property
    def seq_len(self) -> int:
        return self.ids.shape[-1]

    def to(self, device: torch.device) -> PackedDocuments:
        return self if self.ids.device == device else PackedDocuments(self.ids.to(device))

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
        from torch.nn.attention.flex_attention import create_block_mask

        key = ("block", causal)
        if key not in self._cache:
            ids = self.ids

            def same_document(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
                allowed = ids[b, q] == ids[b, kv]
                return allowed & (q >= kv) if causal else allowed

            b, t = ids.shape
            self._cache[key] = create_block_mask(same_document, b, None, t, t, device=ids.device)
        return self._cache[key]

    def cu_seqlens(self) -> tuple[Tensor, int]:
        """``(cu_seqlens int32 [N + 1], max_seqlen)`` over the flattened ``B * T`` tokens, for varlen kernels."""
        if "cu" not in self._cache:
            flat = self.ids.reshape(-1)
            starts = torch.ones_like(flat, dtype=torch.bool)
            starts[1:] = flat[1:] != flat[:-1]
            starts[:: self.seq_len] = True  # every row starts a document
            begins = starts.nonzero().flatten()
            total = torch.tensor([flat.numel()], device=flat.device)
            cu = torch.cat([begins, total]).to(torch.int32)
            self._cache["cu"] = (cu, int((cu[1:] - cu[:-1]).max()))
        return self._cache["cu"]

    def spans(self) -> list[tuple[int, int]]:
        """``(start, end)`` of every document over the flattened ``B * T`` tokens, as host integers."""
        if "spans" not in self._cache:
            bounds = self.cu_seqlens()[0].tolist()
            self._cache["spans"] = list(itertools.pairwise(bounds))
        return self._cache["spans"]
