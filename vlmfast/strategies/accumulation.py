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
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vlmfast.data.batch import batch_size_of, move_to_device
from vlmfast.data.batch_layout import BatchLayout
from vlmfast.data.micro_batches import split_micro_batches
from vlmfast.models.conventions import LabelConventions, probe_label_conventions
from vlmfast.strategies.base import Strategy

LossFn = Callable[[nn.Module, Any], "torch.Tensor | tuple[torch.Tensor, Any]"]


def extract_loss(output: Any) -> torch.Tensor:
    """The loss of a model output: a tensor, a dict with "loss", an object with `.loss`, or a tuple led by it."""
    if isinstance(output, torch.Tensor):
        loss = output
    elif isinstance(output, Mapping) and "loss" in output:
        loss = output["loss"]
    elif hasattr(output, "loss"):
        loss = output.loss
    elif isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        loss = output[0]
    else:
        raise TypeError(
            f"the model returned a {type(output).__name__}: return a loss tensor, a dict with 'loss' or an object "
            "with .loss, or pass loss_fn=lambda model, batch: ... to OptimizedTrainer"
        )
    if loss is None:
        raise ValueError("the model returned loss=None: does the batch have labels? Otherwise pass loss_fn")
    if loss.dim() != 0:
        raise ValueError(f"the loss must be a scalar, got shape {tuple(loss.shape)}: reduce it (mean or sum)")
    return loss


def call_model(model: nn.Module, batch: Any, **extra: Any) -> Any:
    """Call a model the way its batch is shaped: keywords for a dict, positional for a tuple/list."""
    if isinstance(batch, Mapping):
        return model(**batch, **extra)
    if isinstance(batch, (tuple, list)):
        return model(*batch, **extra)
    return model(batch, **extra)


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
    """How one optimizer batch is split and weighted."""

    micro_batches: list[Any]
    weighting: str  # "tokens" or "samples"
    items: list[int | None]  # loss items per micro-batch when countable before forward
    divisor: float  # N: loss items in the whole batch across ranks (provisional when not exact)
    exact: bool  # divisor is the real count: no correction after backward
    reported_items: list[Any] = field(default_factory=list)  # counts returned by loss_fn, filled during the step


