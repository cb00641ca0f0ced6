"""A full state (one process, DDP, FSDP2: weights and Adam's moments per parameter) loaded into a DeepSpeed ZeRO-1/2/3
engine after ``deepspeed.initialize``, and read back out of it (issue 37: DDP -> ZeRO-3 and the like).

One mechanism for the three stages, through DeepSpeed's own accessors (``deepspeed/utils/tensor_fragment.py``,
DeepSpeed 0.19.8): ``safe_set_full_fp32_param`` / ``safe_set_full_optimizer_state`` write a parameter's full value
into the fp32 master and optimizer-state slices this rank owns (ZeRO-1/2: ``tensor_fragment.set_full_hp_param``
through the parameter's ``_hp_mapping``); ZeRO-3 takes each rank's slice through ``safe_set_local_fp32_param`` /
``safe_set_local_optimizer_state``, cut here with the partition's padding, because its full setter
(``stage3.py``, ``DeepSpeedZeroOptimizer_Stage3.set_full_hp_param``) narrows the unpadded value at
``partition_numel x rank`` and fails on the last rank when a size does not divide by the rank count. The optimizer
state lives per flat fp32 partition, not per parameter: ``optimizer.state[flat]`` with one ``step`` for the whole
partition (``stage_1_and_2.py`` ``single_partition_of_fp32_groups``; ``stage3.py`` ``fp32_partitioned_groups_flat``;
the universal-checkpoint loaders ``base_optimizer.load_hp_checkpoint_state_from_checkpoint_dir`` and
``stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3`` set it the same way). Torch's Adam creates that state
at the first step only, so it is created here (zeros, the saved step) and, under ZeRO-1/2, linked to each parameter's
fragment as the first step would (``_lazy_init_hp_params_optimizer_state``) before the moments are written. The
model's own (low-precision) weights are copied too, gathered under ZeRO-3
(``deepspeed.runtime.zero.GatheredParameters``), so the first forward already runs on the checkpoint's weights.

Usage::

    load_full_state(ds_engine, module, client_optimizer, state, parameter_names)   # state: {"model", "optimizer"}
    state = gather_full_state(ds_engine, module)                                      # every rank calls it
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlmfast.engines.portable_state import is_named, name_optimizer_state

KERNEL_KEYS = ("params", "fused", "foreach", "capturable", "differentiable")  # not carried from another engine


def load_full_state(ds_engine: Any, module: nn.Module, client_optimizer: torch.optim.Optimizer,
                    state: Mapping[str, Any], parameter_names: Sequence[str]) -> None:
    """Load `state` (an engine state another engine wrote: the full model and optimizer state) into the ZeRO engine.
    `parameter_names`: the client optimizer's parameters in its groups' order, taken before ``deepspeed.initialize``
    replaced them (a numbered optimizer state counts in that order). Every rank calls it (ZeRO-3 gathers)."""
    zero = ds_engine.optimizer
    partitions = flat_partitions(zero)
    optimizer_state = state["optimizer"]
    if not is_named(optimizer_state):  # one process or DDP (Optimizer.state_dict()): numbered
        optimizer_state = name_optimizer_state(optimizer_state, parameter_names)
    per_param = optimizer_state["state"]
    keys, step = _moment_keys_and_step(per_param, module)
    _copy_module_weights(module, state["model"], trainable_only=bool(state.get("trainable_only")))
    like = client_optimizer.defaults
    for flat in partitions:  # what Adam's first step would create, with the saved step count
        zero.optimizer.state[flat] = {**({} if step is None else {"step": _step_tensor(step, flat, like)}),
                                      **{key: torch.zeros_like(flat) for key in keys}}
    link = getattr(zero, "_lazy_init_hp_params_optimizer_state", None)  # ZeRO-1/2: each fragment's state views
    if link is not None:
        zero._hp_optimizer_states_linked = False  # link the state just created (done once, after the first step)
        link()
    for name, param in module.named_parameters():
        if param.requires_grad:
            _set_fp32(param, state["model"][name])
            for key in keys:
                _set_moment(param, per_param[name][key], key)
    for group, saved in zip(client_optimizer.param_groups, optimizer_state["param_groups"], strict=True):
        # the hyper-parameters (the lr the schedule left); the kernel stays this optimizer's own
        group.update({key: value for key, value in saved.items() if key not in KERNEL_KEYS})


def gather_full_state(ds_engine: Any, module: nn.Module) -> dict[str, Any]:
    """The trainable parameters' fp32 masters and optimizer state, full and named ({"model": {name: tensor},
    "optimizer": {"state": {name: {step, exp_avg, ...}}}}), from a ZeRO-1/2/3 engine. Every rank calls it (the
    accessors all-gather) and gets the whole of it."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    zero = ds_engine.optimizer
    flat = flat_partitions(zero)[0]
    saved = zero.optimizer.state.get(flat, {})
    keys = [key for key, value in saved.items() if torch.is_tensor(value) and value.shape == flat.shape]
    model, state = {}, {}
    for name, param in module.named_parameters():
        if param.requires_grad:
            model[name] = safe_get_full_fp32_param(param).detach().cpu().clone()
            state[name] = {key: safe_get_full_optimizer_state(param, key).detach().cpu().clone() for key in keys}
            if "step" in saved:
                state[name]["step"] = torch.as_tensor(saved["step"]).detach().cpu().clone()
    return {"model": model, "optimizer": {"state": state}}


