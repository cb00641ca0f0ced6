"""Packed rows of a padded batch, on the device: where every real token goes, and back.

:class:`RowLayout` is the plan for one padded batch ``[B, T]`` (each row's real tokens one run: right or left
padding): its documents placed into rows of at most ``max_tokens`` by :func:`vlmfast.data.packing.plan_rows`, as
index tensors, so that packing a per-token tensor is one ``index_select`` and unpacking another (both differentiable:
the gradient of a packed activation flows back to the padded one it came from, and padding gets none).

Besides per-token tensors it lays out what a language model receives with them: per-document positions (restarting
at 0, so attention keeps the documents apart; multi-axis mRoPE positions keep each token's own in channels 1-3 and
put the restarting text positions in channel 0, Hugging Face's ``[4, B, T]`` convention), 4-D attention masks (each
document keeps its own mask, nothing crosses documents), and values that follow a boolean per-token mask in its
order (Qwen3-VL's ``deepstack_visual_embeds`` under ``visual_pos_masks``).

Usage::

    layout = RowLayout.plan(attention_mask, max_tokens=512)        # one host read: the lengths
    packed = layout.pack(inputs_embeds)                            # [R, W, H]
    hidden = layout.unpack(language_model(packed, position_ids=layout.positions)[0])   # [B, T, H] again
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from vlmfast.data.packing import Algorithm, plan_rows

__all__ = ["RowLayout"]


@dataclass
class RowLayout:
    """Rows ``[rows, width]`` holding the real tokens of a padded batch ``[batch, length]``."""

    batch: int
    length: int
    rows: int
    width: int
    source: Tensor  # [rows * width]: flat index into [batch * length] of each slot's token (padding slots: 0)
    real: Tensor  # [rows * width] bool: the slot holds a real token
    target: Tensor  # [batch * length]: flat slot of each token; padding tokens -> rows * width (a zero row)
    document: Tensor  # [rows, width]: which document each slot holds; every padding slot a document of its own
    positions: Tensor  # [rows, width]: each document's positions from 0; the padding tail restarts as in packing
    document_lengths: list[list[int]]  # tokens of each document, per row (host values)

    @classmethod
    def plan(cls, attention_mask: Tensor | None, max_tokens: int, *, shape: tuple[int, int] | None = None,
             algorithm: Algorithm = "best_fit_decreasing", halves: bool = False) -> RowLayout:
        """The layout of a batch with this 2-D ``attention_mask`` (None: ``shape`` [B, T], no padding). Reads the
        lengths to the host once (the plan is host work); raises ``ValueError`` for a mask with holes. A document
        longer than ``max_tokens`` gets a row of its own; ``halves``: rows of half the batch's tokens instead."""
        if attention_mask is None:
            if shape is None:
                raise ValueError("RowLayout.plan needs an attention_mask or the batch shape")
            b, t = shape
            lengths, starts = [t] * b, [0] * b
            device = torch.device("cpu")
        else:
            b, t = attention_mask.shape
            mask = attention_mask.ne(0)
            lengths_d = mask.sum(-1)
            starts_d = mask.int().argmax(-1) * lengths_d.ne(0)
            runs = mask[:, 0].long() + (mask[:, 1:] & ~mask[:, :-1]).sum(-1)  # 0 -> 1 steps: one run per row
            lengths, starts, run_counts = torch.stack([lengths_d, starts_d, runs]).tolist()
            if max(run_counts, default=0) > 1:
                raise ValueError("packing needs each sample's real tokens in one run (attention_mask 0...0 1...1 "
                                 "0...0: right or left padding); a mask with holes cannot be packed")
            device = attention_mask.device
        if halves:
            max_tokens = -(-sum(lengths) // 2)
        return cls._build(lengths, starts, b, t, max_tokens, algorithm, device)

    @classmethod
    def _build(cls, lengths: Sequence[int], starts: Sequence[int], b: int, t: int, max_tokens: int,
               algorithm: Algorithm, device: torch.device) -> RowLayout:
        documents = [i for i in range(b) if lengths[i] > 0]  # an all-padding row has no document
        budget = max([max_tokens, *(lengths[i] for i in documents)])  # a longer document: a row of its own
        rows = [[documents[j] for j in row] for row in plan_rows([lengths[i] for i in documents], budget,
                                                                 algorithm)] if documents else [[]]
        width = max(max(sum(lengths[i] for i in row) for row in rows), 1)
        longest = max(lengths, default=1) or 1
        source = torch.zeros(len(rows), width, dtype=torch.long)
        real = torch.zeros(len(rows), width, dtype=torch.bool)
        document = torch.zeros(len(rows), width, dtype=torch.long)
        positions = torch.zeros(len(rows), width, dtype=torch.long)
        target = torch.full((b * t,), len(rows) * width, dtype=torch.long)
        for r, row in enumerate(rows):
            at = 0
            for i in row:
                n, first = lengths[i], starts[i]
                tokens = torch.arange(i * t + first, i * t + first + n)
                source[r, at:at + n] = tokens
                real[r, at:at + n] = True
                document[r, at:at + n] = i
                positions[r, at:at + n] = torch.arange(n)
                target[tokens] = torch.arange(r * width + at, r * width + at + n)
                at += n
            tail = width - at
            positions[r, at:] = torch.arange(tail) % longest  # restarting, below any real position
            document[r, at:] = -1 - (r * width + at + torch.arange(tail))  # each padding slot alone
        moved = torch.stack([source, real.long(), document, positions]).to(device, non_blocking=True)
        return cls(b, t, len(rows), width, moved[0].flatten(), moved[1].flatten().bool(), target.to(device),
                   moved[2], moved[3], [[lengths[i] for i in row] for row in rows])

    @property
    def documents(self) -> int:
        """How many documents the rows hold."""
        return sum(len(row) for row in self.document_lengths)

    # ---- per-token tensors ------------------------------------------------------------------------------------

    def pack(self, value: Tensor) -> Tensor:
        """``value`` [B, T, ...] as packed rows [R, W, ...]; padding slots hold zeros (False)."""
        flat = value.reshape(self.batch * self.length, *value.shape[2:]).index_select(0, self.source)
        keep = self.real.view(-1, *([1] * (value.dim() - 2)))
        flat = flat & keep if flat.dtype == torch.bool else flat * keep.to(flat.dtype) if flat.is_floating_point() \
            else flat.masked_fill(~keep, 0)
        return flat.view(self.rows, self.width, *value.shape[2:])

    def unpack(self, value: Tensor) -> Tensor:
        """Packed rows ``value`` [R, W, ...] back to the padded layout [B, T, ...]; padding positions get zeros."""
        flat = value.reshape(self.rows * self.width, *value.shape[2:])
        flat = torch.cat([flat, flat.new_zeros(1, *value.shape[2:])])
        return flat.index_select(0, self.target).view(self.batch, self.length, *value.shape[2:])

    def is_per_token(self, value: object) -> bool:
        """Whether ``value`` is a tensor laid out [B, T, ...] like this batch's tokens."""
        return isinstance(value, Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (self.batch, self.length)

    # ---- what comes with the tokens ---------------------------------------------------------------------------

    def pack_positions(self, position_ids: Tensor | None) -> Tensor:
        """The packed rows' positions: 1-D ones restart per document ([R, W]); multi-axis ones ``[C, B, T]`` keep
        each token's own in channels 1-3 and get the restarting text positions in channel 0 (``[4, R, W]``)."""
        if position_ids is None or position_ids.dim() < 3:
            return self.positions
        own = self.pack(position_ids[-3:].permute(1, 2, 0)).permute(2, 0, 1)  # [3, R, W]
        return torch.cat([self.positions[None].to(own.dtype), own])

    def pack_mask(self, mask: Tensor) -> Tensor:
        """A 4-D attention mask [B, heads, T, T] (boolean: True attends; float: added to the scores) as
        [R, heads, W, W]: each document keeps its own entries, nothing crosses documents, a padding slot sees
        itself only (no row without any key)."""
        b_index = (self.source // self.length).view(self.rows, self.width)
        t_index = (self.source % self.length).view(self.rows, self.width)
        own = mask[b_index[:, :, None], :, t_index[:, :, None], t_index[:, None, :]].permute(0, 3, 1, 2)
        same = (self.document[:, :, None] == self.document[:, None, :])[:, None]
        padding_self = (~self.real.view(self.rows, self.width)).diag_embed()[:, None]
        if own.dtype == torch.bool:
            return (own & same) | padding_self
        blocked = torch.finfo(own.dtype).min
        return torch.where(padding_self, torch.zeros((), dtype=own.dtype, device=own.device),
                           torch.where(same, own, torch.full((), blocked, dtype=own.dtype, device=own.device)))

    def varlen_boundaries(self) -> tuple[Tensor, int]:
        """Flash-attention varlen arguments for the rows flattened into one sequence: the cumulative lengths of every
        document and every row's padding tail (int32, on the device) and the longest of them (a host int)."""
        segments = [n for r, row in enumerate(self.document_lengths) for n in (*row, self.width - sum(row)) if n]
        cumulative = torch.tensor([0, *segments], dtype=torch.int32).cumsum(0, dtype=torch.int32)
        return cumulative.to(self.document.device, non_blocking=True), max(segments)

    def document_mask(self, additive_dtype: torch.dtype | None = None) -> Tensor:
        """A causal mask [R, 1, W, W] that keeps each document to itself (a padding slot sees itself): for a model
        that builds its mask from the padding alone and never reads restarting positions. Boolean (True attends),
        or added to the scores (0 / the dtype's minimum) with ``additive_dtype``."""
        causal = torch.ones(self.width, self.width, dtype=torch.bool, device=self.document.device).tril()
        allowed = ((self.document[:, :, None] == self.document[:, None, :]) & causal)[:, None]
        if additive_dtype is None:
            return allowed
        return torch.zeros(allowed.shape, dtype=additive_dtype, device=allowed.device).masked_fill(
            ~allowed, torch.finfo(additive_dtype).min)

    def pack_selected(self, mask: Tensor, values: Tensor) -> Tensor:
        """``values`` [N, ...], one per True of the per-token ``mask`` [B, T] in its row-major order, reordered to
        follow the packed mask (``self.pack(mask)``) in its row-major order. No host read: N is ``values``'s."""
        flat = mask.reshape(-1)
        rank = flat.long().cumsum(0) - 1  # each selected token's index into values
        selected = flat.index_select(0, self.source) & self.real
        slots = torch.arange(self.rows * self.width, device=flat.device)
        order = torch.where(selected, slots, slots + self.rows * self.width).sort().indices[: values.shape[0]]
        return values.index_select(0, rank.index_select(0, self.source).index_select(0, order))
