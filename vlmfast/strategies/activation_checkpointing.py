"""Activation checkpointing: keep only each repeated block's input and recompute the rest in backward.

Usage in a hand-written loop (after freezing, so frozen towers are found)::

    names = apply_activation_checkpointing(model, scope="language_model")   # ['language_model.layers.0', ...]
    detach_frozen_modules(model)            # a frozen vision tower keeps no autograd graph
    print(saved_tensor_bytes(lambda: model(**batch).loss))                  # activation bytes kept for backward

Hugging Face models get their own ``activation_checkpointing_enable`` (or ``gradient_checkpointing_enable``) when
everything is checkpointed, and their per-layer flag when only some layers are, because their layers know how to
drop the KV cache that a recomputation would otherwise update twice. Any other model gets its repeated blocks (an
``nn.ModuleList`` of modules of one class) wrapped in place: the block's ``forward`` is replaced on the instance, so
parameter names, ``state_dict`` keys and optimizer groups do not change.

Offloading (``offload_to_cpu``) runs each checkpointed region under ``torch.autograd.graph.save_on_cpu``: the only
tensors such a region saves are the block inputs, which are the bulk of what checkpointing still keeps; the logits
and the loss stay on the device, where copying them would cost more than it saves.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from vlmfast.common.module_tree import find_repeated_blocks, matches
from vlmfast.memory.checkpoint_budget import CheckpointPlan, measure_block_costs, plan_checkpointing
from vlmfast.spec import ActivationCheckpointingSpec
from vlmfast.strategies.base import Strategy

__all__ = [
    "ActivationCheckpointing",
    "apply_activation_checkpointing",
    "apply_checkpoint_plan",
    "checkpoint_call",
    "detach_frozen_modules",
    "find_repeated_blocks",
    "plan_activation_checkpointing",
    "plan_for_budget",
    "saved_tensor_bytes",
]

SCOPES = ("all", "language_model", "vision")
_LANGUAGE_SEGMENTS = ("language_model", "text_model")
_WRAPPED = "_vlmfast_checkpointed"
_FROZEN = "_vlmfast_frozen_no_grad"


# ----------------------------------------------------------------------------------------------------------------
# measuring


def saved_tensor_bytes(fn: Callable[[], Any], *, include_parameters: bool = False) -> int:
    """Bytes of the tensors autograd keeps for backward while ``fn()`` runs a forward pass.

    Usage: ``saved_tensor_bytes(lambda: model(**batch).loss)``

    Counts whole storages, each once (a view or a tensor saved by two ops costs its storage once). Parameters and
    views of them are left out unless ``include_parameters``: they are resident anyway, so counting them would hide
    what checkpointing changes. Tensors an inner hook takes (``save_on_cpu``) are not seen, as they leave the device.
    """
    seen: dict[tuple[str, int], int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        if include_parameters or not _is_parameter(tensor):
            storage = tensor.untyped_storage()
            seen[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
        return tensor

    # Non-reentrant checkpointing keeps each block's inputs in its recompute closure, out of sight of these
    # hooks: checkpoint_call reports them through _HELD_INPUTS so they are counted too.
    token = _HELD_INPUTS.set(pack)
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            result = fn()  # held until counted: a live graph keeps its storages from being reused
    finally:
        _HELD_INPUTS.reset(token)
    total = sum(seen.values())
    del result
    return total


_HELD_INPUTS: contextvars.ContextVar[Callable[[torch.Tensor], Any] | None] = contextvars.ContextVar(
    "vlmfast_checkpoint_held_inputs", default=None
)


def _is_parameter(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, nn.Parameter) or isinstance(tensor._base, nn.Parameter)


# ----------------------------------------------------------------------------------------------------------------
# checkpointing one call


def checkpoint_call(fn: Callable[..., Any], *args: Any, offload_to_cpu: bool = False, selective: bool = False,
                    **kwargs: Any) -> Any:
    """``fn(*args, **kwargs)`` under non-reentrant checkpointing, its saved inputs optionally kept on CPU.

    Usage: ``out = checkpoint_call(block.forward, hidden, attention_mask=mask, offload_to_cpu=True)``

    ``selective``: op-level checkpointing: the outputs of matmuls, convolutions and attention kernels are kept
    (``vlmfast.memory.checkpoint_budget.SAVED_OPS``), everything else is recomputed in backward.
    """
    # kwargs go through a partial so a block argument named like one of checkpoint's own (debug, context_fn, ...)
    # cannot be taken by checkpoint; non-reentrant checkpointing still gives gradients to tensors in them.
    call = functools.partial(fn, **kwargs) if kwargs else fn
    # A ContextVar read is a graph break under torch.compile; saved_tensor_bytes never measures compiled code.
    report = None if torch.compiler.is_compiling() else _HELD_INPUTS.get()
    if report is not None and not offload_to_cpu:  # measuring: the inputs stay alive until backward
        for value in (*args, *kwargs.values()):
            if isinstance(value, torch.Tensor):
                report(value)
    caches: list[Any] = []
    options: dict[str, Any] = {"use_reentrant": False}
    if selective:
        options["context_fn"] = functools.partial(_selective_contexts, caches)
    if not offload_to_cpu:
        out = checkpoint(call, *args, **options)
    else:
        # Looked up at call time (not imported) so tests can observe it; pinned memory only where CUDA exists.
        with torch.autograd.graph.save_on_cpu(pin_memory=torch.cuda.is_available()):
            out = checkpoint(call, *args, **options)
    if report is not None and not offload_to_cpu:
        for cache in caches:  # what selective checkpointing keeps lives in its own cache, not in saved tensors
            for tensor in _cached_tensors(cache):
                report(tensor)
    return out


def _selective_policy(ctx: Any, func: Any, *args: Any, **kwargs: Any) -> Any:
    """Keep the outputs of the expensive ops, recompute the rest (torchtitan's op-level SAC, simplified)."""
    from torch.utils.checkpoint import CheckpointPolicy

    from vlmfast.memory.checkpoint_budget import SAVED_OPS

    return CheckpointPolicy.MUST_SAVE if func.overloadpacket in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_contexts(caches: list[Any]) -> tuple[Any, Any]:
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    forward_context, recompute_context = create_selective_checkpoint_contexts(_selective_policy)
    caches.append(getattr(forward_context, "storage", {}))  # torch/utils/checkpoint.py _CachingTorchDispatchMode
    return forward_context, recompute_context


def _cached_tensors(cache: Any) -> Iterator[torch.Tensor]:
    from torch.utils._pytree import tree_flatten

    for entries in cache.values():
        for leaf in tree_flatten(list(entries.values()))[0]:
            value = getattr(leaf, "val", leaf)  # torch's _VersionWrapper around each kept output
            if isinstance(value, torch.Tensor):
                yield value


def _checkpointed_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Replacement ``forward`` bound to a block: checkpoint only when training with autograd on."""
    inner = self._vlmfast_inner_forward
    if self.training and torch.is_grad_enabled():
        return checkpoint_call(inner, *args, offload_to_cpu=self._vlmfast_offload,
                               selective=getattr(self, "_vlmfast_selective", False), **kwargs)
    return inner(*args, **kwargs)


def _wrap_block(block: nn.Module, offload_to_cpu: bool, selective: bool = False) -> None:
    # Bound methods (not closures) so copy.deepcopy rebinds them to the copy's own parameters.
    block._vlmfast_inner_forward = block.forward
    block._vlmfast_offload = offload_to_cpu
    block._vlmfast_selective = selective
    block.forward = types.MethodType(_checkpointed_forward, block)


def _hf_layer_class() -> type | None:
    try:
        from transformers.modeling_layers import GradientCheckpointingLayer
    except ImportError:  # no transformers, or one older than 4.52
        return None
    return GradientCheckpointingLayer


def _checkpoint_block(block: nn.Module, offload_to_cpu: bool, selective: bool = False) -> None:
    hf_layer = _hf_layer_class()
    if hf_layer is not None and isinstance(block, hf_layer):
        # The HF layer's own switch: it drops use_cache/past_key_values before checkpointing, which a plain wrapper
        # cannot know to do (the recomputation would append to the KV cache a second time).
        block.gradient_checkpointing = True
        block._gradient_checkpointing_func = functools.partial(checkpoint_call, offload_to_cpu=offload_to_cpu,
                                                               selective=selective)
    elif getattr(block, _WRAPPED, False):
        block._vlmfast_offload, block._vlmfast_selective = offload_to_cpu, selective  # re-planned: new mode
    else:
        _wrap_block(block, offload_to_cpu, selective)
    setattr(block, _WRAPPED, True)


# ----------------------------------------------------------------------------------------------------------------
# finding blocks


def _candidates(model: nn.Module) -> str:
    lists = [f"{name} ({len(m)} x {', '.join(sorted({type(c).__name__ for c in m}))})"
             for name, m in model.named_modules() if isinstance(m, nn.ModuleList) and len(m)]
    return "; ".join(lists) if lists else "none (the model has no nn.ModuleList)"


def _in_scope(path: str, scope: str) -> bool:
    if scope == "all":
        return True
    segments = path.split(".")
    vision = any("vision" in s or s == "visual" for s in segments)
    if scope == "vision":
        return vision
    # 'model.layers' as whole segments: a Hugging Face causal LM's decoder layers, not 'vision_model.layers'.
    return not vision and (any(s in _LANGUAGE_SEGMENTS for s in segments) or ".model.layers." in f".{path}.")


def _named_blocks(model: nn.Module, blocks: Iterable[str]) -> dict[str, list[tuple[int, str, nn.Module]]]:
    """Groups (by ModuleList path) of (index, name, module) the user's patterns name, outermost matches only."""
    patterns = list(blocks)
    groups: dict[str, list[tuple[int, str, nn.Module]]] = {}
    taken: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(f"{t}.") for t in taken) or not any(matches(name, p) for p in patterns):
            continue
        taken.append(name)
        if isinstance(module, nn.ModuleList):
            groups[name] = [(i, f"{name}.{i}", child) for i, child in enumerate(module)]
            continue
        parent, _, index = name.rpartition(".")
        in_list = parent and isinstance(model.get_submodule(parent), nn.ModuleList)
        key, position = (parent, int(index)) if in_list else (name, 0)
        groups.setdefault(key, []).append((position, name, module))
    return groups