def flat_partitions(zero: Any) -> list[torch.Tensor]:
    """This rank's flat fp32 master partitions, the keys of the wrapped optimizer's state (ZeRO-3: one per sub-group;
    ZeRO-1/2: one per parameter group)."""
    for attribute in ("fp32_partitioned_groups_flat", "single_partition_of_fp32_groups"):
        partitions = getattr(zero, attribute, None)
        if partitions:
            return list(partitions)
    raise ValueError(f"{type(zero).__name__} holds no flat fp32 partitions: only a ZeRO-1/2/3 optimizer takes a full "
                     "state from another engine")


def _moment_keys_and_step(per_param: Mapping[str, Mapping[str, Any]],
                          module: nn.Module) -> tuple[list[str], Any]:
    """The element-wise state keys (shaped as their parameter) and the one step count all parameters share; what
    a flat partition cannot hold exactly is refused."""
    # ZeRO-3's parameters are empty placeholders: their full shape is ds_shape
    shapes = {name: getattr(p, "ds_shape", p.shape) for name, p in module.named_parameters() if p.requires_grad}
    missing = sorted(set(shapes) - set(per_param))
    if missing:
        raise ValueError(f"the checkpoint's optimizer has no state for {missing[:3]}: DeepSpeed steps every "
                         "parameter of a flat partition together, so a parameter that never stepped cannot join it")
    keys, steps = set(), set()
    for name, entry in per_param.items():
        for key, value in entry.items():
            if key == "step":
                steps.add(float(value))
            elif torch.is_tensor(value) and value.shape == shapes.get(name):
                keys.add(key)
            else:
                raise ValueError(f"the optimizer state '{key}' of {name} is not shaped as its parameter (a factored "
                                 "or scalar state): a DeepSpeed flat partition cannot hold it exactly")
    if len(steps) > 1:
        raise ValueError(f"the parameters' step counts differ ({sorted(steps)}): DeepSpeed keeps one step per flat "
                         "partition, so the continuation could not be exact")
    return sorted(keys), (steps.pop() if steps else None)


def _step_tensor(step: float, flat: torch.Tensor, defaults: Mapping[str, Any]) -> torch.Tensor:
    """The step as torch's Adam keeps it: a float32 scalar, on the parameter's device for fused / capturable."""
    on_device = defaults.get("fused") or defaults.get("capturable")
    return torch.tensor(step, dtype=torch.float32, device=flat.device if on_device else "cpu")


def _copy_module_weights(module: nn.Module, saved: Mapping[str, torch.Tensor], trainable_only: bool) -> None:
    """The module's own weights (the low-precision copy the forward runs on) and buffers from `saved`."""
    from deepspeed.runtime.zero import GatheredParameters

    from vlmfast.engines.base import check_trainable_names

    if trainable_only:
        check_trainable_names(module, saved, also=(name for name, _ in module.named_buffers()))
    else:
        expected = {name for name, _ in module.named_parameters()} | set(module.state_dict())
        missing = sorted(expected - set(saved))
        if missing:
            raise ValueError(f"the checkpoint's model state lacks {missing[:3]}")
    with torch.no_grad():
        for name, param in module.named_parameters():
            if name in saved:
                with GatheredParameters([param], modifier_rank=0, enabled=hasattr(param, "ds_id")):
                    param.data.copy_(saved[name].reshape(param.shape))
        for name, buffer in module.named_buffers():
            if name in saved:
                buffer.copy_(saved[name])


def _set_fp32(param: nn.Parameter, value: torch.Tensor) -> None:
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_local_fp32_param

    if hasattr(param, "ds_id"):  # ZeRO-3: this rank's padded slice
        safe_set_local_fp32_param(param, _local_slice(param, value))
    else:
        safe_set_full_fp32_param(param, value.to(torch.float32))


def _set_moment(param: nn.Parameter, value: torch.Tensor, key: str) -> None:
    from deepspeed.utils import safe_set_full_optimizer_state, safe_set_local_optimizer_state

    if hasattr(param, "ds_id"):
        safe_set_local_optimizer_state(param, _local_slice(param, value), key)
    else:
        safe_set_full_optimizer_state(param, value.to(torch.float32), key)


def _local_slice(param: nn.Parameter, value: torch.Tensor) -> torch.Tensor:
    """This rank's ZeRO-3 partition of a full value: the flattened value padded to ranks x partition size, as
    ``partition_parameters.py`` (``_partition_param``) lays it out."""
    import torch.distributed as dist

    size = param.ds_tensor.numel()
    group = getattr(param, "ds_process_group", None)
    rank, world = dist.get_rank(group=group), dist.get_world_size(group=group)
    flat = F.pad(value.detach().flatten().to(torch.float32), (0, size * world - value.numel()))
    return flat.narrow(0, size * rank, size)
