"""The engine: who wraps the model, synchronises gradients, runs backward and the optimizer step, and owns precision.

One process, DDP, FSDP2 and DeepSpeed answer the same points, so the training loop never asks which one it has
(Lightning Fabric's strategy + precision plugin, in one object). Usage::

    engine = build_engine(spec, device, world_size)
    model = engine.setup(model, build_optimizer)        # wraps the model, then builds the optimizer over it
    with engine.sync_context(model, last_micro_batch=True), engine.precision.forward_context():
        loss = model(**engine.prepare_inputs(batch)).loss
    engine.backward(loss)
    result = engine.step()                               # StepResult(applied, grad_norm)
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlmfast.engines.portable_state import is_named, optimizer_state_by_index
from vlmfast.strategies.base import Strategy

OptimizerFactory = Callable[[nn.Module], torch.optim.Optimizer]


@dataclass
class StepResult:
    """What an optimizer step did: whether the update was applied, and the gradient norm the engine measured
    (a device tensor or None: engines that clip inside their step report it here)."""

    applied: bool
    grad_norm: torch.Tensor | None = None


class Engine:
    """One process: the base every engine builds on. Subclasses override the points they own."""

    name = "single"

    def __init__(self, precision: Strategy, world_size: int = 1) -> None:
        self.precision = precision  # a Strategy: the loop runs its forward_context and after_backward
        self.world_size = world_size
        self.optimizer: torch.optim.Optimizer | None = None
        self.module: nn.Module | None = None  # the unwrapped model (the one source for "unwrap")
        self._local = False

    # ---- setup --------------------------------------------------------------------------------------------
    def setup(self, model: nn.Module, build_optimizer: OptimizerFactory) -> nn.Module:
        """Wrap `model` for this engine and build the optimizer over the parameters it will train."""
        self.module = model
        self.optimizer = build_optimizer(model)
        return model

    # ---- the micro-batch ----------------------------------------------------------------------------------
    def sync_context(self, model: nn.Module, last_micro_batch: bool) -> AbstractContextManager[Any]:
        """Around a micro-batch's forward and backward: whether gradients are reduced across ranks after it."""
        return nullcontext()

    @contextmanager
    def local_gradients(self) -> Iterator[None]:
        """No reduction across ranks inside (a batch-size probe; the OOM fallback's retried region)."""
        previous, self._local = self._local, True
        try:
            yield
        finally:
            self._local = previous

    def prepare_inputs(self, batch: Any) -> Any:
        """A device micro-batch as the wrapped model expects it."""
        return batch

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a micro-batch's share of the global-batch loss."""
        self.precision.backward(loss * self.world_size if self.world_size > 1 else loss)

    # ---- the optimizer step -------------------------------------------------------------------------------
    def finish_gradients(self) -> None:
        """Reduce gradients whose reduction was deferred (the OOM fallback under DDP); once per step."""

    def scale_gradients(self, factor: float) -> None:
        """Multiply every gradient in place (a loss-weight correction known only after backward)."""
        grads = [p.grad for p in self.trainable_parameters() if p.grad is not None]
        if grads and factor != 1.0:
            torch._foreach_mul_(grads, factor)

    def clip_gradients(self, max_norm: float) -> torch.Tensor | None:
        """Clip the global gradient norm; returns the norm before clipping (a device tensor: no sync)."""
        norm = torch.nn.utils.clip_grad_norm_(self.trainable_parameters(), max_norm, foreach=True)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor, equal on all ranks

    def step(self) -> StepResult:
        """Apply the update and clear the gradients."""
        applied = self.precision.optimizer_step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(applied)

    def skip_step(self) -> None:
        """Drop this step's gradients without updating (a vetoed, non-finite step)."""
        self.precision.skip_step()
        self.optimizer.zero_grad(set_to_none=True)

    def discard_gradients(self) -> None:
        """Forget a failed attempt's gradients (OOM): the batch is retried from scratch."""
        self.optimizer.zero_grad(set_to_none=True)
        self.precision.reset_after_oom()

    def trainable_parameters(self) -> list[torch.Tensor]:
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    # ---- checkpoints --------------------------------------------------------------------------------------
    writes_shards = False  # True: every rank writes its part of the checkpoint (save_shards / load_shards)
    can_probe = True  # False: sharded engines, whose batch-size probes would strand peers inside a collective
    local_state_dict = True  # False: state_dict() gathers with a collective, so one rank may not call it alone

    keeps_trainable_only = True  # state_dict(trainable_only=True) holds the trainable parameters alone

    @property
    def shards_parameters(self) -> bool:
        """Whether a rank holds only part of each weight (FSDP2, ZeRO-3): the module's tensors are not the model."""
        return False

    def state_dict(self, trainable_only: bool = False) -> dict[str, Any]:
        """Model, optimizer and precision state (every rank calls it: gathering may be a collective).
        `trainable_only`: the model's trainable parameters alone (a LoRA run: its frozen base is fingerprinted,
        not saved)."""
        model = self.module.state_dict()
        if trainable_only:
            trainable = {name for name, p in self.module.named_parameters() if p.requires_grad}
            model = {name: value for name, value in model.items() if name in trainable}
        return {"model": model, "optimizer": self.optimizer.state_dict(), "precision": self.precision.state_dict(),
                **({"trainable_only": True} if trainable_only else {})}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "model" in state and state.get("trainable_only"):
            _load_trainable(self.module, state["model"])
        elif "model" in state:
            self.module.load_state_dict(state["model"])
        if "optimizer" in state:
            optimizer_state = state["optimizer"]
            if is_named(optimizer_state):  # written by FSDP2 (torch's distributed-checkpoint format): renumbered
                optimizer_state = optimizer_state_by_index(optimizer_state, self.optimizer, self.module)
            self.optimizer.load_state_dict(optimizer_state)
        self.precision.load_state_dict(state.get("precision", {}))

    def save_shards(self, directory: Path, trainable_only: bool = False) -> None:
        """Engines with sharded state write every rank's part into `directory` (all ranks call it); `trainable_only`
        as in :meth:`state_dict`."""

    def load_shards(self, directory: Path) -> None:
        """Read back what :meth:`save_shards` wrote (all ranks call it)."""

    def reads_shards(self, saved_spec: dict[str, Any], saved_world: int) -> bool:
        """Whether :meth:`load_shards` reads the shards a run of `saved_spec` on `saved_world` ranks wrote, as they
        are; else they are merged into the full state first (vlmfast.engines.zero_state) and loaded by
        :meth:`load_state_dict`."""
        return False

    def describe(self) -> list[str]:
        """Report lines: the engine and its precision."""
        return [self.precision.describe()]


def _load_trainable(module: nn.Module, saved: dict[str, Any]) -> None:
    """Load a checkpoint of the trainable parameters alone: exactly those, nothing missing or unexpected."""
    check_trainable_names(module, saved)
    module.load_state_dict(saved, strict=False)


def check_trainable_names(module: nn.Module, saved: Iterable[str], also: Iterable[str] = ()) -> None:
    """Refuse a checkpoint of the trainable parameters alone whose names are not `module`'s trainable parameters:
    every one present, nothing else but `also` (what the engine saves besides them, e.g. buffers)."""
    trainable, saved = {name for name, p in module.named_parameters() if p.requires_grad}, set(saved)
    missing, unexpected = sorted(trainable - saved), sorted(saved - trainable - set(also))
    if missing or unexpected:
        raise ValueError(f"the checkpoint's trainable parameters do not match the model's: missing {missing[:3]}, "
                         f"unexpected {unexpected[:3]} (another lora configuration?)")