def _auto_blocks(model: nn.Module) -> dict[str, list[tuple[int, str, nn.Module]]]:
    return {path: [(i, f"{path}.{i}", child) for i, child in enumerate(mlist)]
            for path, mlist in find_repeated_blocks(model).items()}


def _select(model: nn.Module, blocks: Iterable[str], every: int, scope: str) -> list[tuple[str, nn.Module]]:
    blocks = list(blocks)
    groups = _named_blocks(model, blocks) if blocks else _auto_blocks(model)
    if not groups:
        what = f"{blocks} match no module" if blocks else "no repeated blocks (ModuleList of one module class) found"
        raise ValueError(f"activation_checkpointing.blocks: {what}; candidate ModuleLists: {_candidates(model)}")
    kept = {path: members for path, members in groups.items() if _in_scope(path, scope)}
    if not kept:
        raise ValueError(f"activation_checkpointing.scope '{scope}': none of the blocks {sorted(groups)} lie under "
                         f"that tower; use scope 'all' or name the blocks in activation_checkpointing.blocks")
    return [(name, module) for members in kept.values() for index, name, module in members if index % every == 0]


# ----------------------------------------------------------------------------------------------------------------
# the plain functions


def apply_activation_checkpointing(
    model: nn.Module,
    *,
    blocks: Iterable[str] = (),
    every: int = 1,
    scope: str = "all",
    offload_to_cpu: bool = False,
) -> list[str]:
    """Checkpoint repeated blocks of ``model`` in place; returns the names of the checkpointed blocks.

    Usage: ``apply_activation_checkpointing(model, every=2, scope="language_model")``

    ``blocks``: module paths (at any depth) or globs of ModuleLists or single blocks; empty: auto-detect.
    ``every``: checkpoint blocks 0, k, 2k, ... of each list. ``scope``: 'all', 'language_model' or 'vision'.
    Blocks run normally (no recomputation) in eval mode and under ``torch.no_grad``. Calling it twice on the same
    blocks does not wrap them twice.
    """
    if every < 1:
        raise ValueError(f"activation_checkpointing.every must be >= 1, got {every}")
    if scope not in SCOPES:
        raise ValueError(f"activation_checkpointing.scope must be one of {SCOPES}, got '{scope}'")
    blocks = list(blocks)
    if _is_hf_model(model) and not blocks and every == 1 and scope == "all":
        return _enable_hf_checkpointing(model, offload_to_cpu)
    selected = _select(model, blocks, every, scope)
    for _, block in selected:
        if not getattr(block, _WRAPPED, False):
            _checkpoint_block(block, offload_to_cpu)
    return [name for name, _ in selected]


