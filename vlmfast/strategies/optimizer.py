"""Optimizer, parameter groups, frozen sub-modules, learning-rate schedules and gradient clipping.

Usage in a hand-written loop::

    freeze_modules(model, ["vision_tower"])
    optimizer = build_optimizer(model, OptimizerSpec(lr=1e-4, weight_decay=0.1), device)
    scheduler = build_scheduler(optimizer, SchedulerSpec(name="cosine", warmup_steps=100), max_steps=1000)
"""

from __future__ import annotations

import fnmatch
import math
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from vlmfast.spec import OptimizerSpec, SchedulerSpec, TrainSpec
from vlmfast.strategies.base import Strategy


def matches(name: str, pattern: str) -> bool:
    """Whether a parameter lies under a module path at any depth, or matches a glob.

    'vision_tower' matches 'vision_tower.blocks.0.w' and Hugging Face's 'model.vision_tower.encoder...';
    'model.vision_tower' and '*.proj.weight' work too.
    """
    return f".{pattern}." in f".{name}." or fnmatch.fnmatchcase(name, pattern)


def freeze_modules(model: nn.Module, patterns: list[str]) -> int:
    """Set requires_grad=False on every parameter under the named sub-modules; returns how many were frozen."""
    frozen = 0
    for pattern in patterns:
        hits = [p for name, p in model.named_parameters() if matches(name, pattern)]
        if not hits:
            raise ValueError(f"optimizer.freeze: '{pattern}' matches no parameter; top-level modules are "
                             f"{[name for name, _ in model.named_children()]}")
        for param in hits:
            frozen += param.numel() if param.requires_grad else 0
            param.requires_grad_(False)
    return frozen


def build_param_groups(model: nn.Module, spec: OptimizerSpec) -> list[dict[str, Any]]:
    """Trainable parameters grouped by (per-module lr/weight decay, decay or not); empty groups dropped.

    1-D tensors (biases, norm weights) get no weight decay when `no_decay_norm_and_bias` is set, as in nanoGPT.
    """
    groups: dict[tuple[int, bool], dict[str, Any]] = {}
    used = [False] * len(spec.param_groups)
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        index = next((i for i, g in enumerate(spec.param_groups) if any(matches(name, m) for m in g.modules)), -1)
        override = spec.param_groups[index] if index >= 0 else None
        if index >= 0:
            used[index] = True
        decay = not (spec.no_decay_norm_and_bias and param.dim() < 2)
        weight_decay = override.weight_decay if override and override.weight_decay is not None else spec.weight_decay
        group = groups.setdefault((index, decay), {
            "params": [], "names": [], "lr": override.lr if override and override.lr else spec.lr,
            "weight_decay": weight_decay if decay else 0.0,
        })
        group["params"].append(param)
        group["names"].append(name)
    for i, was_used in enumerate(used):
        if not was_used:
            raise ValueError(f"optimizer.param_groups[{i}].modules {spec.param_groups[i].modules} match no "
                             "trainable parameter")
    if not groups:
        raise ValueError("the model has no trainable parameter (is everything frozen? see optimizer.freeze)")
    for (_, decay), group in groups.items():
        group["label"] = _group_label(group.pop("names"), decay)
    return list(groups.values())


def _group_label(names: list[str], decay: bool) -> str:
    """A readable name for a parameter group: its top-level modules, e.g. 'vision_tower (no decay)'."""
    tops = sorted({name.split(".")[0] for name in names})
    shown = ", ".join(tops[:3]) + (f" +{len(tops) - 3}" if len(tops) > 3 else "")
    return f"{shown} ({'decay' if decay else 'no decay'})"


def _kernel_kwargs(implementation: str, device: torch.device) -> dict[str, bool]:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    if implementation == "auto":
        implementation = "fused" if device.type in _get_fused_kernels_supported_devices() else "foreach"
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[implementation]


