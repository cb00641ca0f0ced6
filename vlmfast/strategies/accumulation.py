"""Gradient accumulation whose gradient does not depend on the micro-batch split.

Each micro-batch contributes ``loss_sum_i / N`` where ``N`` is the number of loss items (label tokens, or samples)
in the whole optimizer batch across ranks: the sum over micro-batches is then the full-batch mean, for any split
and any sequence lengths (dividing each micro-batch mean by the number of micro-batches is wrong for token losses:
transformers#24725). ``N`` is counted on the host batch before the forward pass, so no device sync is needed.
When only the loss function knows its item count (``loss_fn`` returning ``(loss_sum, n_items)`` on a batch
without labels), a provisional ``N`` is used and the gradients are rescaled once after the last micro-batch.

Usage in a hand-written loop::

    loss = accumulate_gradients(model, batch, micro_batch_size=2)   # .backward() per micro-batch, exact weights
    optimizer.step(); optimizer.zero_grad()
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vlmfast.common.utils import unwrap_model
from vlmfast.data.batch import batch_size_of, host_micro_batches, move_to_device
from vlmfast.data.batch_layout import BatchLayout
from vlmfast.data.micro_batches import split_micro_batches
from vlmfast.engines.collectives import all_reduce_sum, gather_objects, sum_and_max, sum_loss_and_flags, world_size
from vlmfast.engines.foreign_loops import (
    after_agreement,
    check_loop,
    loop_backward,
    loop_forward_context,
    loop_of,
    no_sync,
)
from vlmfast.models.conventions import LabelConventionError, LabelConventions, probe_label_conventions, refuse_empty
from vlmfast.models.outputs import call_model, extract_loss
from vlmfast.strategies.base import Step, Strategy

log = logging.getLogger(__name__)
LossFn = Callable[[nn.Module, Any], "torch.Tensor | tuple[torch.Tensor, Any]"]


def count_loss_tokens(
    batch: Any, label_key: str = "labels", ignore_index: int = -100, shift: bool = False
) -> int | None:
    """Label tokens that carry a loss (``labels[..., 1:]`` when the model shifts them), or None without labels."""
    if not isinstance(batch, Mapping):
        return None
    labels = batch.get("shift_labels")
    if labels is None:
        labels = batch.get(label_key)
        if isinstance(labels, torch.Tensor) and shift:
            labels = labels[..., 1:]
    if not isinstance(labels, torch.Tensor):
        return None
    return int((labels != ignore_index).sum())


def model_shifts_labels(model: nn.Module, batch: Any = None, *, label_key: str = "labels",
                        ignore_index: int = -100) -> bool:
    """Whether the model's own loss predicts labels[t+1] at t: measured on ``batch`` (or, for a model with token
    embeddings, on a synthetic text sample) by :mod:`vlmfast.models.conventions`; raises when it cannot decide."""
    from vlmfast.models.conventions import LabelConventionError, probe_label_conventions, synthetic_probe_batch

    batch = batch if batch is not None else synthetic_probe_batch(model)
    if batch is None:
        declared = getattr(getattr(model, "module", model), "loss_shifts_labels", None)
        if declared is not None:
            return bool(declared)
        raise LabelConventionError(f"cannot probe {type(model).__name__} without a batch: pass one, or set "
                                   "loss.shift_labels (yes or no) in the spec")
    return probe_label_conventions(model, batch, label_key=label_key, ignore_index=ignore_index).shifts_labels


def model_accepts_num_items(model: nn.Module, batch: Any = None) -> bool:
    """Whether the model honours `num_items_in_batch` (its loss halves when the count doubles): measured on
    ``batch`` or a synthetic text sample; False when it cannot be measured (weighting its mean is exact then)."""
    from vlmfast.models.conventions import probe_label_conventions, synthetic_probe_batch

    params = inspect.signature(getattr(model, "module", model).forward).parameters
    if "num_items_in_batch" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return False
    batch = batch if batch is not None else synthetic_probe_batch(model)
    if batch is None:
        return False
    return probe_label_conventions(model, batch).honours_num_items


@dataclass
class AccumulationPlan:
    """How one optimizer batch is split and weighted.

    Every rank runs the same number of micro-batches (agreed before the first forward): a rank with fewer repeats
    one of its own with weight 0 (`padding`), so ranks issue the same collectives whatever their data.
    """

    micro_batches: list[Any]
    weighting: str  # "tokens" or "samples"
    items: list[int | None]  # loss items per micro-batch when countable before forward (0 for padding)
    divisor: float  # N: loss items in the whole batch across ranks (provisional when not exact)
    exact: bool  # divisor is the real count: no correction after backward
    padding: int = 0  # leading zero-weight micro-batches added for rank symmetry
    reported_items: list[Any] = field(default_factory=list)  # counts returned by loss_fn, filled during the step

    @property
    def last(self) -> int:
        return len(self.micro_batches) - 1

    def is_padding(self, index: int) -> bool:
        return index < self.padding


class GradientAccumulation(Strategy):
    """Splits the optimizer batch into micro-batches and weights each one so the gradient is the full-batch one."""

    name = "accumulation"

    def __init__(
        self,
        *,
        weighting: str = "auto",
        label_key: str = "labels",
        ignore_index: int = -100,
        shift_labels: str | bool = "auto",
        loss_fn: LossFn | None = None,
    ) -> None:
        self.weighting = weighting
        self.label_key = label_key
        self.ignore_index = ignore_index
        self.shift_labels = shift_labels
        self.loss_fn = loss_fn
        self.passes_num_items = False
        self.last_split = (0, 0, 0)  # (micro-batches, size, last one's size) of the last plan: for the report
        self.batchnorm: list[str] = []  # BatchNorm layers in training mode change with the split: warned once
        self.resolved_weighting = weighting
        self.model: nn.Module | None = None
        self.layout: BatchLayout | None = None
        self.conventions: LabelConventions | None = None
        self.padding_checked = False  # loss tokens on padding: looked for in the first batch

    def apply(self, model: nn.Module) -> nn.Module:
        # Measured, not guessed: on the first batch's first micro-batch (vlmfast.models.conventions), see plan().
        self.model = model
        self.layout = BatchLayout.from_model(model)  # image / video token ids for splitting collated batches
        if isinstance(self.shift_labels, str) and self.shift_labels != "auto":
            self.shift_labels = self.shift_labels == "yes"
        self.batchnorm = batchnorm_layers(model)
        return model

    def resolve_conventions(self, micro_batches: list[Any]) -> None:
        """Probe once whether the model shifts labels and honours num_items_in_batch (when labels are counted).

        Every rank probes its first micro-batch wide enough to probe with (labels of >= 3 positions), then all
        ranks take one verdict: rank 0's, else the first rank's that could decide; refused on every rank alike
        when none could. So a rank whose first samples happen to be too short never decides alone, or dies alone."""
        if self.conventions is not None or self.model is None:
            return
        labelled = [mb for mb in micro_batches
                    if isinstance(mb, Mapping) and isinstance(mb.get(self.label_key), torch.Tensor)]
        if not labelled:
            return  # no labels to count: the conventions do not matter (samples weighting or loss_fn counts)
        wide = next((mb for mb in labelled if mb[self.label_key].dim() and mb[self.label_key].shape[-1] >= 3),
                    labelled[0])
        loss_fn = self.loss_fn
        local: LabelConventionError | None = None
        try:
            verdict: LabelConventions | str = probe_label_conventions(
                self.model, wide, label_key=self.label_key, ignore_index=self.ignore_index,
                shift_labels=self.shift_labels if isinstance(self.shift_labels, bool) else None,
                call=(lambda model, batch: loss_fn(model, batch)) if loss_fn is not None else None)
        except LabelConventionError as exc:
            verdict, local = str(exc), exc  # only the text crosses ranks; the exception (and its cause) stays here
        verdicts = gather_objects(verdict)
        agreed = next((v for v in verdicts if isinstance(v, LabelConventions)), None)
        if agreed is None:
            if local is not None and verdicts[0] == verdict:
                raise local  # this rank's own: its cause (the model's frame) is kept for VLMFAST_TRACEBACK=1
            raise LabelConventionError(str(verdicts[0])) from local
        self.conventions = agreed
        self.shift_labels = self.conventions.shifts_labels
        self.passes_num_items = loss_fn is None and self.conventions.honours_num_items

    def plan(self, batch: Any, micro_batch_size: int | Any, host: Any = None) -> AccumulationPlan:
        """Split `batch` and count its loss items (on the host, before it moves to the device); ranks agree on the
        total and on the number of micro-batches in one collective. `micro_batch_size` is a number of samples, or a
        size object that splits the batch itself (`.split(batch, host=host)`: a TokenBudget, which plans on `host`).
        A batch already on the device (device prefetch) is counted on its host copy: a SampleBatch's own, or `host`,
        the batch it was copied from (:func:`vlmfast.data.batch.host_micro_batches`), so no device value is read."""
        splitter = getattr(micro_batch_size, "split", None)
        micro_batches = (splitter(batch, host=host) if splitter is not None  # planned on the host, rows gathered
                         else split_micro_batches(batch, micro_batch_size, self.layout, host=host))
        for i, micro_batch in enumerate(micro_batches):  # before a probe or the model indexes row 0 of it
            refuse_empty(micro_batch, f"micro-batch {i + 1} of {len(micro_batches)} of this optimizer batch")
        self.resolve_conventions(micro_batches)
        counted = host_micro_batches(batch, micro_batch_size, self.layout, host, keys=(self.label_key, "shift_labels"))
        token_counts = [self._count_tokens(mb) for mb in counted or micro_batches]  # the same split, on the host
        if not self.padding_checked:  # the first batch tells: collate_fn labels every batch alike
            self.padding_checked = True
            self._warn_labels_on_padding(counted or micro_batches)
        countable = all(n is not None for n in token_counts)
        weighting = self.resolved_weighting = self._resolve_weighting(countable)
        items = token_counts if weighting == "tokens" else [batch_size_of(mb) for mb in micro_batches]
        known = all(n is not None for n in items)
        local = sum(items) if known else batch_size_of(batch)
        divisor, count = sum_and_max(float(local), len(micro_batches))
        self.last_split = (count, micro_batch_size, batch_size_of(micro_batches[-1]))
        # Weight-0 micro-batches first (padding repeats one for rank symmetry): the last one, where DDP reduces,
        # carries loss items whenever the batch has any.
        order = sorted(range(len(micro_batches)), key=lambda i: items[i] != 0)
        padding = count - len(micro_batches)
        micro_batches = [micro_batches[order[0]]] * padding + [micro_batches[i] for i in order]
        items = [0] * padding + [items[i] for i in order]
        if count > 1 and self.batchnorm:
            warn_batchnorm_once(self.batchnorm, micro_batch_size)
        # With a loss_fn that reports its own counts, those are the truth: correct after backward if they differ.
        exact = known and self.loss_fn is None
        return AccumulationPlan(micro_batches, weighting, items, max(divisor, 1.0), exact, padding)

    def _warn_labels_on_padding(self, micro_batches: list[Any]) -> None:
        """Loss tokens where the attention mask says padding (``labels = input_ids.clone()``): said once. Their number,
        hence the loss, then depends on how the batch is split, since each micro-batch is padded to its own longest
        sample. Reads host tensors only."""
        labelled = predicted = 0
        for mb in micro_batches:
            labels, mask = (mb.get(k) if isinstance(mb, Mapping) else None for k in (self.label_key, "attention_mask"))
            if isinstance(labels, torch.Tensor) and isinstance(mask, torch.Tensor) and labels.shape == mask.shape \
                    and labels.device.type == "cpu" and mask.device.type == "cpu":
                target = labels != self.ignore_index
                labelled += int(((mask == 0) & target).sum())
                if self.shift_labels is True and labels.dim() == 2:  # the target at t is predicted at t - 1
                    predicted += int(((mask[:, :-1] == 0) & (mask[:, 1:] != 0) & target[:, 1:]).sum())
        if predicted and not labelled:
            log.warning("%d loss token(s) are predicted from padding: with left padding, the first real token of a "
                        "row is a target its pad predecessor predicts, so the loss depends on how much padding the "
                        "row got (and on the micro-batch split). Set %s to %d at each row's first real token (real "
                        "templates start with a BOS or system token, never a target)",
                        predicted, self.label_key, self.ignore_index)
        if labelled:
            log.warning("%d loss token(s) sit on padding (attention_mask 0, %s not %d): the model trains on padding, "
                        "and the loss depends on the micro-batch split (a micro-batch collated from its samples is "
                        "padded to its own longest one). Set %s to %d wherever attention_mask is 0 in your dataset "
                        "or collate_fn",
                        labelled, self.label_key, self.ignore_index, self.label_key, self.ignore_index)

    def _count_tokens(self, micro_batch: Any) -> int | None:
        return count_loss_tokens(micro_batch, self.label_key, self.ignore_index, bool(self.shift_labels))

    def _resolve_weighting(self, tokens_countable: bool) -> str:
        if self.weighting == "tokens" and not tokens_countable and self.loss_fn is None:
            raise ValueError(
                f"loss.weighting is 'tokens' but the batch has no '{self.label_key}' tensor to count: set "
                "loss.label_key, return (loss_sum, n_items) from loss_fn, or use loss.weighting: samples"
            )
        if self.weighting == "auto":
            return "tokens" if tokens_countable else "samples"
        return self.weighting

    def micro_batch_loss(self, model: nn.Module, micro_batch: Any, plan: AccumulationPlan, index: int) -> torch.Tensor:
        """This micro-batch's share of the batch loss: ``loss_sum_i / N`` (what to backpropagate, per rank).

        A micro-batch without loss items (or a padding one) still runs forward and backward, with weight 0, so
        every rank's collectives match; a model's mean over zero tokens (NaN) is zeroed, never propagated."""
        share = self._share(model, micro_batch, plan, index)
        if plan.items[index] == 0 or plan.is_padding(index):
            if self.loss_fn is not None:  # its mean over no items is 0/0: stop autograd before that division
                return _ZeroWeight.apply(share)
            return torch.nan_to_num(share, nan=0.0, posinf=0.0, neginf=0.0) * 0.0  # the graph reaches every param
        return share

    def _share(self, model: nn.Module, micro_batch: Any, plan: AccumulationPlan, index: int) -> torch.Tensor:
        if self.loss_fn is not None:
            result = self.loss_fn(model, micro_batch)
            if isinstance(result, (tuple, list)):
                loss_sum, n_items = result
                if not plan.is_padding(index):
                    plan.reported_items.append(n_items)
                return loss_sum / plan.divisor
            return _mean_to_share(extract_loss(result), plan, index)
        if self.passes_num_items and plan.weighting == "tokens":
            return extract_loss(call_model(model, micro_batch, num_items_in_batch=int(plan.divisor)))
        return _mean_to_share(extract_loss(call_model(model, micro_batch)), plan, index)

    def local_items(self, plan: AccumulationPlan) -> float:
        """Loss items of this rank's batch (what loss_fn reported, else what was counted before forward)."""
        if plan.reported_items:
            return sum(float(n) for n in plan.reported_items)
        return float(sum(n or 0 for n in plan.items))

    def correction(self, plan: AccumulationPlan) -> float:
        """Factor to apply to gradients (and the logged loss) once all micro-batches ran; 1.0 when exact."""
        if plan.exact or not plan.reported_items:
            return 1.0
        local = sum(float(n) for n in plan.reported_items)  # one host read per step, only on this path
        return plan.divisor / max(all_reduce_sum(local), 1.0)

    def after_backward(self, step: Step) -> None:
        factor = self.correction(step.plan)
        if factor != 1.0:
            step.scale_gradients(factor)

    def describe(self) -> str:
        count, size, last = self.last_split
        split = f"{count} micro-batch(es) of {size}" + (f" (the last of {last})" if last != size else "")
        how = {"tokens": "weighted by loss tokens", "samples": "weighted by samples"}.get(
            self.resolved_weighting, f"weighting {self.resolved_weighting}")
        extra = ", num_items_in_batch passed to the model" if self.passes_num_items else ""
        found = f"; {self.conventions.describe()}" if self.conventions is not None else ""
        return f"accumulation: {split} per optimizer step, {how}{extra}{found}"


