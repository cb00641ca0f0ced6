"""A model's label conventions, measured once with tiny forward passes instead of guessed from its class name.

Exact gradient accumulation needs two facts about the model's own loss:

- **does it shift labels** (predict ``labels[t+1]`` at position ``t``, as causal LMs do)? The loss items are then
  ``labels[..., 1:] != ignore_index``, one fewer per row than without the shift. Measured with one sample whose
  labels are all ignored but one: at the *first* position, a shifting model has no target left (its loss is that
  of no labels at all: NaN, 0, or only its auxiliary terms), an unshifted one has one; at the *last* position both
  have one (which also proves that the model reads the labels at all).
- **does it honour ``num_items_in_batch``** (divide its summed loss by that count, the Hugging Face convention)?
  Measured by calling it with a count and with twice that count: an honouring model's loss halves; one that
  ignores the argument (``**kwargs`` that go nowhere) returns the same loss; one that refuses it raises TypeError.

The probes run once per model (cached), in eval mode without gradients and with the random state restored, so
training is unchanged by them. A model may *declare* ``loss_shifts_labels = True/False``; that is used only when the
probe cannot decide, and ``loss.shift_labels: yes/no`` in the spec overrides both. When nothing decides, the error
asks for the field.

Usage::

    conventions = probe_label_conventions(model, micro_batch)      # any batch the model trains on
    conventions.shifts_labels, conventions.honours_num_items, conventions.describe()
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from accelerate.utils import send_to_device
from torch import nn

__all__ = ["EmptyBatchError", "LabelConventionError", "LabelConventions", "forget", "probe_label_conventions",
           "refuse_empty", "synthetic_probe_batch", "unwrap_model"]

_CACHE: weakref.WeakKeyDictionary[nn.Module, LabelConventions] = weakref.WeakKeyDictionary()


class LabelConventionError(ValueError):
    """The probe could not tell how the model treats its labels; the message asks for ``loss.shift_labels``."""


class EmptyBatchError(ValueError):
    """A collated micro-batch with zero rows (a collate_fn that dropped every sample)."""


def refuse_empty(batch: Any, where: str) -> None:
    """Raise :class:`EmptyBatchError` naming `where` when a collated dict batch holds zero rows (its text keys, else
    its first tensor, have length 0 in dim 0), before a model or a probe indexes row 0 of it."""
    from vlmfast.data.batch import batch_size_of

    if not isinstance(batch, Mapping):
        return
    try:
        rows = batch_size_of(batch)
    except (TypeError, IndexError):  # no tensor at all: not a row layout this check knows
        return
    if rows == 0:
        shapes = ", ".join(f"{key} {tuple(value.shape)}" for key, value in batch.items()
                           if isinstance(value, torch.Tensor))
        raise EmptyBatchError(f"{where} has zero rows ({shapes}): the collate_fn returned no row for its samples; "
                              "it must return one row (or more) per sample (drop bad samples in the dataset instead)")


@dataclass(frozen=True)
class LabelConventions:
    """What the probe found (or what the spec / the model said), and how each fact was decided."""

    shifts_labels: bool
    honours_num_items: bool
    shift_source: str  # "measured", "loss.shift_labels", "declared by the model"
    num_items_source: str  # "measured", "refused (TypeError)", "not probed"

    def describe(self) -> str:
        shift = "shifted" if self.shifts_labels else "not shifted"
        items = "honoured" if self.honours_num_items else "not honoured"
        return f"labels {shift} ({self.shift_source}), num_items_in_batch {items} ({self.num_items_source})"


def unwrap_model(model: nn.Module) -> nn.Module:
    """The user's module under DDP (``.module``) and torch.compile (``._orig_mod``) wrappers."""
    for attribute in ("module", "_orig_mod"):
        inner = getattr(model, attribute, None)
        if isinstance(inner, nn.Module):
            model = inner
    return model


def probe_label_conventions(
    model: nn.Module,
    batch: Any,
    *,
    label_key: str = "labels",
    ignore_index: int = -100,
    shift_labels: bool | None = None,
    probe_num_items: bool = True,
    call: Callable[[nn.Module, Any], Any] | None = None,
) -> LabelConventions:
    """Measure (once per model; cached) whether ``model`` shifts labels and honours ``num_items_in_batch``.

    ``batch``: a collated micro-batch (a dict with ``label_key``) the model trains on; its first sample is used.
    ``shift_labels``: the spec's answer (skips that probe). ``call(model, batch) -> output``: how the loss is
    computed (default ``model(**batch)``; a loss_fn otherwise, then num_items_in_batch is not probed).
    Usage: ``probe_label_conventions(model, next(iter(loader)))``
    """
    model = unwrap_model(model)
    cached = _CACHE.get(model) if call is None else None  # a loss_fn's conventions are its own: not cached
    if cached is not None and (shift_labels is None or cached.shifts_labels == shift_labels):
        return cached
    sample = _first_sample(batch, label_key, model)
    run = _Runner(model, call)
    with run.quietly():
        if shift_labels is not None:
            shifts, source = shift_labels, "loss.shift_labels"
        else:
            shifts, source = _probe_shift(run, sample, label_key, ignore_index, model)
        honours, items_source = False, "not probed"
        if probe_num_items and call is None:
            honours, items_source = _probe_num_items(run, sample)
    result = LabelConventions(shifts, honours, source, items_source)
    if call is None:
        _CACHE[model] = result
    return result