def plan_activation_checkpointing(
    model: nn.Module,
    run: Callable[[], Any],
    budget_bytes: int,
    *,
    selective: bool = True,
    scope: str = "all",
    blocks: Iterable[str] = (),
) -> CheckpointPlan:
    """Measure every repeated block in one forward ``run()`` and plan which to checkpoint, and how, within a budget.

    Usage: ``plan = plan_activation_checkpointing(model, lambda: model(**batch).loss, 2 * 2**30)``

    See :mod:`vlmfast.memory.checkpoint_budget`. ``scope`` / ``blocks`` restrict the candidates as in
    :func:`apply_activation_checkpointing`. The model is only measured: apply with :func:`apply_checkpoint_plan`.
    """
    if scope not in SCOPES:
        raise ValueError(f"activation_checkpointing.scope must be one of {SCOPES}, got '{scope}'")
    candidates = _select(model, blocks, 1, "all")
    towers = {"all": ("vision", "language"), "vision": ("vision",), "language_model": ("language",)}[scope]
    was_training = model.training
    model.train()
    try:
        costs = measure_block_costs(model, run, candidates)
    finally:
        model.train(was_training)
    return plan_checkpointing(costs, budget_bytes, selective=selective, towers=towers)


def apply_checkpoint_plan(model: nn.Module, plan: CheckpointPlan, *, offload_to_cpu: bool = False) -> list[str]:
    """Checkpoint the blocks ``plan`` says to (fully or selectively); returns their names.

    Usage: ``apply_checkpoint_plan(model, plan_activation_checkpointing(model, run, budget))``
    """
    done = []
    for name, mode in plan.modes.items():
        if mode != "none":
            _checkpoint_block(model.get_submodule(name), offload_to_cpu, selective=mode == "selective")
            done.append(name)
    return done


