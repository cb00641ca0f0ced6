"""Optimizer, parameter groups, frozen sub-modules, learning-rate schedules and gradient clipping.

Usage in a hand-written loop::

    freeze_modules(model, ["vision_tower"])
    optimizer = build_optimizer(model, OptimizerSpec(lr=1e-4, weight_decay=0.1), device)
    scheduler = build_scheduler(optimizer, SchedulerSpec(name="cosine", warmup_steps=100), max_steps=1000)
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from vlmfast.common.module_tree import matches
from vlmfast.spec import OptimizerSpec, SchedulerSpec
from vlmfast.strategies.base import Step, Strategy


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


def _kernel_kwargs(implementation: str, device: torch.device, sharded: bool = False) -> dict[str, bool]:
    from torch.optim.optimizer import _get_fused_kernels_supported_devices

    if implementation == "auto":
        fused = device.type in _get_fused_kernels_supported_devices() and not sharded
        implementation = "fused" if fused else "foreach"
    return {"fused": {"fused": True}, "foreach": {"foreach": True}, "for_loop": {"foreach": False}}[implementation]


def build_optimizer(model: nn.Module, spec: OptimizerSpec, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer named by `spec` over :func:`build_param_groups` (fused kernels where the device has them)."""
    groups = build_param_groups(model, spec)
    if spec.name == "adamw":
        return torch.optim.AdamW(groups, lr=spec.lr, betas=spec.betas, eps=spec.eps,
                                 **_kernel_kwargs(spec.implementation, device))
    if spec.name == "sgd":
        # FSDP2's DTensor has no sharding rule for the fused SGD kernel (aten._fused_sgd_, torch 2.13): foreach.
        sharded = any(type(p).__name__ == "DTensor" for group in groups for p in group["params"])
        return torch.optim.SGD(groups, lr=spec.lr, momentum=spec.momentum,
                               **_kernel_kwargs(spec.implementation, device, sharded))
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


def human_count(n: int) -> str:
    """12 -> '12', 34_500 -> '34.5k', 7_100_000 -> '7.10M'."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return str(n)


class Optimization(Strategy):
    """Freezes modules, builds the optimizer (when the engine asks: after sharding) and steps the schedule.

    Usage: ``model = opt.apply(model); optimizer = opt.build(model)``; the loop calls ``after_step`` each step.
    """

    name = "optimizer"

    def __init__(self, optimizer: OptimizerSpec, scheduler: SchedulerSpec, max_steps: int,
                 device: torch.device) -> None:
        self.spec, self.schedule, self.max_steps, self.device = optimizer, scheduler, max_steps, device
        self.frozen_params = 0
        self.trainable_params = 0
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler: LambdaLR | None = None

    def apply(self, model: nn.Module) -> nn.Module:
        self.frozen_params = freeze_modules(model, self.spec.freeze)
        self.trainable_params = sum(p.numel() for p in model.parameters() if p.requires_grad)
        return model

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        """The optimizer over `model`'s trainable parameters, and its schedule (the engine calls this)."""
        self.trainable_params = sum(p.numel() for p in model.parameters() if p.requires_grad)  # after LoRA
        self.optimizer = build_optimizer(model, self.spec, self.device)
        self.scheduler = build_scheduler(self.optimizer, self.schedule, self.max_steps)
        return self.optimizer

    def after_step(self, step: Step) -> None:
        step.metrics["lr"] = self.scheduler.get_last_lr()[0]  # the rate this step used, before the schedule moves
        self.scheduler.step()

    def state_dict(self) -> dict[str, Any]:
        return {"scheduler": self.scheduler.state_dict()}  # the optimizer state is the engine's (it may shard it)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])

    def describe(self) -> str:
        opt = self.optimizer
        kernel = next((k for k in ("fused", "foreach") if opt.defaults.get(k)), "for-loop")
        frozen = f", {human_count(self.frozen_params)} frozen ({', '.join(self.spec.freeze)})" \
            if self.frozen_params else ""
        sched = self.schedule
        return (f"optimizer: {type(opt).__name__} ({kernel}), {len(opt.param_groups)} param groups, "
                f"{human_count(self.trainable_params)} trainable{frozen}; lr schedule {sched.name}, "
                f"warm-up {sched.warmup_steps}")
