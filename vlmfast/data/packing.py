"""Sequence packing: several samples per row up to a token budget, so rows carry tokens instead of padding.

Samples are placed into rows of at most ``max_tokens`` tokens by best-fit (or first-fit) decreasing. Each row gets
per-document ``position_ids`` that restart at 0, which is all the attention needs to keep documents apart
(``vlmfast.attention`` and Hugging Face models both read the boundaries from them). Labels get ``ignore_index`` at
every document's first token, so with a causal-LM shift no token is trained to predict the next document; the loss
items counted by gradient accumulation (``labels[..., 1:] != ignore_index``) are then exactly those of the padded
batch. Images stay with their own sample: they are laid out per row (``pixel_values`` [R, K, ...] plus
``images_per_row``, which micro-batch splitting slices with the rows) or flat in row order (Hugging Face LLaVA's
convention). Models that put image tokens before the text rather than in ``input_ids`` (the built-in tiny VLM)
get ``image_tokens`` placeholders per image. Qwen-VL style 3-D (mRoPE) ``position_ids`` are recognised: each
sample's own mRoPE ids are kept and the text positions that delimit documents go in channel 0 (``[4, R, T]``,
Hugging Face's convention).

The packed batch has no ``attention_mask``: a 2-D padding mask would make Hugging Face models ignore the packing.

Usage::

    collate = PackingCollator(max_tokens=512, collate_fn=VLMCollator(), image_tokens=model.prepended_image_tokens)
    batch = collate([dataset[i] for i in range(64)])   # input_ids / labels / position_ids [R, 512 or less] ...
    loss = model(**batch).loss
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch
from torch import Tensor, nn

from vlmfast.attention.documents import is_mrope_position_ids
from vlmfast.common.utils import unwrap_model
from vlmfast.data.batch_layout import IMAGE_KEYS, BatchLayout, BatchSplitError, image_key_kinds, split_collated

if TYPE_CHECKING:
    from vlmfast.spec import PackingSpec

__all__ = [
    "IMAGE_PLACEHOLDER_ID",
    "ModelPositions",
    "PackedBatch",
    "PackingCollator",
    "PackingError",
    "build_packing_collator",
    "count_packed_tokens",
    "disable_kv_cache",
    "pack_documents",
    "packed_batch_counts",
    "plan_rows",
    "unpad_batch",
]

IMAGE_PLACEHOLDER_ID = -200  # same value as vlmfast.models.tiny_vlm.IMAGE_PLACEHOLDER_ID
Algorithm = Literal["best_fit_decreasing", "first_fit_decreasing"]
Document = dict[str, Tensor]  # token keys: [L] (mRoPE position_ids: [C, L]); image keys: [n_images, ...]


_CROSS = ("packing cannot lay out batch key '{key}' {shape}: per-token values over another axis are "
          "cross-attention from each token to its sample's images (Mllama's cross_attention_mask [B, T, images, "
          "tiles]); in a packed row the documents' images share one cross-attention, and a text row with no image "
          "attends to every image slot of its row, so documents would see each other's images; set "
          "packing.enabled: false")


class PackingError(ValueError):
    """Packing cannot keep this batch or model exact; the message says why (and names ``packing``)."""


def plan_rows(lengths: Sequence[int], max_tokens: int, algorithm: Algorithm = "best_fit_decreasing") -> list[list[int]]:
    """Indices of the documents in each row: longest first, into the fullest row that fits (or the first)."""
    too_long = [(i, n) for i, n in enumerate(lengths) if n > max_tokens]
    if too_long:
        i, n = too_long[0]
        raise ValueError(f"sample {i} has {n} tokens (images included), more than packing.max_tokens={max_tokens}: "
                         f"raise packing.max_tokens to at least {max(n for _, n in too_long)} or truncate samples")
    if algorithm not in ("best_fit_decreasing", "first_fit_decreasing"):
        raise ValueError(f"unknown packing algorithm '{algorithm}': use best_fit_decreasing or first_fit_decreasing")
    rows: list[list[int]] = []
    free: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda j: -lengths[j]):
        fits = [r for r in range(len(rows)) if free[r] >= lengths[i]]
        if not fits:
            rows.append([])
            free.append(max_tokens)
            fits = [len(rows) - 1]
        row = min(fits, key=lambda r: free[r]) if algorithm == "best_fit_decreasing" else fits[0]
        rows[row].append(i)
        free[row] -= lengths[i]
    return rows


def unpad_batch(batch: Mapping[str, Any], image_keys: Sequence[str] = ("pixel_values",),
                layout: BatchLayout | None = None) -> list[Document]:
    """Split a padded batch (``attention_mask`` [B, T], each row's real tokens one run: right or left padding) back
    into one document per sample (left-padded rows are re-padded to the right: a document is its real tokens).

    Images are split by the key-aware rules that split micro-batches (:func:`split_collated`, with the model's
    image token ids in ``layout``): each document gets its own images ``[n, ...]`` (none for a text-only sample).
    A key packing cannot lay out per document is refused, naming it (``packing: ...``).
    """
    if not isinstance(batch, Mapping):
        raise PackingError(f"packing needs token sequences: a batch with 'input_ids' [B, T] and 'attention_mask'; "
                           f"collate_fn returned a {type(batch).__name__} (a model without a sequence cannot pack)")
    mask = batch.get("attention_mask")
    if not isinstance(mask, Tensor) or mask.dim() != 2 or not isinstance(batch.get("input_ids"), Tensor):
        raise PackingError("packing a padded batch needs its 'attention_mask' [B, T] (and 'input_ids') to find each "
                           f"sample's length; collate_fn returned the keys {sorted(batch)}")
    b, t = mask.shape
    lengths = mask.sum(-1)
    starts = mask.ne(0).int().argmax(dim=-1) * lengths.ne(0)  # each row's first real token (left padding: > 0)
    columns = torch.arange(t)[None, :]
    if not torch.equal(mask.bool(), (columns >= starts[:, None]) & (columns < (starts + lengths)[:, None])):
        raise PackingError("packing needs each sample's real tokens in one run (attention_mask 0...0 1...1 0...0: "
                           "right or left padding); a mask with holes cannot be unpadded")
    for key, value in batch.items():
        if not isinstance(value, Tensor):
            raise PackingError(f"packing cannot carry batch key '{key}' ({type(value).__name__}): drop it in "
                               "collate_fn")
        # Images themselves are never per-token: [B, C, H, W] with C == T (3 tokens, RGB) is not cross-attention.
        per_token = key not in ("position_ids", "pixel_values", "pixel_values_videos", *image_keys)
        if per_token and value.dim() > 2 and value.shape[:2] == (b, t):
            raise PackingError(_CROSS.format(key=key, shape=tuple(value.shape)))
    kinds = {**image_key_kinds(batch, layout), **{k: "sample" for k in image_keys if k in batch
                                                  and batch[k].shape[0] == b and k not in IMAGE_KEYS}}
    try:
        parts = split_collated(batch, 1, layout) if b > 1 else [batch]
    except BatchSplitError as e:
        raise PackingError(f"packing cannot split the batch into its samples: {e}") from None
    spans = [slice(a, a + n) for a, n in zip(starts.tolist(), lengths.tolist(), strict=True)]
    docs = [{k: _sample_value(k, v, kinds.get(k), span, t) for k, v in part.items()}
            for part, span in zip(parts, spans, strict=True)]
    return [_without_padding_slots(doc, [k for k, kind in kinds.items() if kind == "slots"]) for doc in docs]


def _without_padding_slots(doc: Document, keys: list[str]) -> Document:
    """A document's image slots without the batch's padding (trailing slots that are zero in every slot key: no
    pixel, no mask), so a packed row holds its documents' images, not every sample's share of the batch maximum.
    A batch already in the per-row layout (``images_per_row`` / ``<key>_per_row``: one sample per row) says itself
    how many slots are real; the count is dropped here, since packing counts each packed row's images again."""
    counts = [k for k in keys if k in doc and k.endswith("_per_row")]
    keys = [k for k in keys if k in doc and k not in counts]
    if counts:
        keep = int(doc[counts[0]])
        return {k: (v[:keep] if k in keys else v) for k, v in doc.items() if k not in counts}
    if not keys:
        return doc
    used = torch.stack([doc[k].flatten(1).ne(0).any(1) for k in keys]).any(0)
    keep = int(used.nonzero().max()) + 1 if bool(used.any()) else 0
    return {k: (v[:keep] if k in keys else v) for k, v in doc.items()}


def _sample_value(key: str, value: Tensor, kind: str | None, span: slice, t: int) -> Tensor:
    """One sample's value (``value`` is the sample's slice of the batch; ``span``: its real tokens) as a document
    holds it."""
    if kind == "items":
        return value  # [its images (or patches), ...]
    if kind == "slots":
        return value[0]  # [slots, ...]: its images, padded to the batch's most
    if kind == "sample":
        return value  # [1, ...]: its one image
    if key == "position_ids" and value.dim() == 3 and value.shape[1:] == (1, t):
        return value[:, 0, span]  # mRoPE [channels, 1, T]
    if value.dim() == 2 and value.shape == (1, t):
        return value[0, span]
    raise PackingError(f"packing cannot lay out batch key '{key}' (one sample: {tuple(value.shape)}): a per-sample "
                       "value has no layout rule in a packed row, which keeps per-token keys [B, T] and per-image "
                       "keys (several samples' values would have to share one row); set packing.level: embeddings (or "
                       "auto: packed after the model's own merge), or packing.enabled: false")


@dataclass
class PackedBatch:
    """A packed batch and which input documents went into each row (``rows[r]`` = document indices)."""

    tensors: dict[str, Any]
    rows: list[list[int]]
    document_lengths: list[list[int]] = field(default_factory=list)  # tokens of each document, per row


def pack_documents(
    docs: Sequence[Document],
    max_tokens: int,
    *,
    algorithm: Algorithm = "best_fit_decreasing",
    image_tokens: int = 0,
    image_keys: Sequence[str] = ("pixel_values",),
    image_layout: Literal["per_row", "flat"] | Mapping[str, str] = "per_row",
    shift_labels: bool = True,
    pad_id: int = 0,
    ignore_index: int = -100,
    pad_to_max_tokens: bool = False,
    image_counts: bool = True,
) -> PackedBatch:
    """Pack documents (dicts of ``input_ids`` [L], optional ``labels`` [L], images [n, ...]) into rows.

    ``image_layout`` per image key (or one for all): ``flat`` concatenates the rows' images in row order, ``per_row``
    stacks them ``[rows, most images, ...]`` (zero padding) plus ``<key>_per_row`` counts when ``image_counts``.
    """
    if not docs:
        raise ValueError("cannot pack an empty list of samples")
    docs = [_with_placeholders(d, image_tokens, image_keys, shift_labels, ignore_index) for d in docs]
    lengths = [int(d["input_ids"].shape[-1]) for d in docs]
    rows = plan_rows(lengths, max_tokens, algorithm)
    width = max_tokens if pad_to_max_tokens else max(sum(lengths[i] for i in row) for row in rows)
    tensors = _pack_tokens(docs, rows, width, pad_id, ignore_index, image_keys)
    for key in image_keys:
        if any(key in d for d in docs):
            how = image_layout if isinstance(image_layout, str) else image_layout.get(key, "per_row")
            tensors.update(_pack_images(docs, rows, key, how, image_counts))
    return PackedBatch(tensors, rows, [[lengths[i] for i in row] for row in rows])


def _with_placeholders(doc: Document, image_tokens: int, image_keys: Sequence[str], shift_labels: bool,
                       ignore_index: int) -> Document:
    """The document as the model sees it: image placeholders first (if any), first label ignored (if shifted)."""
    if "input_ids" not in doc:
        raise ValueError(f"a sample to pack needs 'input_ids'; it has {sorted(doc)}")
    first_image = next((k for k in image_keys if k in doc), None)
    doc = {k: (v.unsqueeze(0) if k == first_image and v.dim() == 3 else v) for k, v in doc.items()}  # one image
    doc.pop("attention_mask", None)  # see the module docstring
    for key, value in doc.items():
        if key not in image_keys and value.dim() != 1 and not (key == "position_ids" and value.shape[0] in (3, 4)):
            raise ValueError(f"packing takes 1-D token tensors, but '{key}' has shape {tuple(value.shape)}")
    if "labels" in doc and shift_labels:
        doc["labels"] = doc["labels"].clone()
        doc["labels"][:1] = ignore_index
    n_images = int(doc[first_image].shape[0]) if first_image is not None else 0
    extra = image_tokens * n_images
    if extra:
        for key, value in list(doc.items()):
            if key not in image_keys:
                fill = {"input_ids": IMAGE_PLACEHOLDER_ID, "labels": ignore_index}.get(key, 0)
                doc[key] = torch.cat([value.new_full((*value.shape[:-1], extra), fill), value], dim=-1)
    return doc


def _pack_tokens(docs: Sequence[Document], rows: list[list[int]], width: int, pad_id: int,
                 ignore_index: int, image_keys: Sequence[str] = ()) -> dict[str, Tensor]:
    first = docs[0]
    out: dict[str, Tensor] = {}
    for key, value in first.items():
        if value.dim() == 1 and key not in image_keys:  # an image key of one dimension: per-image counts
            fill = {"input_ids": pad_id, "labels": ignore_index}.get(key, 0)
            out[key] = value.new_full((len(rows), width), fill)
    mrope = "position_ids" in first and is_mrope_position_ids(first["position_ids"].unsqueeze(1))
    positions = torch.zeros(4 if mrope else 1, len(rows), width, dtype=torch.long)
    longest = max(d["input_ids"].shape[-1] for d in docs)
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            n = docs[i]["input_ids"].shape[-1]
            for key in out:
                out[key][r, start : start + n] = docs[i][key]
            positions[0, r, start : start + n] = torch.arange(n)
            if mrope:
                own = docs[i]["position_ids"]
                positions[1:, r, start : start + n] = own[-3:]  # [3, n], or channels 1-3 of [4, n]
            start += n
        # The padding tail is a "document" of its own (never seen by real tokens); its positions stay below the
        # longest sample's so they are valid for the model, restarting as often as needed.
        positions[:, r, start:] = torch.arange(width - start) % longest
    out["position_ids"] = positions if mrope else positions[0]
    return out


def _pack_images(docs: Sequence[Document], rows: list[list[int]], key: str, layout: str,
                 counts_key: bool = True) -> dict[str, Tensor]:
    per_row = [[docs[i][key] for i in row if key in docs[i]] for row in rows]
    per_row = [torch.cat(images) if images else None for images in per_row]
    example = next(x for x in per_row if x is not None)
    if layout == "flat":
        return {key: torch.cat([x for x in per_row if x is not None])}
    if layout != "per_row":
        raise ValueError(f"unknown image_layout '{layout}': use per_row or flat")
    counts = torch.tensor([0 if x is None else x.shape[0] for x in per_row])
    packed = example.new_zeros((len(rows), int(counts.max()), *example.shape[1:]))
    for r, images in enumerate(per_row):
        if images is not None:
            packed[r, : images.shape[0]] = images
    if not counts_key:
        return {key: packed}
    count_key = "images_per_row" if key == "pixel_values" else f"{key}_per_row"
    return {key: packed, count_key: counts}


@dataclass
class ModelPositions:
    """The model's own multi-axis position ids of a padded batch: its ``get_rope_index`` (Hugging Face's mRoPE
    models: Qwen2-VL, Qwen2.5-VL, ...), so every packed document keeps exactly the positions it has when padded.

    Usage: ``PackingCollator(512, collate, position_ids_fn=ModelPositions(model.model))``
    """

    module: nn.Module

    def __call__(self, batch: Mapping[str, Any]) -> Tensor:
        rope_index = self.module.get_rope_index
        wanted = inspect.signature(rope_index).parameters
        with torch.no_grad():
            out = rope_index(**{k: v for k, v in batch.items() if k in wanted})
        return out[0] if isinstance(out, tuple) else out

    @classmethod
    def find(cls, model: nn.Module) -> ModelPositions | None:
        """The first module of ``model`` with a ``get_rope_index`` method, else None (1-D positions suffice)."""
        for module in unwrap_model(model).modules():
            if callable(getattr(module, "get_rope_index", None)):
                return cls(module)
        return None


@dataclass
class PackingCollator:
    """A collate_fn that packs: ``collate_fn`` (optional) pads the samples, then they are packed into rows.

    Without ``collate_fn`` the samples must already be documents: dicts of ``input_ids`` [L], optional ``labels``
    [L] and images [n, ...]. A plain dataclass, so it pickles into DataLoader workers.

    ``image_layout="auto"`` keeps the padded batch's own image layout (what the model takes): images of all samples
    in order (LLaVA, LLaVA-NeXT, PaliGemma, Qwen2-VL's patches with ``image_grid_thw``) become the rows' images in
    row order; per-sample slots (Idefics3) and one image per sample (the tiny VLM) become ``[rows, most images,
    ...]`` (plus ``images_per_row`` when ``image_counts``). ``layout`` holds the model's image token ids, which tell
    whose images are whose (:func:`vlmfast.data.batch_layout.image_key_kinds`).
    """

    max_tokens: int
    collate_fn: Callable[[list[Any]], Mapping[str, Any]] | None = None
    algorithm: Algorithm = "best_fit_decreasing"
    image_tokens: int = 0
    image_keys: tuple[str, ...] = ("pixel_values",)
    image_layout: Literal["auto", "per_row", "flat"] = "auto"
    shift_labels: bool = True
    pad_id: int = 0
    ignore_index: int = -100
    pad_to_max_tokens: bool = False
    # Also return ``document_lengths`` (per row, Python ints): the documents as host values, so a model that takes
    # them (the tiny VLM) never reads its document boundaries back from the GPU. A per-row list: micro-batch
    # splitting slices it with the rows.
    document_lengths: bool = False
    layout: BatchLayout | None = None
    position_ids_fn: Callable[[Mapping[str, Any]], Tensor] | None = None
    image_counts: bool = True

    def __call__(self, samples: list[Any]) -> dict[str, Any]:
        return self.pack(samples).tensors

    def pack(self, samples: list[Any]) -> PackedBatch:
        """The packed batch with its rows (which samples went where); ``__call__`` returns its tensors."""
        image_keys: tuple[str, ...] = self.image_keys
        layout: Any = "per_row" if self.image_layout == "auto" else self.image_layout
        if self.collate_fn is not None:
            padded = self.collate_fn(samples)
            if self.position_ids_fn is not None and isinstance(padded, Mapping) and "position_ids" not in padded \
                    and isinstance(padded.get("input_ids"), Tensor):
                padded = {**padded, "position_ids": self.position_ids_fn(padded)}
            docs = unpad_batch(padded, self.image_keys, self.layout)
            kinds = image_key_kinds(padded, self.layout)
            image_keys = (*kinds, *(k for k in self.image_keys if k not in kinds))
            if self.image_layout == "auto":
                layout = {k: "flat" if kind == "items" else "per_row" for k, kind in kinds.items()}
        else:
            docs = [dict(s) for s in samples]
        packed = pack_documents(
            docs, self.max_tokens, algorithm=self.algorithm, image_tokens=self.image_tokens,
            image_keys=image_keys, image_layout=layout, shift_labels=self.shift_labels,
            pad_id=self.pad_id, ignore_index=self.ignore_index, pad_to_max_tokens=self.pad_to_max_tokens,
            image_counts=self.image_counts,
        )
        # The tiny VLM reads document_lengths as "one image per document" (it then selects images without a host
        # read); with 0 or several images per sample it must count them from images_per_row instead.
        counts = packed.tensors.get("images_per_row")
        if self.document_lengths and (counts is None or counts.tolist() == [len(row) for row in packed.rows]):
            packed.tensors = {**packed.tensors, "document_lengths": packed.document_lengths}
        return packed


def build_packing_collator(
    spec: PackingSpec,
    model: nn.Module,
    collate_fn: Callable[[list[Any]], Mapping[str, Any]] | None = None,
    *,
    shift_labels: bool = True,
    ignore_index: int = -100,
) -> PackingCollator:
    """The collator for the ``packing`` spec section (and the model made ready for packed rows): images keep the
    layout the model takes, mRoPE models get their own position ids per document (:class:`ModelPositions`)."""
    disable_kv_cache(model)
    image_tokens = spec.image_tokens
    if image_tokens is None:
        image_tokens = int(getattr(unwrap_model(model), "prepended_image_tokens", 0))
    accepts = inspect.signature(unwrap_model(model).forward).parameters
    return PackingCollator(
        max_tokens=spec.max_tokens, collate_fn=collate_fn, algorithm=spec.algorithm, image_tokens=image_tokens,
        image_layout=spec.image_layout, shift_labels=shift_labels, pad_id=int(getattr(collate_fn, "pad_id", 0)),
        ignore_index=ignore_index, pad_to_max_tokens=spec.pad_to_max_tokens,
        document_lengths="document_lengths" in accepts, layout=BatchLayout.from_model(model),
        position_ids_fn=ModelPositions.find(model), image_counts="images_per_row" in accepts,
    )


def disable_kv_cache(model: nn.Module) -> None:
    """``use_cache=False`` on a Hugging Face model's configs: HF reads packing from position_ids only without one."""
    for module in model.modules():
        config = getattr(module, "config", None)
        for cfg in [config, *(getattr(config, key, None) for key in getattr(config, "sub_configs", {}))]:
            if cfg is not None and hasattr(cfg, "use_cache"):
                cfg.use_cache = False


def count_packed_tokens(batch: Mapping[str, Any], pad_id: int = 0) -> int:
    """Real tokens of a packed batch: everything but each row's trailing padding (image placeholders count)."""
    return packed_batch_counts(batch, pad_id)[1]


def packed_batch_counts(batch: Mapping[str, Any], pad_id: int = 0) -> tuple[int, int]:
    """(samples, real tokens) of a packed batch, read with one host sync: a sample starts where its positions
    restart at 0 before the row's trailing padding (whose positions restart too)."""
    ids = batch["input_ids"]
    padding = (ids == pad_id).flip(-1).long().cumprod(-1).flip(-1).bool()
    positions = batch.get("position_ids")
    if positions is None:  # not from PackingCollator: one sample per row
        starts = ids.new_zeros(()) + ids.shape[0]
    else:
        text_positions = positions[0] if positions.dim() == 3 else positions  # mRoPE: channel 0 restarts per sample
        starts = ((text_positions == 0) & ~padding).sum()
    samples, tokens = torch.stack([starts, (~padding).sum()]).tolist()
    return int(samples), int(tokens)