def plan_for_budget(model: nn.Module, budget_gb: float, *, micro_batch_size: int = 1,
                    micro_batch_tokens: int | None = None, seq_len: int | None = None, precision: str = "fp32",
                    selective: bool = True, scope: str = "all", blocks: Iterable[str] = (),
                    chunked_loss: bool = False) -> CheckpointPlan:
    """The plan for ``activation_checkpointing.budget_gb``: one probe forward of one sample at ``seq_len`` (default:
    the model's longest) with the built-in probe, scaled to the micro-batch's rows, then planned. ``chunked_loss``:
    the probe's loss is the chunked linear cross-entropy (no logits kept), as it will be in training.

    Usage: ``plan = plan_for_budget(model, 4.0, micro_batch_size=2)``; ``apply_checkpoint_plan(model, plan)``
    """
    from vlmfast.common.utils import PRECISION_DTYPES
    from vlmfast.memory.activations import default_activation_probe

    probe = default_activation_probe(model)
    if probe is None:
        raise ValueError(
            f"activation_checkpointing.budget_gb: vlmfast has no probe forward for {type(model).__name__} (it knows "
            "its tiny VLM and Hugging Face LLaVA-style and causal LMs). Plan with your own batch instead: "
            "plan = vlmfast.hooks.plan_activation_checkpointing(model, lambda: model(**batch).loss, budget_bytes); "
            "vlmfast.hooks.apply_checkpoint_plan(model, plan)")
    length = seq_len or probe.default_seq_len
    rows = max(micro_batch_tokens // length, 1) if micro_batch_tokens else micro_batch_size
    first = next((p for p in model.parameters() if p.is_floating_point()), None)
    device = first.device if first is not None else torch.device("cpu")
    mixed = precision != "fp32" and first is not None and first.dtype == torch.float32
    autocast = torch.autocast(device.type, dtype=PRECISION_DTYPES[precision]) if mixed else contextlib.nullcontext()
    candidates = _select(model, blocks, 1, "all")
    towers = {"all": ("vision", "language"), "vision": ("vision",), "language_model": ("language",)}[scope]
    was_training = model.training
    model.train()
    try:
        with autocast:
            costs = measure_block_costs(model, lambda: probe(1, length, chunked_loss), candidates)
    finally:
        model.train(was_training)
    return plan_checkpointing(costs.times(rows), int(budget_gb * 2**30), selective=selective, towers=towers)


def _is_hf_model(model: nn.Module) -> bool:
    return hasattr(model, "gradient_checkpointing_enable") and bool(getattr(model, "supports_gradient_checkpointing",
                                                                            False))


def _enable_hf_checkpointing(model: nn.Module, offload_to_cpu: bool) -> list[str]:
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5.x; the old name warns there
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    # Our function for every HF layer: one code path (offload, measurement) for HF and generic blocks. Not HF's
    # `offload=`: older versions lack it, and HF pins memory even without CUDA.
    func = functools.partial(checkpoint_call, offload_to_cpu=offload_to_cpu)
    for module in model.modules():
        if hasattr(module, "_gradient_checkpointing_func"):
            module._gradient_checkpointing_func = func
    return _hf_checkpointed_blocks(model)


def _hf_checkpointed_blocks(model: nn.Module) -> list[str]:
    """The layers Hugging Face's switch checkpoints: flagged layers in a ModuleList (decoder layers), or every layer
    of a flagged container's ModuleList (encoders that loop over their layers themselves). Read from the flags, not
    from one-class block detection: Mllama's text layers mix self- and cross-attention classes."""
    flagged = {name for name, module in model.named_modules() if getattr(module, "gradient_checkpointing", False)}
    names: list[str] = []
    for name, module in model.named_modules():
        for child_name, child in module.named_children():
            if not isinstance(child, nn.ModuleList):
                continue
            members = [f"{name}.{child_name}.{i}".lstrip(".") for i in range(len(child))]
            marked = [member for member in members if member in flagged]
            names += marked if marked else members if name in flagged else []
    return names


def detach_frozen_modules(model: nn.Module) -> list[str]:
    """Run each fully frozen sub-module without autograd when none of its inputs needs a gradient.

    Usage: ``model.vision_tower.requires_grad_(False); detach_frozen_modules(model)`` -> ``['vision_tower']``

    A frozen tower normally records nothing, but a hook that makes an inner output require grad (Hugging Face's
    ``enable_input_require_grads``, which its checkpointing and PEFT turn on, hooks the vision patch embedding too)
    makes it keep every activation and be back-propagated for nothing. The wrapped forward checks at each call that
    the module is still frozen and its inputs need no grad, so unfreezing later or feeding it trainable inputs is
    safe. Call after freezing; returns the outermost fully frozen modules that were wrapped.
    """
    wrapped: list[str] = []
    for name, module in model.named_modules():
        if not name or any(name.startswith(f"{w}.") for w in wrapped):
            continue
        params = list(module.parameters())
        if params and not any(p.requires_grad for p in params):
            if not getattr(module, _FROZEN, False):
                module._vlmfast_frozen_inner = module.forward
                module.forward = types.MethodType(_frozen_forward, module)
                setattr(module, _FROZEN, True)
            wrapped.append(name)
    return wrapped


def _frozen_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Replacement ``forward`` of a frozen module: no graph when nothing in or under it needs a gradient."""
    inner = self._vlmfast_frozen_inner
    if not torch.is_grad_enabled() or _needs_grad((args, kwargs)) or any(p.requires_grad for p in self.parameters()):
        return inner(*args, **kwargs)
    with torch.no_grad():
        return inner(*args, **kwargs)


def _needs_grad(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return value.requires_grad
    if isinstance(value, dict):
        return any(_needs_grad(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_needs_grad(v) for v in value)
    return False


# ----------------------------------------------------------------------------------------------------------------
# the trainer strategy


class ActivationCheckpointing(Strategy):
    """The ``activation_checkpointing`` spec section as a trainer strategy (apply after freezing).

    Usage: ``model = ActivationCheckpointing(spec.activation_checkpointing).apply(model)``
    """

    name = "activation_checkpointing"

    def __init__(self, spec: ActivationCheckpointingSpec, *, micro_batch_size: int = 1,
                 micro_batch_tokens: int | None = None, precision: str = "fp32", chunked_loss: bool = False) -> None:
        self.spec = spec
        self.blocks: list[str] = []
        self.list_sizes: dict[str, int] = {}
        self.frozen: list[str] = []
        self.hf_native = False
        self.micro_batch_size, self.micro_batch_tokens, self.precision = micro_batch_size, micro_batch_tokens, precision
        self.chunked_loss = chunked_loss  # linear_cross_entropy is on: the loss keeps no logits
        self.plan: CheckpointPlan | None = None

    def apply(self, model: nn.Module) -> nn.Module:
        if not self.spec.enabled:
            return model
        s = self.spec
        if s.budget_gb is not None:
            self.plan = plan_for_budget(model, s.budget_gb, micro_batch_size=self.micro_batch_size,
                                        micro_batch_tokens=self.micro_batch_tokens, seq_len=s.budget_seq_len,
                                        precision=self.precision, selective=s.selective, scope=s.scope,
                                        blocks=s.blocks, chunked_loss=self.chunked_loss)
            self.blocks = apply_checkpoint_plan(model, self.plan, offload_to_cpu=s.offload_to_cpu)
        else:
            self.hf_native = _is_hf_model(model) and not s.blocks and s.every == 1 and s.scope == "all"
            self.blocks = apply_activation_checkpointing(model, blocks=s.blocks, every=s.every, scope=s.scope,
                                                         offload_to_cpu=s.offload_to_cpu)
        self.list_sizes = _list_sizes(model, self.blocks)
        self.frozen = detach_frozen_modules(model)
        return model

    def describe(self) -> str:
        if not self.spec.enabled:
            return "activation checkpointing: off"
        if self.plan is not None:
            frozen = f", frozen {', '.join(self.frozen)} run without autograd" if self.frozen else ""
            return f"activation checkpointing: {self.plan.describe()}{frozen}"
        counts: dict[str, int] = {}
        for name in self.blocks:
            group = _group_of(name, self.list_sizes)
            counts[group] = counts.get(group, 0) + 1
        parts = " + ".join(f"{n}/{self.list_sizes.get(g, n)} {g}" for g, n in counts.items())
        how = "Hugging Face layers, non-reentrant" if self.hf_native else "non-reentrant"
        offload = self.spec.offload_to_cpu
        where = "saved block inputs offloaded to CPU" if offload else "saved activations kept on device"
        frozen = f", frozen {', '.join(self.frozen)} run without autograd" if self.frozen else ""
        return f"activation checkpointing: {parts} blocks ({how}), {where}{frozen}"


def _list_sizes(model: nn.Module, names: list[str]) -> dict[str, int]:
    """Length of the ModuleList each checkpointed block sits in (for 'k/n' in the report)."""
    sizes: dict[str, int] = {}
    for name in names:
        parent = name.rpartition(".")[0]
        if parent and isinstance(model.get_submodule(parent), nn.ModuleList):
            sizes[parent] = len(model.get_submodule(parent))
    return sizes


def _group_of(name: str, list_sizes: dict[str, int]) -> str:
    parent = name.rpartition(".")[0]
    return parent if parent in list_sizes else name