def build_optimizer(model: nn.Module, spec: OptimizerSpec, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer named by `spec` over :func:`build_param_groups` (fused kernels where the device has them)."""
    groups = build_param_groups(model, spec)
    if spec.name == "adamw":
        return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                 **_kernel_kwargs(spec.implementation, device))
    if spec.name == "sgd":
        return torch.optim.SGD(groups, lr=spec.lr, momentum=spec.momentum,
                               **_kernel_kwargs(spec.implementation, device))
    if not hasattr(torch.optim, "Adafactor"):
        raise ValueError(f"optimizer.name 'adafactor' needs torch >= 2.5 (this is {torch.__version__})")
    return torch.optim.Adafactor(groups, lr=spec.lr)


def lr_multiplier(step: int, spec: SchedulerSpec, max_steps: int) -> float:
    """The learning-rate factor at `step`: linear warm-up, then constant / linear / cosine to `min_lr_ratio`."""
    if step < spec.warmup_steps:
        return (step + 1) / spec.warmup_steps
    if spec.name == "constant":
        return 1.0
    progress = min(1.0, (step - spec.warmup_steps) / max(1, max_steps - spec.warmup_steps))
    shape = 1.0 - progress if spec.name == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return spec.min_lr_ratio + (1.0 - spec.min_lr_ratio) * shape


def build_scheduler(optimizer: torch.optim.Optimizer, spec: SchedulerSpec, max_steps: int) -> LambdaLR:
    """A LambdaLR that keeps each group's own peak lr (per-module learning rates survive)."""
    return LambdaLR(optimizer, lambda step: lr_multiplier(step, spec, max_steps))


def clip_gradients(parameters: list[torch.Tensor], max_norm: float) -> torch.Tensor:
    """Clip the global gradient norm; returns the norm before clipping (a device tensor: no sync)."""
    norm = torch.nn.utils.clip_grad_norm_(parameters, max_norm, foreach=True)
    return norm.full_tensor() if hasattr(norm, "full_tensor") else norm  # FSDP2: a DTensor, the same on all ranks


def human_count(n: int) -> str:
    """12 -> '12', 34_500 -> '34.5k', 7_100_000 -> '7.10M'."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


class Optimization(Strategy):
    """Builds the optimizer and scheduler for the trainer, freezes modules, clips gradients."""

    name = "optimizer"

    def __init__(self, spec: TrainSpec, device: torch.device) -> None:
        self.spec = spec
        self.device = device
        self.frozen_params = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: LambdaLR | None = None
        self.trainable: list[torch.Tensor] = []
        self._names: dict[int, str] = {}

    owns_optimizer_state = True  # False when a sharded backend (DeepSpeed) checkpoints the optimizer itself

    def apply(self, model: nn.Module) -> nn.Module:
        self.frozen_params = freeze_modules(model, self.spec.optimizer.freeze)
        self.trainable = [p for p in model.parameters() if p.requires_grad]
        self._names = {id(p): name for name, p in model.named_parameters()}
        self.optimizer = build_optimizer(model, self.spec.optimizer, self.device)
        self.scheduler = build_scheduler(self.optimizer, self.spec.scheduler, self.spec.max_steps)
        return model

    def clip(self) -> torch.Tensor | None:
        """Clip to `grad_clip` when set; returns the pre-clip norm."""
        return clip_gradients(self.trainable, self.spec.grad_clip) if self.spec.grad_clip else None

    def nonfinite_groups(self) -> list[str]:
        """'group label: parameter names' for every group holding NaN/Inf gradients (error path only: syncs)."""
        bad = []
        for group in self.optimizer.param_groups:
            names = [self._names.get(id(p), "?") for p in group["params"]
                     if p.grad is not None and not bool(torch.isfinite(p.grad).all())]
            if names:
                shown = ", ".join(names[:4]) + (f" +{len(names) - 4}" if len(names) > 4 else "")
                bad.append(f"group '{group.get('label', '?')}' ({shown})")
        return bad

    def state_dict(self) -> dict[str, Any]:
        if not self.owns_optimizer_state:
            return {"scheduler": self.scheduler.state_dict()}
        return {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "optimizer" in state:  # absent when a sharded backend (DeepSpeed) checkpoints the optimizer itself
            self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])

    def describe(self) -> str:
        opt = self.optimizer
        kernel = next((k for k in ("fused", "foreach") if opt.defaults.get(k)), "for-loop")
        n_train = sum(p.numel() for p in self.trainable)
        frozen = f", {human_count(self.frozen_params)} frozen ({', '.join(self.spec.optimizer.freeze)})" \
            if self.frozen_params else ""
        sched = self.spec.scheduler
        return (f"optimizer: {type(opt).__name__} ({kernel}), {len(opt.param_groups)} param groups, "
                f"{human_count(n_train)} trainable{frozen}; lr schedule {sched.name}, warm-up {sched.warmup_steps}"
                + (f"; grad clip {self.spec.grad_clip}" if self.spec.grad_clip else ""))
