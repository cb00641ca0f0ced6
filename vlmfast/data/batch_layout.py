"""Splitting an already collated batch into micro-batches of samples, by rules that know each key's layout.

A batch that arrives collated (the user's own DataLoader) holds tensors of different layouts: text keys have one
row per sample, but a Qwen2-VL ``pixel_values`` holds the patches of all images of all samples (``image_grid_thw``
says how many each image has), a LLaVA / PaliGemma ``pixel_values`` one row per *image* (0, 1 or 2 per sample), a
LLaVA-NeXT one row per image with its tiles (``image_sizes``). Slicing every tensor whose first dimension happens to
equal the batch size splits those wrongly or not at all. The rules here:

- text keys (``input_ids``, ``attention_mask``, ``labels``, ...) and any other tensor whose first dimension is the
  number of samples: sliced by sample; mRoPE ``position_ids`` ``[3 or 4, samples, T]`` along their sample dimension;
- per-image (and per-video) tensors: each sample's items are found from its image tokens in ``input_ids`` (the ids
  come from the model: :meth:`BatchLayout.from_model`): by each image's token count (flattened patches +
  ``image_grid_thw``: patches / tokens is the merge factor), by the fixed tokens per image (LLaVA, PaliGemma), or by
  counting runs of image tokens (``image_sizes`` tiles, whose token counts vary); the counts must add up exactly;
- per-sample image tensors (Idefics3 / SmolVLM with ``pixel_attention_mask``, Mllama with ``aspect_ratio_ids``,
  vlmfast's packed ``images_per_row``): sliced by sample;
- a micro-batch whose samples have no image in a per-image layout, or whose ``pixel_attention_mask`` shows no
  real pixel, gets no image keys (what a processor returns for text-only samples); other per-sample image tensors
  keep their padding (Mllama's text rows attend to it);
- scalars (0-d tensors, numbers, strings, None) go to every micro-batch; lists of one item per sample are sliced.

Anything else is refused with a :class:`BatchSplitError` that names the key and what to do instead: a tensor is
never passed whole to every micro-batch, and never sliced by a guess.

Usage::

    micro_batches = split_collated(batch, 3, BatchLayout.from_model(model))
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["BatchLayout", "BatchSplitError", "image_key_kinds", "items_per_sample", "num_samples", "split_collated",
           "take_samples"]

ANCHOR_KEYS = ("input_ids", "attention_mask", "labels", "inputs_embeds", "token_type_ids")
PER_SAMPLE_IMAGE_MARKERS = ("pixel_attention_mask", "aspect_ratio_ids", "aspect_ratio_mask", "images_per_row")
# One row per image besides pixel_values: sizes, and Phi-4-multimodal's crops and their masks ([images, crops, ...])
IMAGE_ITEM_KEYS = ("image_sizes", "image_pixel_values", "image_attention_mask")
IMAGE_KEYS = ("pixel_values", "image_grid_thw", *IMAGE_ITEM_KEYS, "pixel_attention_mask", "aspect_ratio_ids",
              "aspect_ratio_mask", "cross_attention_mask", "images_per_row")
VIDEO_KEYS = ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
SCALARS = (int, float, bool, str, bytes, type(None))
_DROP = object()

FIX = ("pass the Dataset (and your collate_fn) to OptimizedTrainer instead of a DataLoader, so that each micro-batch "
       "is collated from its own samples; or set micro_batch_size to batch_size (and oom.enabled: false)")


class BatchSplitError(ValueError):
    """A collated batch cannot be split by sample without guessing; the message names the key and what to do."""


@dataclass(frozen=True)
class BatchLayout:
    """The token ids that stand for an image / a video in ``input_ids`` (what the splitter needs from the model).

    Usage: ``BatchLayout.from_model(model)`` or ``BatchLayout(image_token_ids=(151655,))``
    """

    image_token_ids: tuple[int, ...] = ()
    video_token_ids: tuple[int, ...] = ()

    @classmethod
    def from_model(cls, model: nn.Module | None) -> BatchLayout:
        """Read the ids from a Hugging Face style config (``image_token_id`` / ``image_token_index`` ...), at its top
        level or in any of its sub-configs (``text_config``, Phi-4-multimodal's ``vision_config``, ...)."""
        model = getattr(model, "module", model)
        model = getattr(model, "_orig_mod", model)  # torch.compile
        config = getattr(model, "config", None)
        if config is None:
            return cls()
        return cls(_config_ids(config, ("image_token_id", "image_token_index")),
                   _config_ids(config, ("video_token_id", "video_token_index")))


def _config_ids(config: Any, names: Sequence[str]) -> tuple[int, ...]:
    found = []
    for cfg in _configs_within(config):
        for name in names:
            value = getattr(cfg, name, None)
            if isinstance(value, int) and value >= 0 and value not in found:
                found.append(value)
    return tuple(found)


def _configs_within(config: Any, depth: int = 3) -> list[Any]:
    """``config`` and every config nested in it (attributes that are configs themselves), outermost first: where a
    model keeps a token id is its own choice (top level, ``text_config``, ``vision_config``), never listed by type."""
    found, level = [config], [config]
    for _ in range(depth):
        level = [value for cfg in level for value in vars(cfg).values() if _is_config(value)]
        found += [cfg for cfg in level if all(cfg is not seen for seen in found)]
    return found


def _is_config(value: Any) -> bool:
    return callable(getattr(value, "to_dict", None)) and callable(getattr(value, "to_json_string", None))


def num_samples(batch: Any) -> int:
    """Samples in a collated batch: dim 0 of its text keys (``input_ids`` ...), else of its first tensor."""
    if isinstance(batch, Mapping):
        for key in ANCHOR_KEYS:
            value = batch.get(key)
            if isinstance(value, Tensor) and value.dim() > 0:
                return value.shape[0]
    tensor = _first_tensor(batch)
    if tensor is not None:
        return tensor.shape[0]
    if isinstance(batch, (list, tuple)):
        return len(batch)
    raise TypeError(f"cannot find the number of samples of a {type(batch).__name__}: it holds no tensor")


def _first_tensor(obj: Any) -> Tensor | None:
    if isinstance(obj, Tensor):
        return obj if obj.dim() > 0 else None
    values = obj.values() if isinstance(obj, Mapping) else obj if isinstance(obj, (list, tuple)) else ()
    for value in values:
        found = _first_tensor(value)
        if found is not None:
            return found
    return None


def split_collated(batch: Any, micro_batch_size: int, layout: BatchLayout | None = None, host: Any = None) -> list[Any]:
    """Micro-batches of ``micro_batch_size`` samples (the last may be smaller) of a collated batch (module doc).

    ``host``: the host batch ``batch`` was copied from (device prefetch). The rules read only it (image tokens,
    grids, pixel masks) and slice ``batch``, so splitting a device batch reads no device value.
    Usage: ``split_collated(device_batch, 4, layout, host=host_batch)``
    """
    n = num_samples(batch)
    if micro_batch_size >= n:
        return [batch]
    return take_samples(batch, [range(a, min(a + micro_batch_size, n)) for a in range(0, n, micro_batch_size)],
                        layout, host)


def take_samples(batch: Any, groups: Sequence[Sequence[int]], layout: BatchLayout | None = None,
                 host: Any = None) -> list[Any]:
    """One micro-batch per group of sample indices (any order, any subset) of a collated batch, by the same
    key-aware rules as :func:`split_collated`: each sample's images found from its image tokens, never by a
    tensor's first dimension happening to equal the sample count. Contiguous groups are views, others gathers.

    Usage: ``take_samples(batch, [[7, 2], [0, 1, 3]], BatchLayout.from_model(model))``
    """
    n = num_samples(batch)
    groups = [_as_samples(g) for g in groups]
    if isinstance(batch, Mapping):
        rules = _mapping_rules(batch, n, layout or BatchLayout(), host if isinstance(host, Mapping) else batch)
        parts = [{k: rules[k](g) for k in batch} for g in groups]  # the batch's key order
        return [_rebuild(batch, {k: v for k, v in part.items() if v is not _DROP}) for part in parts]
    rule = _generic_rule(batch, n, "the batch")
    return [rule(g) for g in groups]


def items_per_sample(batch: Mapping[str, Any], layout: BatchLayout | None = None) -> list[int] | None:
    """Images of each sample of a collated batch, by the rules that split it (image tokens in ``input_ids``, grids,
    per-sample pixel masks); None when the batch has no image key. Raises :class:`BatchSplitError` when no rule
    proves it. Usage: ``items_per_sample(batch, BatchLayout.from_model(model))`` -> ``[2, 0, 1]``"""
    n = num_samples(batch)
    kinds = image_key_kinds(batch, layout)
    key = next((k for k in ("pixel_values", *IMAGE_KEYS) if kinds.get(k)), None)
    if key is None:
        return None
    if kinds[key] == "sample":
        return [1] * n
    if kinds[key] == "slots":
        counts = batch.get("images_per_row")
        if isinstance(counts, Tensor):
            return [int(c) for c in counts.tolist()]
        mask = batch.get("pixel_attention_mask")
        if isinstance(mask, Tensor) and mask.dim() >= 2 and mask.shape[0] == n:
            return [int(c) for c in mask.flatten(2).any(dim=2).sum(dim=1).tolist()]
        value = batch[key]
        return [int(value.shape[1]) if isinstance(value, Tensor) and value.dim() > 1 else 1] * n
    layout = layout or BatchLayout()
    items, rows = _items(batch, "pixel_values", "image_grid_thw", IMAGE_ITEM_KEYS)
    keys = [k for k in ("pixel_values", "image_grid_thw", *IMAGE_ITEM_KEYS) if k in batch]
    return _items_per_sample(batch, _token_mask(batch, layout.image_token_ids), items, rows, "image_grid_thw",
                             IMAGE_ITEM_KEYS, "image", keys)


@dataclass(frozen=True)
class _Samples:
    """Sample indices, kept as a (start, stop) range when contiguous: slices stay views."""

    indices: tuple[int, ...]
    span: tuple[int, int] | None

    def any_of(self, flags: Tensor) -> bool:
        return bool(flags[self.span[0]:self.span[1]].any()) if self.span else bool(flags[list(self.indices)].any())


def _as_samples(group: Sequence[int]) -> _Samples:
    indices = tuple(int(i) for i in group)
    contiguous = bool(indices) and indices == tuple(range(indices[0], indices[0] + len(indices)))
    return _Samples(indices, (indices[0], indices[-1] + 1) if contiguous else None)


def _gather(value: Any, samples: _Samples, dim: int = 0) -> Any:
    """The samples' rows of a per-sample tensor or list along ``dim``."""
    if samples.span is not None:
        a, b = samples.span
        return value[a:b] if dim == 0 else value.narrow(dim, a, b - a)
    if isinstance(value, Tensor):
        return value.index_select(dim, _index_on(samples.indices, value.device))
    return type(value)(value[i] for i in samples.indices) if isinstance(value, tuple) else \
        [value[i] for i in samples.indices]


def _index_on(indices: Sequence[int], device: torch.device) -> Tensor:
    """The indices as a tensor on ``device``, sent without waiting for the device: a blocking copy from pageable
    memory ends in a stream synchronize, a non-blocking one from pinned memory is only queued and the pinned block
    is kept until it ran (torch aten/src/ATen/native/cuda/Copy.cu, copy_kernel_cuda: memcpy_and_sync vs
    cudaMemcpyAsync + CachingHostAllocator_recordEvent)."""
    index = torch.tensor(indices, dtype=torch.long)
    if device.type == "cuda":
        return index.pin_memory().to(device, non_blocking=True)
    return index if device.type == "cpu" else index.to(device)


def _segments(value: Any, bounds: list[tuple[int, int]]) -> Any:
    """The rows of ``value`` in ``bounds`` (start, stop) pairs, concatenated: a view when there is one."""
    if len(bounds) == 1:
        return value[bounds[0][0]:bounds[0][1]]
    if isinstance(value, Tensor):
        return torch.cat([value[a:b] for a, b in bounds])
    picked = [item for a, b in bounds for item in value[a:b]]
    return type(value)(picked) if isinstance(value, tuple) else picked


def _rebuild(batch: Mapping[str, Any], values: dict[str, Any]) -> Any:
    try:
        return type(batch)(values)  # dict, OrderedDict, BatchFeature...
    except TypeError:
        return dict(values)


Rule = Callable[["_Samples"], Any]


def _mapping_rules(batch: Mapping[str, Any], n: int, layout: BatchLayout, host: Mapping[str, Any]) -> dict[str, Rule]:
    """The rule of each key of ``batch``; what decides them (image tokens, grids, pixel masks) is read on ``host``,
    the same batch on the host (``batch`` itself unless it was copied to the device)."""
    rules: dict[str, Rule] = {}
    image_tokens = _token_mask(host, layout.image_token_ids)
    video_tokens = _token_mask(host, layout.video_token_ids)
    rules.update(_image_rules(batch, n, image_tokens, host))
    rules.update(_stream_rules(batch, n, video_tokens, "pixel_values_videos", "video_grid_thw",
                               ("second_per_grid_ts",), "video", host))
    for key, value in batch.items():
        if key in rules:
            continue
        if key == "position_ids" and _channels_first(value, n, batch.get("input_ids")):
            rules[key] = lambda g, v=value: _gather(v, g, dim=1)  # mRoPE: [channels, samples, T]
        else:
            rules[key] = _generic_rule(value, n, f"'{key}'")
    return rules


def _channels_first(value: Any, n: int, ids: Any) -> bool:
    """mRoPE ``position_ids`` [channels, samples, T]: told from [samples, T, ...] by T, not by the channel count
    (packed rows can number 3 or 4, as many as the channels)."""
    if not (isinstance(value, Tensor) and value.dim() == 3 and value.shape[1] == n):
        return False
    if isinstance(ids, Tensor) and ids.dim() == 2:
        return value.shape[2] == ids.shape[1] and not (value.shape[0] == n and value.shape[1] == ids.shape[1])
    return value.shape[0] != n


def image_key_kinds(batch: Mapping[str, Any], layout: BatchLayout | None = None) -> dict[str, str]:
    """How each image / video key of a collated batch holds its items (what packing needs to rebuild rows):

    - ``"items"``: one row per image (or per image patch, with ``image_grid_thw``) of all samples in order;
    - ``"slots"``: ``[samples, slots, ...]``, each sample's images padded to the batch's most (Idefics3's
      ``pixel_attention_mask``, Mllama's ``aspect_ratio_ids``, packing's ``images_per_row``);
    - ``"sample"``: one image per sample ``[samples, ...]`` (an image not in ``input_ids``: vlmfast's tiny VLM).

    Usage: ``image_key_kinds(batch, BatchLayout.from_model(model))``
    """
    layout = layout or BatchLayout()
    n = num_samples(batch)
    kinds = {k: "items" for k in VIDEO_KEYS if k in batch}
    present = [k for k in IMAGE_KEYS if k in batch]
    tokens = _token_mask(batch, layout.image_token_ids)
    if any(k in batch for k in PER_SAMPLE_IMAGE_MARKERS):
        kinds.update({k: "slots" for k in present})
    elif "image_grid_thw" not in batch and "image_sizes" not in batch and _per_sample_pixels(batch, n, tokens):
        kinds.update({k: "sample" for k in present})
    else:
        kinds.update({k: "items" for k in present})
        items, _ = _items(batch, "pixel_values", "image_grid_thw", IMAGE_ITEM_KEYS)
        count_key = _count_key(batch, n, tokens, items)
        if count_key is not None and len(batch[count_key]) != n:  # one entry per image-carrying sample: kept in the
            kinds[count_key] = "items"  # images' order, so every image keeps its sample's count (its image path)
    return kinds


def _token_mask(batch: Mapping[str, Any], token_ids: tuple[int, ...]) -> Tensor | None:
    ids = batch.get("input_ids")
    if not token_ids or not isinstance(ids, Tensor) or ids.dim() != 2:
        return None
    mask = ids == token_ids[0]  # compared with Python ints: no tensor of the ids to copy to the batch's device
    for token_id in token_ids[1:]:
        mask |= ids == token_id
    return mask


def _image_rules(batch: Mapping[str, Any], n: int, tokens: Tensor | None, host: Mapping[str, Any]) -> dict[str, Rule]:
    present = [k for k in IMAGE_KEYS if k in batch]
    if not present:
        return {}
    if any(k in batch for k in PER_SAMPLE_IMAGE_MARKERS) or (
            "image_grid_thw" not in batch and "image_sizes" not in batch and _per_sample_pixels(batch, n, tokens)):
        # Sliced with their padding: what the whole batch gave the samples (Mllama's text rows without an image
        # attend to the padding slots, so dropping those would change the gradient). Only where a pixel mask proves
        # a micro-batch holds no real image (Idefics3, whose vision tower cannot run on padding alone) are the keys
        # dropped, as its processor does for text-only samples.
        return {k: _unless_no_pixels(_generic_rule(batch[k], n, f"'{k}'"), host.get("pixel_attention_mask"), n)
                for k in present}
    return _stream_rules(batch, n, tokens, "pixel_values", "image_grid_thw", IMAGE_ITEM_KEYS, "image", host)


def _per_sample_pixels(batch: Mapping[str, Any], n: int, tokens: Tensor | None) -> bool:
    """A bare ``pixel_values`` is one row per sample only when no image tokens say otherwise (e.g. vlmfast's tiny
    VLM, which puts its image before the text); with image tokens it is one row per image (LLaVA, PaliGemma)."""
    pixels = batch.get("pixel_values")
    has_tokens = tokens is not None and bool(tokens.any())
    return isinstance(pixels, Tensor) and pixels.dim() > 0 and pixels.shape[0] == n and not has_tokens


def _unless_no_pixels(rule: Rule, pixel_mask: Any, n: int) -> Rule:
    if not (isinstance(pixel_mask, Tensor) and pixel_mask.dim() > 0 and pixel_mask.shape[0] == n):
        return rule
    real = pixel_mask.flatten(1).any(dim=1)
    return lambda g: rule(g) if g.any_of(real) else _DROP


def _stream_rules(batch: Mapping[str, Any], n: int, tokens: Tensor | None, data_key: str, grid_key: str,
                  item_keys: tuple[str, ...], what: str, host: Mapping[str, Any]) -> dict[str, Rule]:
    """Rules for the per-item tensors of one stream (images or videos): each sample's items, found from its tokens."""
    keys = [k for k in (data_key, grid_key, *item_keys) if k in batch]
    if not keys:
        return {}
    items, rows = _items(host, data_key, grid_key, item_keys)
    count_key = _count_key(host, n, tokens, items) if what == "image" else None
    counts = _items_per_sample(host, tokens, items, rows, grid_key, item_keys, what, keys)
    starts = [0, *torch.tensor(counts, dtype=torch.long).cumsum(0).tolist()]  # first item of each sample
    row_starts = [0, *torch.tensor(rows, dtype=torch.long).cumsum(0).tolist()] if rows is not None else []

    def rule_for(key: str) -> Rule:
        value = batch[key]
        # Flattened patches: the rows of the samples' images; any other key: one row per item.
        first = row_starts if key == data_key and rows is not None else list(range(items + 1))

        def rule(g: _Samples) -> Any:
            bounds = [(first[starts[i]], first[starts[i + 1]]) for i in g.indices if starts[i + 1] > starts[i]]
            if not bounds:
                return _DROP  # no item in these samples: no key, as a processor returns for text-only samples
            merged = [bounds[0]]  # adjacent samples' items in one slice: a contiguous group stays a view
            for a, b in bounds[1:]:
                merged[-1:] = [(merged[-1][0], b)] if a == merged[-1][1] else [merged[-1], (a, b)]
            return _segments(value, merged)
        return rule

    for key in keys:
        if not isinstance(batch[key], (Tensor, list, tuple)):
            raise BatchSplitError(f"cannot split the batch into micro-batches of samples: '{key}' is a "
                                  f"{type(batch[key]).__name__}, expected a tensor of one row per {what}; {FIX}")
    rules = {key: rule_for(key) for key in keys}
    if count_key is not None and len(batch[count_key]) != n:  # one entry per sample that has images
        entry = [0] * n  # each image-carrying sample's entry
        for position, sample in enumerate(i for i, c in enumerate(counts) if c):
            entry[sample] = position
        rules[count_key] = lambda g, v=batch[count_key]: _DROP if not any(counts[i] for i in g.indices) else \
            _segments(v, [(entry[i], entry[i] + 1) for i in g.indices if counts[i]])
    return rules


def _items(batch: Mapping[str, Any], data_key: str, grid_key: str,
           item_keys: tuple[str, ...]) -> tuple[int, list[int] | None]:
    """(number of items, rows of ``data_key`` per item when it holds flattened patches, else None)."""
    grid = batch.get(grid_key)
    if isinstance(grid, Tensor):
        return grid.shape[0], grid.prod(dim=-1).tolist()
    for key in (*item_keys, data_key):
        value = batch.get(key)
        if isinstance(value, Tensor) and value.dim() > 0:
            return value.shape[0], None
        if isinstance(value, (list, tuple)):
            return len(value), None
    return 0, None


def _items_per_sample(batch: Mapping[str, Any], tokens: Tensor | None, items: int, rows: list[int] | None,
                      grid_key: str, item_keys: tuple[str, ...], what: str, keys: list[str]) -> list[int]:
    named = f"'{keys[0]}'" + (f" (with {', '.join(repr(k) for k in keys[1:])})" if len(keys) > 1 else "")
    if tokens is None:
        raise BatchSplitError(
            f"cannot split the batch into micro-batches of samples: {named} holds the {what}s of all samples, and "
            f"vlmfast finds each sample's {what}s from its {what} tokens in input_ids, but the {what} token id is "
            f"unknown (the model's config has no {what}_token_id; pass layout=BatchLayout({what}_token_ids=(id,))) "
            f"or input_ids is missing; or {FIX}")
    per_sample = tokens.sum(dim=1).tolist()
    count_key = _count_key(batch, tokens.shape[0], tokens, items) if what == "image" else None
    if count_key is not None:  # the processor's own per-sample counts, checked against the items and the tokens
        counts = _counts_from_key(batch[count_key], tokens)
        how = f"'{count_key}' (images per sample)"
    elif rows is not None:
        counts = _counts_by_token_length(per_sample, rows)
        how = f"each {what}'s tokens ({grid_key} patches / merge factor)"
    elif any(k in batch for k in item_keys):
        sizes = batch.get("image_sizes")
        counts = _counts_by_size(per_sample, sizes) if isinstance(sizes, Tensor) else None
        counts = counts or _counts_by_runs(tokens)
        how = f"each {what}'s size in image_sizes (tokens in proportion to its area), or runs of {what} tokens"
    else:
        counts = _counts_by_fixed_length(per_sample, items) or _counts_by_runs(tokens)
        how = f"a fixed number of tokens per {what}, or runs of {what} tokens"
    if counts is None or sum(counts) != items:
        found = "no consistent assignment" if counts is None else f"{sum(counts)} {what}(s)"
        raise BatchSplitError(
            f"cannot split the batch into micro-batches of samples: {named} holds {items} {what}(s), but counting "
            f"{how} in input_ids gives {found}; vlmfast will not guess which {what} belongs to which sample "
            f"(two {what}s with no text between them look like one); {FIX}")
    return counts


def _counts_by_token_length(per_sample: list[int], rows: list[int]) -> list[int] | None:
    """Items per sample when item i has rows[i] / m tokens (m: the merge factor, patches per token)."""
    total_tokens, total_rows = sum(per_sample), sum(rows)
    if total_tokens == 0 or total_rows % total_tokens:
        return None
    merge = total_rows // total_tokens
    if any(r % merge for r in rows):
        return None
    lengths, counts, i = [r // merge for r in rows], [], 0
    for need in per_sample:
        taken = 0
        while need > 0 and i < len(lengths):
            need -= lengths[i]
            i, taken = i + 1, taken + 1
        if need != 0:
            return None
        counts.append(taken)
    return counts if i == len(lengths) else None


def _count_key(batch: Mapping[str, Any], n: int, tokens: Tensor | None, items: int) -> str | None:
    """The one key that holds images per sample (LLaVA-OneVision's ``batch_num_images``), learned by what it holds,
    not by its name: a 1-D integer tensor outside the known keys, one entry per sample (or per sample that has image
    tokens), summing to the batch's images."""
    if tokens is None or items == 0:
        return None
    carrying = int(tokens.any(dim=1).sum())
    known = {*ANCHOR_KEYS, *IMAGE_KEYS, *VIDEO_KEYS, "position_ids", "labels"}
    found = [key for key, value in batch.items()
             if key not in known and isinstance(value, Tensor) and value.dim() == 1 and not value.is_floating_point()
             and len(value) in (n, carrying) and int(value.sum()) == items and bool((value >= 0).all())]
    return found[0] if len(found) == 1 else None


def _counts_from_key(value: Tensor, tokens: Tensor) -> list[int] | None:
    carrying = tokens.any(dim=1).tolist()
    if len(value) == len(carrying):
        counts = [int(c) for c in value.tolist()]
    else:
        given = iter(value.tolist())
        counts = [int(next(given)) if has else 0 for has in carrying]
    return counts if all((c > 0) == has for c, has in zip(counts, carrying, strict=True)) else None


def _counts_by_size(per_sample: list[int], sizes: Tensor) -> list[int] | None:
    """Images per sample when each image's tokens are proportional to its area (``image_sizes`` [N, 2] of the
    processed images: Pixtral's rows of patches, whose break tokens split one image into several runs)."""
    if sizes.dim() != 2 or sizes.shape[-1] != 2 or not len(sizes):
        return None
    areas = [int(h) * int(w) for h, w in sizes.tolist()]
    total = sum(per_sample)
    if total == 0 or any(a * total % sum(areas) for a in areas):
        return None
    return _counts_by_token_length(per_sample, [a * total // sum(areas) for a in areas])


def _counts_by_fixed_length(per_sample: list[int], items: int) -> list[int] | None:
    total = sum(per_sample)
    if items == 0 or total % items:
        return None
    length = total // items
    if length == 0 or any(t % length for t in per_sample):
        return None
    return [t // length for t in per_sample]


def _counts_by_runs(tokens: Tensor) -> list[int]:
    starts = tokens.clone()
    starts[:, 1:] &= ~tokens[:, :-1]
    return starts.sum(dim=1).tolist()


def _generic_rule(value: Any, n: int, name: str) -> Rule:
    """Per-sample slicing for a value whose layout is one row (item) per sample; scalars go everywhere."""
    if isinstance(value, Tensor):
        if value.dim() == 0:
            return lambda g: value
        if value.shape[0] == n:
            return lambda g: _gather(value, g)
        raise BatchSplitError(
            f"cannot split the batch into micro-batches of samples: {name} has shape {tuple(value.shape)}, whose "
            f"first dimension is not the {n} samples, and vlmfast does not know its layout; {FIX}")
    if isinstance(value, SCALARS):
        return lambda g: value
    if isinstance(value, Mapping):
        rules = {k: _generic_rule(v, n, f"'{k}' in {name}") for k, v in value.items()}
        return lambda g: _rebuild(value, {k: r(g) for k, r in rules.items()})
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # namedtuple
        rules_nt = [_generic_rule(v, n, f"{name}.{f}") for f, v in zip(value._fields, value, strict=True)]
        return lambda g: type(value)(*(r(g) for r in rules_nt))
    if isinstance(value, (list, tuple)):
        if any(isinstance(v, Tensor) and v.dim() > 0 and v.shape[0] == n for v in value) or (
                len(value) != n and any(isinstance(v, Tensor) for v in value)):
            rules_seq = [_generic_rule(v, n, f"{name}[{i}]") for i, v in enumerate(value)]  # positional batch
            return lambda g: type(value)(r(g) for r in rules_seq)
        if len(value) == n:
            return lambda g: _gather(value, g)  # one item per sample (captions, per-sample tensors)
        raise BatchSplitError(
            f"cannot split the batch into micro-batches of samples: {name} is a {type(value).__name__} of "
            f"{len(value)} items for {n} samples, and vlmfast does not know its layout; {FIX}")
    raise BatchSplitError(f"cannot split the batch into micro-batches of samples: {name} is a {type(value).__name__}"
                          f", which vlmfast does not know how to split; {FIX}")
