"""Every rank runs the vision tower on every micro-batch, even one whose batch has no image.

A VLM skips its vision tower (and projector) on a text-only batch. Under several ranks that desynchronises them: DDP
waits for the tower's gradients, FSDP2 and ZeRO-3 all-gather the tower's weights on the ranks with images only, and
ZeRO-2 / FSDP2 reduce gradient buffers laid out differently per rank (DeepSpeed#7170, Qwen3-VL#126). Here the
tower and projector (found by their usual attribute names) remember their inputs from a real call; on a training
forward where they did not run, they run on that remembered input at the point where a forward with images runs
them (learned once: the module that starts next), and their output enters the model's output with weight 0: every
rank takes part in the same gathers, in the same order, and every tower parameter gets a gradient (0) on every rank.

The remembered inputs and that point are shared across ranks the first time any rank sees an image (one
`all_gather_object` per training forward until then), so a rank that never saw an image can stand in too. Until the
point is known the stand-in runs at the end of the forward (exact for DDP and ZeRO-1/2; a sharded tower needs the
point: from the second image forward on).

Usage (in your own loop, before wrapping the model)::

    sync = ModalitySync(world_size=dist.get_world_size()); model = sync.apply(model)
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from vlmfast.engines.collectives import gather_objects
from vlmfast.strategies.base import Strategy

log = logging.getLogger(__name__)

TOWER_NAMES = ("vision_tower", "vision_model", "visual", "vision_encoder", "image_encoder")
PROJECTOR_NAMES = ("multi_modal_projector", "mm_projector", "projector", "connector", "vision_proj")


class ModalitySync(Strategy):
    """Runs the vision tower and projector with weight 0 on ranks whose micro-batch has no image."""

    name = "modality_sync"

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.modules: dict[str, nn.Module] = {}  # tower and projector, in call order once learned
        self.inputs: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {}  # remembered (args, kwargs), detached
        self.trigger: str | None = None  # the module a forward with images starts right after the projector
        self.shared = False  # every rank holds the inputs and the trigger
        self.stand_ins = 0  # forwards where the tower ran on remembered inputs (for the report)
        self._ran: set[str] = set()
        self._order: list[str] = []
        self._pending: list[torch.Tensor] = []
        self._await_next = False
        self._hooks: list[Any] = []
        self._recording: list[Any] = []
        self._model: nn.Module | None = None

    # ---- setup -------------------------------------------------------------------------------------------------
    def apply(self, model: nn.Module) -> nn.Module:
        self._model = model
        self.modules = _modality_modules(model)
        if not self.modules or self.world_size == 1:
            return model
        inside = {id(m) for module in self.modules.values() for m in module.modules()}
        for name, module in self.modules.items():
            self._hooks.append(module.register_forward_hook(self._make_after(name), with_kwargs=True))
        self._hooks += [model.register_forward_pre_hook(self._before_model),
                        model.register_forward_hook(self._after_model)]
        # Until the trigger is known: every other module's start is watched (cheap, and removed once learned).
        self._recording = [m.register_forward_pre_hook(self._make_watch(n)) for n, m in model.named_modules()
                           if n and id(m) not in inside]
        return model

    # ---- hooks -------------------------------------------------------------------------------------------------
    def _before_model(self, module: nn.Module, args: Any) -> None:
        self._ran.clear()
        self._pending.clear()

    def _make_after(self, name: str):
        def after(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if name in self._ran:  # a second call in one forward (a stand-in, or a model calling it twice)
                return
            self._ran.add(name)
            if name not in self._order:
                self._order.append(name)
            if name not in self.inputs:
                self.inputs[name] = (_detached(args), _detached(kwargs))
            self._await_next = self.trigger is None
        return after

    def _make_watch(self, name: str):
        def watch(module: nn.Module, args: Any) -> None:
            if self._await_next and self._ran:
                self._await_next = False
                self.trigger = name
        return watch

    def _stand_in(self, module: nn.Module | None = None, args: Any = None) -> None:
        """Run every tower module that did not run in this forward on its remembered input, with weight 0."""
        if not torch.is_grad_enabled() or not self.inputs:
            return
        for name in self._order or list(self.modules):
            if name in self._ran or name not in self.inputs:
                continue
            target = self.modules[name]
            device = next((p.device for p in target.parameters()), None)
            call_args, call_kwargs = self.inputs[name]
            self._ran.add(name)  # before the call: its own hook must not take it for a real one
            output = target(*_to(call_args, device), **_to(call_kwargs, device))
            self._pending.append(sum((t.float().sum() * 0.0 for t in _float_tensors(output)),
                                     torch.zeros((), device=device)))
            self.stand_ins += 1

    def _after_model(self, module: nn.Module, args: Any, output: Any) -> Any:
        if not torch.is_grad_enabled():
            return None  # evaluation and probes: no gradients to keep in step
        if self.trigger is not None and self._recording:
            for hook in self._recording:
                hook.remove()
            self._recording.clear()
        if not self.shared:
            self._share()
        self._stand_in()  # the trigger was not reached (not learned yet, or learned after this forward began)
        if not self._pending:
            return None
        zero = sum(self._pending[1:], self._pending[0])
        self._pending.clear()
        return _add_to_output(output, zero)

    def _share(self) -> None:
        """Every rank adopts the first rank's remembered inputs and trigger (a training forward: same count on every
        rank), so that a rank that has seen no image yet can stand in."""
        mine = (self.trigger, list(self._order), {n: (_to(a, "cpu"), _to(k, "cpu")) for n, (a, k) in
                                                  self.inputs.items()}) if self.inputs else None
        everyone = gather_objects(mine)
        known = [x for x in everyone if x is not None]
        if not known:
            return
        trigger, order, inputs = next((x for x in known if x[0] is not None), known[0])
        if not self.inputs:
            self.inputs, self._order = dict(inputs), list(order)
        self.trigger = self.trigger or trigger
        self.shared = self.trigger is not None  # every rank adopted it: no more exchanges
        if self.trigger is not None and self._model is not None:
            target = self._model.get_submodule(self.trigger)
            self._hooks.append(target.register_forward_pre_hook(self._stand_in, prepend=True))
            log.debug("modality sync: the tower stands in before %s", self.trigger)

    def describe(self) -> str | None:
        if not self.modules or self.world_size == 1:
            return None
        names = ", ".join(self.modules)
        return (f"modality sync: {names} run on every rank each micro-batch ({self.stand_ins} stand-in runs with "
                f"weight 0 on text-only micro-batches)")


def _modality_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The vision tower and its projector, by their usual attribute names (shallowest match), or {}."""
    found: dict[str, nn.Module] = {}
    for names in (TOWER_NAMES, PROJECTOR_NAMES):
        for name, sub in model.named_modules():
            if name.rsplit(".", 1)[-1] in names and not any(name.startswith(f"{f}.") for f in found):
                found[name] = sub
                break
    return found if any(n.rsplit(".", 1)[-1] in TOWER_NAMES for n in found) else {}


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _detached(v) for k, v in value.items()}
    return value