def _first_sample(batch: Any, label_key: str, model: nn.Module) -> dict[str, Any]:
    """One sample of ``batch``, collated alone (or the whole batch when it cannot be split by sample)."""
    from vlmfast.data.batch_layout import BatchLayout, BatchSplitError, split_collated
    from vlmfast.data.micro_batches import SampleBatch

    if isinstance(batch, SampleBatch):  # collated here, leaving the batch's own micro-batches untouched
        batch = batch.first(1)
    if not isinstance(batch, Mapping):
        raise LabelConventionError(f"the label probe needs a dict batch with '{label_key}', got a "
                                   f"{type(batch).__name__}: set loss.shift_labels (yes or no) in the spec")
    refuse_empty(batch, "the label probe's micro-batch")
    try:
        rows = split_collated(batch, 1, BatchLayout.from_model(model))
    except BatchSplitError:
        return dict(batch)
    mask = [r.get("attention_mask") for r in rows]
    # A row whose first position is real text (not left padding) makes the first-position probe unambiguous.
    chosen = next((r for r, m in zip(rows, mask, strict=True) if isinstance(m, torch.Tensor) and m.flatten()[0]),
                  rows[0])
    return dict(chosen)


class _Runner:
    """Calls the model on probe inputs: on its device and dtype, eval mode, no grad, random state untouched."""

    def __init__(self, model: nn.Module, call: Callable[[nn.Module, Any], Any] | None) -> None:
        self.model = model
        self.call = call
        param = next((p for p in model.parameters() if p.is_floating_point()), None)
        self.device = param.device if param is not None else torch.device("cpu")
        self.dtype = param.dtype if param is not None else torch.float32

    def quietly(self) -> Any:
        devices = [self.device] if self.device.type == "cuda" else []
        return _Quiet(self.model, devices)

    def loss(self, batch: dict[str, Any], **extra: Any) -> float:
        from vlmfast.models.outputs import call_model, extract_loss

        batch = send_to_device(batch, self.device)
        if self.dtype in (torch.bfloat16, torch.float16):  # weights cast by the backend (DeepSpeed): inputs too
            batch = {k: v.to(self.dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                     for k, v in batch.items()}
        if self.call is not None:
            result = self.call(self.model, batch)
            loss = result[0] if isinstance(result, (tuple, list)) else extract_loss(result)
        else:
            loss = extract_loss(call_model(self.model, batch, **extra))
        return float(loss.detach().float())


class _Quiet:
    def __init__(self, model: nn.Module, devices: list[torch.device]) -> None:
        self.model, self.devices = model, devices

    def __enter__(self) -> None:
        self.was_training = self.model.training
        self.rng = torch.random.fork_rng(devices=self.devices)
        self.rng.__enter__()
        self.grad = torch.no_grad()
        self.grad.__enter__()
        self.model.eval()

    def __exit__(self, *exc: Any) -> None:
        self.model.train(self.was_training)
        self.grad.__exit__(*exc)
        self.rng.__exit__(*exc)


def _with_labels(sample: dict[str, Any], label_key: str, labels: torch.Tensor) -> dict[str, Any]:
    out = dict(sample)
    out[label_key] = labels
    return out


def _same(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return abs(a - b) <= 1e-6 * max(1.0, abs(a), abs(b))


def _probe_shift(run: _Runner, sample: dict[str, Any], label_key: str, ignore_index: int,
                 model: nn.Module) -> tuple[bool, str]:
    labels = sample.get(label_key)
    if not isinstance(labels, torch.Tensor) or labels.dim() < 1 or labels.shape[-1] < 3:
        return _declared_or_ask(model, f"the batch has no '{label_key}' tensor of at least 3 positions to probe with")
    target = _a_valid_target(labels, sample, ignore_index)
    first, last, none = (labels.new_full(labels.shape, ignore_index) for _ in range(3))
    first[..., 0] = target
    last[..., -1] = target
    try:
        loss_none = run.loss(_with_labels(sample, label_key, none))
        loss_first = run.loss(_with_labels(sample, label_key, first))
        loss_last = run.loss(_with_labels(sample, label_key, last))
    except Exception as exc:  # a model that cannot run on one sample with these labels
        from vlmfast.memory.oom_errors import is_oom_error
        from vlmfast.models.outputs import NoLossError

        if is_oom_error(exc) or isinstance(exc, NoLossError):  # the OOM fallback's business / no loss at all:
            raise  # loss.shift_labels would not help, a loss_fn would (the message says so)
        return _declared_or_ask(model, f"the probe forward raised {type(exc).__name__}: {exc}", cause=exc)
    reads_labels = not _same(loss_last, loss_none)
    if reads_labels and _same(loss_first, loss_none):
        return True, "measured"
    if reads_labels and not _same(loss_first, loss_none) and math.isfinite(loss_first):
        return False, "measured"
    return _declared_or_ask(model, f"its loss with one label at the first / last position / none was "
                                   f"{loss_first:.4g} / {loss_last:.4g} / {loss_none:.4g}")


def _a_valid_target(labels: torch.Tensor, sample: dict[str, Any], ignore_index: int) -> int:
    """A token id the model can predict: one of the sample's own targets, else its first input token."""
    real = labels[labels != ignore_index]
    if real.numel():
        return int(real[-1])
    ids = sample.get("input_ids")
    return int(ids.flatten()[0]) if isinstance(ids, torch.Tensor) and ids.numel() else 0


def _declared_or_ask(model: nn.Module, why: str, cause: BaseException | None = None) -> tuple[bool, str]:
    """The model's own ``loss_shifts_labels``, else a LabelConventionError saying `why` (chained to `cause`, the
    exception raised inside the model, so VLMFAST_TRACEBACK=1 shows its frame)."""
    declared = getattr(model, "loss_shifts_labels", None)
    if declared is not None:
        return bool(declared), "declared by the model"
    raise LabelConventionError(
        f"cannot tell whether {type(model).__name__} shifts its labels (predicts labels[t+1] at t): {why}. "
        "Set loss.shift_labels: yes (causal LMs) or no in the spec") from cause


def _probe_num_items(run: _Runner, sample: dict[str, Any]) -> tuple[bool, str]:
    if not _takes_keyword(run.model, "num_items_in_batch"):
        return False, "not a forward argument"
    try:
        once = run.loss(sample, num_items_in_batch=7)
        twice = run.loss(sample, num_items_in_batch=14)
    except TypeError:
        return False, "refused (TypeError)"
    except Exception as exc:  # e.g. a model that passes unknown kwargs on to a module that rejects them
        from vlmfast.memory.oom_errors import is_oom_error

        if is_oom_error(exc):
            raise
        return False, f"not honoured: the forward raised {type(exc).__name__}"
    if math.isfinite(once) and once != 0 and abs(twice / once - 0.5) < 1e-4:
        return True, "measured"
    return False, "measured"


def _takes_keyword(model: nn.Module, name: str) -> bool:
    import inspect

    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return True  # cannot tell: let the call say
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


def synthetic_probe_batch(model: nn.Module, length: int = 8) -> dict[str, torch.Tensor] | None:
    """One text-only sample for a model with token embeddings (Hugging Face style), or None when it has none.

    Token ids avoid every special id the config names (image, video, pad ...), so a VLM runs it as text.
    Usage: ``probe_label_conventions(model, synthetic_probe_batch(model))``
    """
    model = unwrap_model(model)
    get = getattr(model, "get_input_embeddings", None)
    embeddings = get() if callable(get) else None
    vocab = getattr(embeddings, "num_embeddings", None)
    if not isinstance(vocab, int) or vocab < 4:
        return None
    special = _special_ids(getattr(model, "config", None))
    ids = [i for i in range(1, min(vocab, 64 + len(special))) if i not in special][:length]
    if len(ids) < 3:
        return None
    input_ids = torch.tensor([ids])
    return {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone()}


def _special_ids(config: Any, depth: int = 0) -> set[int]:
    found: set[int] = set()
    if config is None or depth > 2:
        return found
    for name, value in vars(config).items() if hasattr(config, "__dict__") else ():
        if name.endswith(("token_id", "token_index", "token_ids")):
            for v in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(v, int):
                    found.add(v)
        elif hasattr(value, "to_dict") and not isinstance(value, type):
            found |= _special_ids(value, depth + 1)
    return found


def forget(model: nn.Module) -> None:
    """Drop the cached conventions of ``model`` (tests; a model whose loss was changed in place)."""
    _CACHE.pop(unwrap_model(model), None)

