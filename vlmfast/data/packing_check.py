"""Is packing exact for this model? Measured once, on a few real samples, before training starts.

Whether a model keeps packed documents apart depends on code vlmfast does not own: which attention mask a Hugging
Face model builds from ``position_ids`` (and whether another mask, such as PaliGemma's prefix-LM mask over
``token_type_ids``, is laid over the whole row), whether a custom model reads ``position_ids`` at all. Guessing from
class names would be wrong for the next model, so the trainer measures it: a few samples are packed into a single
row and the model's outputs for each document are compared with the padded batch's (no gradient, eval mode, the
RNG untouched). A mismatch refuses packing at trainer construction, naming ``packing`` and the size of the
difference; layouts packing cannot keep per document (cross-attention masks, batches without token sequences) are
refused earlier still, by the collator (:class:`vlmfast.data.packing.PackingError`).

Usage::

    collate = build_packing_collator(spec.packing, model, my_collate)
    check_packing(model, [dataset[i] for i in range(4)], collate)   # raises PackingError if not exact
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from vlmfast.data.batch import move_to_device
from vlmfast.data.packing import PackingCollator, PackingError

__all__ = ["check_packing", "choose_packing_level", "probe_samples"]

logger = logging.getLogger(__name__)

PROBE_SAMPLES = 4
TOLERANCE = {torch.float32: 1e-3, torch.float64: 1e-3}  # fp32 differences measured: ~2e-7 of the largest logit
HALF_TOLERANCE = 2e-2  # bf16 / fp16 weights: rounding alone reaches ~1e-2


def probe_samples(data: Any, count: int = PROBE_SAMPLES) -> list[Any]:
    """The first ``count`` samples of a dataset (indexable, or iterable: a fresh iterator); [] for a DataLoader."""
    if isinstance(data, torch.utils.data.DataLoader):
        return []
    if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
        return [data[i] for i in range(min(count, len(data)))]
    if iter(data) is data:  # a one-shot iterator: probing would take samples away from training
        logger.warning("packing: not verified on this model (the training data is a one-shot iterator, so no sample "
                       "can be spared for the check); pass a Dataset to have packing checked before training")
        return []
    samples = []
    for sample in data:
        samples.append(sample)
        if len(samples) == count:
            break
    return samples


def check_packing(model: nn.Module, samples: Sequence[Any], collate: PackingCollator, *,
                  loss_fn: Callable[[nn.Module, Any], Any] | None = None,
                  device: torch.device | None = None) -> float:
    """Pack ``samples`` into one row; raise :class:`PackingError` unless every document's outputs equal the padded
    batch's (logits where the model returns them, else the loss). Returns the measured relative difference."""
    if collate.collate_fn is None or not samples:
        return 0.0  # documents given directly: there is no padded batch to compare with
    padded = collate.collate_fn(list(samples))
    one_row = dataclasses.replace(collate, max_tokens=1 << 30, pad_to_max_tokens=False)
    packed = [one_row.pack(list(samples))]  # layouts packing cannot keep are refused here (PackingError)
    lengths = packed[0].document_lengths[0]
    # and two rows of several documents: a kernel that tells documents apart on one row only (Hugging Face's flash
    # path reads packed positions at batch size 1) is caught here, not in training
    halves = dataclasses.replace(one_row, max_tokens=max(max(lengths), -(-sum(lengths) // 2)))
    packed.append(halves.pack(list(samples)))
    device = device or next((p.device for p in model.parameters()), torch.device("cpu"))
    outputs = _forward(model, [padded], loss_fn, device)
    try:
        outputs += _forward(model, [p.tensors for p in packed], loss_fn, device)
    except (RuntimeError, ValueError, TypeError, IndexError) as error:  # the padded batch ran: packing broke it
        raise PackingError(
            f"packing: {type(model).__name__} fails on packed rows ({type(error).__name__}: {error}); the packed "
            f"batch has {_shapes(packed[0].tensors)}. Check packing.image_layout (auto keeps the layout the model "
            "takes) or set packing.enabled: false") from error
    measured = [_difference([outputs[0], out], padded, p.rows, _placeholders(p, collate, padded))
                for out, p in zip(outputs[1:], packed, strict=True)]
    error, what = max(measured)
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    tolerance = TOLERANCE.get(dtype, HALF_TOLERANCE)
    if not error <= tolerance:
        raise PackingError(
            f"packing is not exact for {type(model).__name__}: packed into one row and into two, {len(samples)} "
            f"samples give "
            f"{what} {error:.1e} away from the padded batch's (tolerance {tolerance:.0e}). Its attention is not "
            "restricted to each document: e.g. a prefix-LM mask over token_type_ids laid over the whole row "
            "(PaliGemma: every document's prefix sees the others'), a model that ignores position_ids, or a flash "
            "kernel that reads packed positions on a single row only (Hugging Face's flash_attention_2). Training "
            "would be silently wrong; set packing.level: embeddings (or auto) to pack where the language model takes "
            "its embeddings, or packing.enabled: false (data.group_by_length also cuts padding)")
    return error


def _forward(model: nn.Module, batches: list[Any], loss_fn: Callable[[nn.Module, Any], Any] | None,
             device: torch.device) -> list[Any]:
    was_training = model.training
    devices = [device] if device.type == "cuda" else []
    model.eval()
    try:
        with torch.no_grad(), torch.random.fork_rng(devices=devices):
            return [loss_fn(model, b) if loss_fn else model(**b) for b in (move_to_device(x, device) for x in batches)]
    finally:
        model.train(was_training)


def _shapes(batch: Mapping[str, Any]) -> str:
    return ", ".join(f"{k} {tuple(v.shape)}" for k, v in batch.items() if isinstance(v, Tensor))


def _logits(output: Any) -> Tensor | None:
    value = output.get("logits") if isinstance(output, Mapping) else getattr(output, "logits", None)
    if value is None and isinstance(output, Tensor) and output.dim() == 3:
        value = output
    return value if isinstance(value, Tensor) else None


def _loss(output: Any) -> Tensor:
    if isinstance(output, tuple):  # loss_fn's (loss_sum, n_items)
        return output[0].float() / max(float(output[1]), 1.0)
    value = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", output)
    if not isinstance(value, Tensor):
        raise PackingError(f"packing: cannot compare {type(output).__name__} outputs of packed and padded batches: "
                           "return logits or a loss")
    return value.float()


def _placeholders(packed: Any, collate: PackingCollator, padded: Mapping[str, Any]) -> list[int]:
    """Image placeholder tokens each document starts with in the packed row (models whose images precede the text)."""
    if not collate.image_tokens:
        return [0] * int(padded["input_ids"].shape[0])
    key = next(k for k in collate.image_keys if k in padded)
    per_sample = padded[key].shape[0] == padded["input_ids"].shape[0]  # one image per sample (the tiny VLM)
    return [collate.image_tokens if per_sample else 0 for _ in range(int(padded["input_ids"].shape[0]))]


def _difference(outputs: list[Any], padded: Mapping[str, Any], rows: list[list[int]],
                placeholders: list[int]) -> tuple[float, str]:
    """Largest difference of each document's logits (relative to the largest padded logit), else of the loss."""
    logits_padded, logits_packed = (_logits(o) for o in outputs)
    mask = padded["attention_mask"]
    lengths = mask.sum(-1).tolist()
    first = (mask.ne(0).int().argmax(dim=-1) * mask.sum(-1).ne(0)).tolist()  # left-padded rows start later
    aligned = (logits_padded is not None and logits_packed is not None
               and logits_padded.shape[1] == padded["input_ids"].shape[1])
    if not aligned:
        a, b = (_loss(o) for o in outputs)
        return float((a - b).abs() / a.abs().clamp_min(1e-12)), "a loss"
    assert logits_padded is not None and logits_packed is not None
    worst = 0.0
    for r, row in enumerate(rows):
        start = 0
        for i in row:
            begin = start + placeholders[i]
            here = logits_packed[r, begin : begin + lengths[i]].float()
            worst = max(worst, float((here - logits_padded[i, first[i]: first[i] + lengths[i]].float()).abs().max()))
            start = begin + lengths[i]
    return worst / max(float(logits_padded.float().abs().max()), 1e-12), "logits"


def choose_packing_level(model: nn.Module, spec: Any, samples: Sequence[Any],
                         collate_fn: Callable[[list[Any]], Any] | None, *,
                         loss_fn: Callable[[nn.Module, Any], Any] | None = None) -> tuple[str, str]:
    """``packing.level: auto``: ``("ids", "")`` when id-level packing is measured exact on ``samples`` (the loader
    packs: cheapest), else ``("embeddings", why ids were refused)``; packing by embeddings is then checked itself.

    Usage: ``level, why = choose_packing_level(model, spec.packing, probe_samples(data), collate_fn)``
    """
    from vlmfast.data.packing import build_packing_collator

    if not samples:  # nothing to measure either level on: ids, unverified, as `level: ids` would be
        logger.warning("packing.level auto: no samples can be spared to measure packing (a DataLoader or a stream): "
                       "id-level packing, not verified; pass a Dataset to have it checked")
        return "ids", ""
    try:
        check_packing(model, samples, build_packing_collator(spec, model, collate_fn), loss_fn=loss_fn)
    except PackingError as refused:
        return "embeddings", str(refused)
    return "ids", ""