def batchnorm_layers(model: nn.Module) -> list[str]:
    """Names of the BatchNorm layers of `model` (their statistics depend on how the batch is split)."""
    return [name or type(model).__name__ for name, module in unwrap_model(model).named_modules()
            if isinstance(module, nn.modules.batchnorm._BatchNorm) and module.training]


_BATCHNORM_WARNED: list[bool] = []


def warn_batchnorm_once(layers: list[str], micro_batch_size: int) -> None:
    """One warning per process: micro-batching is exact for every layer but BatchNorm (docs/accumulation.md)."""
    if _BATCHNORM_WARNED:
        return
    _BATCHNORM_WARNED.append(True)
    shown = ", ".join(layers[:3]) + (f" and {len(layers) - 3} more" if len(layers) > 3 else "")
    log.warning(
        "the model has BatchNorm layers in training mode (%s): split into micro-batches of %d, each normalises with "
        "its own micro-batch statistics and updates the running averages once per micro-batch, so the gradient and "
        "the statistics differ from the full batch's (every other layer is exact). Use micro_batch_size = "
        "batch_size, GroupNorm/LayerNorm, or BatchNorm in eval mode; see docs/accumulation.md", shown,
        micro_batch_size)


class _ZeroWeight(torch.autograd.Function):
    """0 in forward; no gradient in backward (None stops autograd there, so the NaN of 0/0 never propagates)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> None:
        return None


def _mean_to_share(mean_loss: torch.Tensor, plan: AccumulationPlan, index: int) -> torch.Tensor:
    n_items = plan.items[index]
    if n_items is None:
        raise ValueError("cannot weight a mean loss without its item count: return (loss_sum, n_items) from loss_fn")
    return mean_loss * (n_items / plan.divisor)


def sync_context(model: nn.Module, is_last: bool, loop: Any = None) -> AbstractContextManager[Any]:
    """Skip the gradient reduction on every micro-batch but the last: the loop's own no-sync when `loop` (an
    Accelerator or a Fabric) is given, else DDP's `no_sync` / FSDP2's `set_requires_gradient_sync(False)` on the
    module found inside the model (through Fabric's and torch.compile's wrappers).

    Usage: ``with sync_context(model, index == last, loop=fabric): fabric.backward(loss)``
    """
    return no_sync(model, loop, enabled=not is_last)


def accumulate_gradients(
    model: nn.Module,
    batch: Any,
    micro_batch_size: int,
    *,
    loss_fn: LossFn | None = None,
    weighting: str = "auto",
    device: torch.device | None = None,
    forward_context: Callable[[], AbstractContextManager[Any]] | None = None,
    backward: Callable[[torch.Tensor], None] | None = None,
    loop: Any = None,
) -> torch.Tensor:
    """Run forward/backward over `batch` in micro-batches, leaving the full-batch gradient in `.grad`.

    `batch` is this rank's part of the optimizer batch. Returns the loss of the whole optimizer batch, across ranks
    (detached; the same value on every rank). `loop` is the Accelerator or Fabric running the loop: its autocast,
    backward and no-sync are used (given `backward=accelerator.backward`, the loop is found from it).
    Under DDP only the last micro-batch's backward all-reduces. Usage::

        loss = accumulate_gradients(model, batch, 2, loop=accelerator); optimizer.step()
    """
    loop = loop if loop is not None else loop_of(backward)
    check_loop(loop)
    forward_context = forward_context or loop_forward_context(loop) or nullcontext
    backward = backward or loop_backward(loop) or torch.Tensor.backward
    ranks = world_size()
    accumulation = GradientAccumulation(weighting=weighting, loss_fn=loss_fn)
    accumulation.apply(model)
    plan = accumulation.plan(batch, micro_batch_size)
    total = torch.zeros(())
    for index, micro_batch in enumerate(plan.micro_batches):
        if device is not None:
            micro_batch = move_to_device(micro_batch, device)
        # Forward and backward inside the no-sync context (DDP decides at forward whether backward reduces);
        # autocast around forward only.
        with sync_context(model, index == plan.last, loop):
            with forward_context():
                share = accumulation.micro_batch_loss(model, micro_batch, plan, index)
            backward(share * ranks if ranks > 1 else share)  # DDP averages over ranks; shares are global fractions
        total = total.to(share.device) + share.detach().float()
    after_agreement(lambda: _finish(model, accumulation, plan, total))
    return total


def _finish(model: nn.Module, accumulation: GradientAccumulation, plan: AccumulationPlan, total: torch.Tensor) -> None:
    """The step's cross-rank work: the loss-count correction (loss_fn counts) and the global loss, in place."""
    factor = accumulation.correction(plan)
    if factor != 1.0:
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        torch._foreach_mul_(grads, factor)
    if world_size() > 1:
        total.copy_(sum_loss_and_flags(total, wants_stop=False)[0])
    if factor != 1.0:
        total.mul_(factor)