class GradientAccumulation(Strategy):
    """Splits the optimizer batch into micro-batches and weights each one so the gradient is the full-batch one."""

    name = "accumulation"

    def __init__(
        self,
        micro_batch_size: int,
        *,
        weighting: str = "auto",
        label_key: str = "labels",
        ignore_index: int = -100,
        shift_labels: str | bool = "auto",
        loss_fn: LossFn | None = None,
        world_size: int = 1,
    ) -> None:
        self.micro_batch_size = micro_batch_size
        self.weighting = weighting
        self.label_key = label_key
        self.ignore_index = ignore_index
        self.shift_labels = shift_labels
        self.loss_fn = loss_fn
        self.world_size = world_size
        self.passes_num_items = False
        self.accumulation_steps = 1
        self.resolved_weighting = weighting
        self.model: nn.Module | None = None
        self.layout: BatchLayout | None = None
        self.conventions: LabelConventions | None = None

    def apply(self, model: nn.Module) -> nn.Module:
        # Measured, not guessed: on the first batch's first micro-batch (vlmfast.models.conventions), see plan().
        self.model = model
        self.layout = BatchLayout.from_model(model)  # image / video token ids for splitting collated batches
        if isinstance(self.shift_labels, str) and self.shift_labels != "auto":
            self.shift_labels = self.shift_labels == "yes"
        return model

    def _resolve_conventions(self, micro_batch: Any) -> None:
        """Probe once whether the model shifts labels and honours num_items_in_batch (when labels are counted)."""
        if self.conventions is not None or self.model is None:
            return
        if not (isinstance(micro_batch, Mapping) and isinstance(micro_batch.get(self.label_key), torch.Tensor)):
            return  # no labels to count: the conventions do not matter (samples weighting or loss_fn counts)
        loss_fn = self.loss_fn
        self.conventions = probe_label_conventions(
            self.model, micro_batch, label_key=self.label_key, ignore_index=self.ignore_index,
            shift_labels=self.shift_labels if isinstance(self.shift_labels, bool) else None,
            call=(lambda model, batch: loss_fn(model, batch)) if loss_fn is not None else None)
        self.shift_labels = self.conventions.shifts_labels
        self.passes_num_items = loss_fn is None and self.conventions.honours_num_items

    def plan(self, batch: Any) -> AccumulationPlan:
        """Split `batch` and count its loss items (on the host, before it moves to the device)."""
        micro_batches = split_micro_batches(batch, self.micro_batch_size, self.layout)  # samples, per micro-batch
        self._resolve_conventions(micro_batches[0])
        self.accumulation_steps = len(micro_batches)
        token_counts = [self._count_tokens(mb) for mb in micro_batches]
        if 0 in token_counts:  # micro-batches without loss tokens first, so the last one (DDP's sync) has some
            order = sorted(range(len(micro_batches)), key=lambda i: token_counts[i] != 0)
            micro_batches, token_counts = [micro_batches[i] for i in order], [token_counts[i] for i in order]
        countable = all(n is not None for n in token_counts)
        weighting = self.resolved_weighting = self._resolve_weighting(countable)
        items = token_counts if weighting == "tokens" else [batch_size_of(mb) for mb in micro_batches]
        known = all(n is not None for n in items)
        local = sum(items) if known else batch_size_of(batch)
        divisor = float(all_reduce_sum(local, self.world_size))
        # With a loss_fn that reports its own counts, those are the truth: correct after backward if they differ.
        exact = known and self.loss_fn is None
        return AccumulationPlan(micro_batches, weighting, items, max(divisor, 1.0), exact)

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
        """This micro-batch's share of the batch loss: ``loss_sum_i / N`` (what to backpropagate, per rank)."""
        if self.loss_fn is not None:
            result = self.loss_fn(model, micro_batch)
            if isinstance(result, (tuple, list)):
                loss_sum, n_items = result
                plan.reported_items.append(n_items)
                return loss_sum / plan.divisor
            return _mean_to_share(extract_loss(result), plan, index)
        if self.passes_num_items and plan.weighting == "tokens":
            return extract_loss(call_model(model, micro_batch, num_items_in_batch=int(plan.divisor)))
        return _mean_to_share(extract_loss(call_model(model, micro_batch)), plan, index)

    def skippable(self, plan: AccumulationPlan, index: int) -> bool:
        """A micro-batch with no loss tokens contributes nothing, and a model's mean over zero tokens is NaN."""
        return plan.weighting == "tokens" and self.loss_fn is None and plan.items[index] == 0

    def local_items(self, plan: AccumulationPlan) -> float:
        """Loss items of this rank's batch (what loss_fn reported, else what was counted before forward)."""
        if plan.reported_items:
            return sum(float(n) for n in plan.reported_items)
        return float(sum(n or 0 for n in plan.items))

    def backward_scale(self) -> float:
        """DDP averages gradients over ranks; the shares are fractions of the global batch, so undo that."""
        return float(self.world_size)

    def correction(self, plan: AccumulationPlan) -> float:
        """Factor to apply to gradients (and the logged loss) once all micro-batches ran; 1.0 when exact."""
        if plan.exact or not plan.reported_items:
            return 1.0
        local = sum(float(n) for n in plan.reported_items)  # one host sync per step, only on this path
        true_total = all_reduce_sum(local, self.world_size)
        return plan.divisor / max(true_total, 1.0)

    def describe(self) -> str:
        split = f"{self.accumulation_steps} micro-batch(es) of {self.micro_batch_size}"
        how = {"tokens": "weighted by loss tokens", "samples": "weighted by samples"}.get(
            self.resolved_weighting, f"weighting {self.resolved_weighting}")
        extra = ", num_items_in_batch passed to the model" if self.passes_num_items else ""
        found = f"; {self.conventions.describe()}" if self.conventions is not None else ""
        return f"accumulation: {split} per optimizer step, {how}{extra}{found}"


def _mean_to_share(mean_loss: torch.Tensor, plan: AccumulationPlan, index: int) -> torch.Tensor:
    n_items = plan.items[index]
    if n_items is None:
        raise ValueError("cannot weight a mean loss without its item count: return (loss_sum, n_items) from loss_fn")
    if n_items == 0:  # a mean over no items is NaN (0/0), and 0 * NaN too: weight 0 without touching it
        return _ZeroWeight.apply(mean_loss)
    return mean_loss * (n_items / plan.divisor)