def _to(value: Any, device: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device) if device is not None else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, Mapping):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def _float_tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value] if value.is_floating_point() and value.requires_grad else []
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _float_tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _float_tensors(v)]
    if hasattr(value, "__dataclass_fields__"):
        return [t for f in value.__dataclass_fields__ for t in _float_tensors(getattr(value, f))]
    return []


def _add_to_output(output: Any, zero: torch.Tensor) -> Any:
    """`output` with `zero` added to its loss (or, without one, its first floating tensor)."""
    if isinstance(output, torch.Tensor):
        return output + zero.to(output.dtype)
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    if isinstance(loss, torch.Tensor):
        if isinstance(output, dict) or hasattr(output, "__setitem__"):
            output["loss"] = loss + zero
        else:
            output.loss = loss + zero
        return output
    tensors = _float_tensors(output)
    if not tensors:
        raise RuntimeError("modality sync: the model's output has no loss or floating tensor to carry the vision "
                           "tower's weight-0 stand-in")
    return _replace(output, tensors[0], tensors[0] + zero.to(tensors[0].dtype))


def _replace(value: Any, old: torch.Tensor, new: torch.Tensor) -> Any:
    if value is old:
        return new
    if isinstance(value, tuple):
        return type(value)(_replace(v, old, new) for v in value) if not hasattr(value, "_fields") else \
            type(value)(*(_replace(v, old, new) for v in value))
    if isinstance(value, list):
        return [_replace(v, old, new) for v in value]
    if isinstance(value, dict):
        return {k: _replace(v, old, new) for k, v in value.items()}
    if hasattr(value, "__dataclass_fields__"):
        for f in value.__dataclass_fields__:
            setattr(value, f, _replace(getattr(value, f), old, new))
    return value
