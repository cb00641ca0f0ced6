"""Cheap host-side checks of every batch, so a bad sample is named where it is read, not deep inside torch.

What is checked (on CPU tensors only: nothing is copied from or synchronised with a device):

- token ids (``input_ids``) and labels are integers: a float ``input_ids`` sample otherwise fails inside the
  embedding with a traceback about dtypes;
- token ids are below the vocabulary (or one of the special ids the model's config declares, e.g.
  ``image_token_id``), and labels are ``ignore_index`` or in ``[0, vocab)``, when the model's vocabulary is known
  (``get_input_embeddings()``, ``config.vocab_size``, else the first embedding a probe batch's ids reach in the
  forward): an id beyond the vocabulary is otherwise an index error
  deep in the embedding (on CUDA, a device-side assert that kills the process). Negative token ids are left alone:
  models use them as image placeholders (LLaVA's -200);
- pixel values (floating tensors under a key containing ``pixel`` or ``image``) are finite: one NaN image otherwise
  turns the whole step's loss into NaN, and ``loss.on_nonfinite: skip`` drops every good sample with it.

The loader runs :meth:`SampleCheck.problem` on each collated batch (one pass over its ids and pixels, a fraction of
a millisecond for typical batches). Only when a batch fails does it look for the samples at fault, collating each
alone; with ``data.check_samples: skip`` they are dropped and counted as bad samples
(``vlmfast.data.bad_samples``), with ``error`` the run stops naming the first one.

Usage::

    check = SampleCheck.for_model(model, label_key="labels", ignore_index=-100)
    check.problem({"input_ids": torch.tensor([[1.0, 2.0]])})   # "input_ids has dtype torch.float32: ..."
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

TOKEN_KEYS = ("input_ids",)
IMAGE_KEY_PARTS = ("pixel", "image")


@dataclass(frozen=True)
class SampleCheck:
    """What a batch must satisfy; `vocab_size` None skips the range checks (dtype and finiteness still run)."""

    vocab_size: int | None = None
    label_key: str = "labels"
    ignore_index: int = -100
    label_vocab_size: int | None = None  # the output vocabulary, when it differs from the input one
    special_ids: frozenset[int] = frozenset()  # ids at or beyond the vocabulary the model replaces itself

    @classmethod
    def for_model(cls, model: nn.Module, label_key: str = "labels", ignore_index: int = -100,
                  probe_batch: Callable[[], Any] | None = None) -> SampleCheck:
        """The check with `model`'s vocabulary: read off the model, else learned from the first embedding a probe
        batch's ids reach (`probe_batch` returns one collated batch on the model's device, or None)."""
        vocab, out_vocab = vocabulary_sizes(model)
        if vocab is None and probe_batch is not None:
            vocab = embedding_reached_by_ids(model, probe_batch())
        return cls(vocab, label_key, ignore_index, out_vocab, special_token_ids(model))

    def problem(self, batch: Any) -> str | None:
        """Why `batch` (a collated batch, its micro-batches, or one sample) cannot be trained on, or None."""
        parts = getattr(batch, "micro_batches", None)  # a SampleBatch: collated per micro-batch in the workers
        if parts is not None:
            return next((why for part in parts if (why := self.problem(part)) is not None), None)
        if not isinstance(batch, Mapping):
            return None
        for key in TOKEN_KEYS:
            reason = _ids_problem(key, batch.get(key), self.vocab_size, None, self.special_ids)
            if reason:
                return reason
        labels_vocab = self.label_vocab_size or self.vocab_size
        reason = _ids_problem(self.label_key, batch.get(self.label_key), labels_vocab, self.ignore_index, frozenset())
        if reason:
            return reason
        for key, tensor in _image_tensors(batch):
            # One float32 sum is finite when every value is (and ~50x cheaper than isfinite().all()); only a
            # non-finite sum (a NaN/Inf, or an overflow of huge values) is looked at element by element.
            if not math.isfinite(float(tensor.sum(dtype=torch.float32))):
                bad = int((~torch.isfinite(tensor)).sum())
                if bad:
                    return f"'{key}' holds {bad} NaN/Inf value(s): pixel values must be finite"
        return None


def _ids_problem(key: str, ids: Any, vocab: int | None, ignore_index: int | None,
                 special: frozenset[int]) -> str | None:
    """Labels (`ignore_index` given): ignore_index or in [0, vocab). Token ids: below vocab or special."""
    if not isinstance(ids, torch.Tensor) or ids.device.type != "cpu" or ids.numel() == 0:
        return None
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        return (f"'{key}' has dtype {ids.dtype}: token ids must be integers (torch.long); convert them in the "
                "dataset or collate_fn")
    labels = ignore_index is not None
    values = torch.where(ids == ignore_index, 0, ids) if labels else ids  # cheaper than masking them out
    low, high = (int(v) for v in torch.aminmax(values))
    what = f"labels (other than loss.ignore_index {ignore_index})" if labels else "token ids"
    if labels and low < 0:
        return f"'{key}' holds {low}: {what} must be >= 0"
    if vocab is not None and high >= vocab:
        beyond = ids[ids >= vocab]
        if special:
            beyond = beyond[~torch.isin(beyond, torch.tensor(sorted(special), dtype=beyond.dtype))]
        if beyond.numel():
            return (f"'{key}' holds {int(beyond.max())}, beyond the model's vocabulary of {vocab}: {what} must be "
                    "below it (a tokenizer that does not match the model?)")
    return None


def _image_tensors(batch: Mapping[str, Any]) -> Iterator[tuple[str, torch.Tensor]]:
    for key, value in batch.items():
        if not any(part in str(key).lower() for part in IMAGE_KEY_PARTS):
            continue
        items = value if isinstance(value, (list, tuple)) else [value]
        for item in items:
            if isinstance(item, torch.Tensor) and item.is_floating_point() and item.device.type == "cpu":
                yield str(key), item


class _Reached(Exception):
    """Stops the probe forward at the embedding the ids reach: nothing after it runs."""


def embedding_reached_by_ids(model: nn.Module, batch: Any, key: str = "input_ids") -> int | None:
    """The size of the first ``nn.Embedding`` that `batch[key]` reaches in `model`'s forward, or None
    (:func:`embedding_module_reached_by_ids`)."""
    module = embedding_module_reached_by_ids(model, batch, key)
    return module.num_embeddings if module is not None else None


def embedding_module_reached_by_ids(model: nn.Module, batch: Any, key: str = "input_ids") -> nn.Embedding | None:
    """The first ``nn.Embedding`` that `batch[key]` reaches in `model`'s forward, or None.

    Learned, not guessed from names: a forward pre-hook on every embedding; the first one whose input holds the
    batch's ids (the tensor itself, or equal wherever the ids are valid rows: a model may first replace placeholder
    ids such as LLaVA's -200) ends the forward there. Nothing runs past that embedding (no gradient, no statistics)."""
    ids = batch.get(key) if isinstance(batch, Mapping) else None
    if not isinstance(ids, torch.Tensor) or ids.is_floating_point():
        return None
    found: list[nn.Embedding] = []

    def reached(module: nn.Embedding, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        given = args[0] if args else kwargs.get("input")
        if isinstance(given, torch.Tensor) and _same_ids(given, ids, module.num_embeddings):
            found.append(module)
            raise _Reached

    hooks = [m.register_forward_pre_hook(reached, with_kwargs=True) for m in model.modules()
             if isinstance(m, nn.Embedding)]
    modes = [(m, m.training) for m in model.modules()]
    model.eval()  # a tower that runs before the embedding keeps its statistics
    try:
        with torch.no_grad():
            model(**batch)
    except _Reached:
        pass
    except Exception:  # the probe is best effort: without it, ids are not range-checked (as before)
        return None
    finally:
        for hook in hooks:
            hook.remove()
        for module, training in modes:
            module.training = training
    return found[0] if found else None


def _same_ids(given: torch.Tensor, ids: torch.Tensor, rows: int) -> bool:
    if given is ids:
        return True
    if given.shape != ids.shape or given.is_floating_point() or given.device != ids.device:
        return False
    valid = (ids >= 0) & (ids < rows)
    return bool(valid.any()) and torch.equal(given[valid], ids[valid])


def special_token_ids(model: nn.Module) -> frozenset[int]:
    """Ids the model's config declares for special tokens (``image_token_id``, ``video_token_index``, ...)."""
    model = getattr(getattr(model, "module", model), "_orig_mod", getattr(model, "module", model))
    config = getattr(model, "config", None)
    found = set()
    for source in (config, getattr(config, "text_config", None)):
        for name, value in (vars(source).items() if source is not None and hasattr(source, "__dict__") else ()):
            if name.endswith(("_token_id", "_token_index")) and isinstance(value, int) and not isinstance(value, bool):
                found.add(value)
    return frozenset(found)


def vocabulary_sizes(model: nn.Module) -> tuple[int | None, int | None]:
    """(input vocabulary, output vocabulary) of a language model, or None where the model does not say."""
    model = getattr(model, "module", model)  # DDP, DeepSpeed
    model = getattr(model, "_orig_mod", model)  # torch.compile
    vocab = out_vocab = None
    get_in = getattr(model, "get_input_embeddings", None)
    if callable(get_in):
        try:
            embedding = get_in()
            vocab = getattr(embedding, "num_embeddings", None)
        except (NotImplementedError, AttributeError):
            vocab = None
    get_out = getattr(model, "get_output_embeddings", None)
    if callable(get_out):
        try:
            head = get_out()
            out_vocab = getattr(head, "out_features", None)
        except (NotImplementedError, AttributeError):
            out_vocab = None
    config = getattr(model, "config", None)
    for source in (config, getattr(config, "text_config", None)):
        if vocab is None and isinstance(getattr(source, "vocab_size", None), int):
            vocab = source.vocab_size
    return vocab, out_vocab if out_vocab and out_vocab != vocab else None