class _ZeroWeight(torch.autograd.Function):
    """0 in forward; no gradient in backward (None stops autograd there, so the NaN of 0/0 never propagates)."""

    @staticmethod
    def forward(ctx: Any, loss: torch.Tensor) -> torch.Tensor:
        return torch.zeros_like(loss)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> None:
        return None


def all_reduce_sum(value: float, world_size: int) -> float:
    """Sum a host number over ranks (a no-op in a single process)."""
    if world_size <= 1 or not torch.distributed.is_initialized():
        return value
    backend = torch.distributed.get_backend()
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    torch.distributed.all_reduce(tensor)
    return float(tensor.item())


def scale_gradients(parameters: Iterable[torch.Tensor], factor: float) -> None:
    """Multiply every gradient in place (one foreach kernel)."""
    grads = [p.grad for p in parameters if p.grad is not None]
    if grads and factor != 1.0:
        torch._foreach_mul_(grads, factor)


def all_reduce_gradients(parameters: Iterable[torch.Tensor], world_size: int, bucket_mb: float = 25.0) -> None:
    """Average gradients over ranks by hand, in flat buckets (used when DDP's own sync is off, e.g. OOM fallback).

    Every trainable parameter takes part (a missing gradient counts as zeros) so all ranks reduce the same buckets.
    """
    if world_size <= 1 or not torch.distributed.is_initialized():
        return
    params = [p for p in parameters if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    limit = bucket_mb * 2**20
    bucket: list[torch.Tensor] = []
    size = 0
    for grad in [p.grad for p in params]:
        if bucket and (grad.dtype != bucket[0].dtype or size + grad.nbytes > limit):
            _reduce_bucket(bucket, world_size)
            bucket, size = [], 0
        bucket.append(grad)
        size += grad.nbytes
    if bucket:
        _reduce_bucket(bucket, world_size)


def _reduce_bucket(grads: list[torch.Tensor], world_size: int) -> None:
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    flat = _flatten_dense_tensors(grads)
    torch.distributed.all_reduce(flat)
    flat /= world_size
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(synced)


def sync_context(model: nn.Module, is_last: bool) -> AbstractContextManager[Any]:
    """Skip the gradient reduction on every micro-batch but the last (DDP's `no_sync`, FSDP2's
    `set_requires_gradient_sync(False)`)."""
    if is_last:
        return nullcontext()
    if hasattr(model, "set_requires_gradient_sync"):
        return _fsdp_no_sync(model)
    return model.no_sync() if hasattr(model, "no_sync") else nullcontext()


@contextmanager
def _fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def accumulate_gradients(
    model: nn.Module,
    batch: Any,
    micro_batch_size: int,
    *,
    loss_fn: LossFn | None = None,
    weighting: str = "auto",
    device: torch.device | None = None,
    forward_context: Callable[[], AbstractContextManager[Any]] = nullcontext,
    backward: Callable[[torch.Tensor], None] = torch.Tensor.backward,
) -> torch.Tensor:
    """Run forward/backward over `batch` in micro-batches, leaving the full-batch gradient in `.grad`.

    Returns the batch loss (detached). Usage: ``loss = accumulate_gradients(model, batch, 2); optimizer.step()``.
    """
    world_size = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    accumulation = GradientAccumulation(micro_batch_size, weighting=weighting, loss_fn=loss_fn, world_size=world_size)
    accumulation.apply(model)
    plan = accumulation.plan(batch)
    total = torch.zeros(())
    for index, micro_batch in enumerate(plan.micro_batches):
        if device is not None:
            micro_batch = move_to_device(micro_batch, device)
        with sync_context(model, index == len(plan.micro_batches) - 1), forward_context():
            share = accumulation.micro_batch_loss(model, micro_batch, plan, index)
        backward(share * accumulation.backward_scale() if world_size > 1 else share)
        total = total.to(share.device) + share.detach().float()
    factor = accumulation.correction(plan)
    scale_gradients(model.parameters(), factor)
    return total * factor
