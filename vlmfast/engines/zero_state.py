"""A DeepSpeed ZeRO-1/2/3 checkpoint as the full state the other engines load (issue 37: ZeRO-2 -> DDP / one process /
FSDP2, on any rank count; ZeRO-3 the same way, :func:`_full_state_from_zero3`).

A ZeRO-1/2 checkpoint (``vlmfast.engines.deepspeed.DeepSpeedEngine.save_shards``, DeepSpeed 0.19.8) is one
``mp_rank_00_model_states.pt`` (the module's state, ``param_shapes``: the names and shapes of each optimizer group's
parameters in flattening order) and one ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per rank, whose
``optimizer_state_dict`` (``deepspeed/runtime/zero/stage_1_and_2.py``, ``DeepSpeedZeroOptimizer.state_dict``) holds
that rank's slice of each group's flat fp32 master weights (``single_partition_of_fp32_groups``, its padding already
cut: ``_get_groups_without_padding``) and the wrapped torch optimizer's state over those slices
(``base_optimizer_state``: ``Optimizer.state_dict()``, each group one flat tensor still carrying the rank's
``group_paddings``; ``elastic_checkpoint``'s lean form is refused). DeepSpeed's own
``zero_to_fp32._zero2_merge_trainable_params`` rebuilds each parameter from the ranks' slices (concatenated in rank
order, cut by ``param_shapes`` and the ``param_alignment_paddings``); Adam's ``exp_avg`` / ``exp_avg_sq`` slices lie
exactly as the weights do, so the same function rebuilds them, once the padding is cut as
``_get_state_without_padding`` does. The result: the model's state (buffers and frozen weights from the module state,
trainable ones from the fp32 masters, as ``zero_to_fp32._get_fp32_state_dict_from_zero2_checkpoint``) and the
optimizer's state named per parameter (torch's distributed-checkpoint format, which every non-DeepSpeed engine loads:
vlmfast.engines.portable_state). Every shard is unpickled weights-only (vlmfast.engines.deepspeed_safe_load).

Usage::

    state["engine"] = full_state_from_zero(step_folder / "deepspeed", trainable_only="frozen" in state)
"""

from __future__ import annotations

import contextlib
import io
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from vlmfast.engines.deepspeed_safe_load import load_weights_only

CONVERTIBLE_ZERO_STAGES = (1, 2, 3)  # flat fp32 partitions per rank: stage_1_and_2.py's, stage3.py's


def full_state_from_zero(folder: str | Path, trainable_only: bool = False) -> dict[str, Any]:
    """The engine state ({"model", "optimizer"}) a single-process, DDP or FSDP2 engine loads, from the ZeRO-1/2/3
    checkpoint in `folder` (a step folder's ``deepspeed`` sub-folder); `trainable_only`: a LoRA checkpoint (the
    module state lacks the frozen base)."""
    from deepspeed.utils.zero_to_fp32 import get_model_state_file, get_optim_files

    folder = Path(folder)
    if not list(folder.glob("*_optim_states.pt")):  # ZeRO-0: the module and vlmfast's optimizer, as DDP has them
        return _full_state_from_zero0(load_weights_only(get_model_state_file(str(folder), 0)), trainable_only)
    shards = [load_weights_only(file)["optimizer_state_dict"] for file in get_optim_files(str(folder))]
    stage = int(shards[0].get("zero_stage", 0))
    partitions = shards[0]["partition_count"]
    world = max(partitions) if isinstance(partitions, list) else partitions
    if stage not in CONVERTIBLE_ZERO_STAGES or world != len(shards):
        raise ValueError(f"{folder}: a ZeRO-{stage} checkpoint of {world} rank(s) with {len(shards)} optimizer "
                         "shard(s): only a complete ZeRO-1/2/3 checkpoint converts to a full state")
    if stage == 3:
        return _full_state_from_zero3(folder, shards, trainable_only)
    module_state = load_weights_only(get_model_state_file(str(folder), 2))
    param_shapes = module_state["param_shapes"]
    paddings = shards[0].get("param_alignment_paddings")
    # buffers and frozen weights as the module holds them (its dtype); the trainable ones from the fp32 masters
    model = {name: value.detach() for name, value in module_state["module"].items()}
    model.update(_merge([shard["single_partition_of_fp32_groups"] for shard in shards], param_shapes, paddings))
    for alias, source in module_state.get("shared_params", {}).items():  # tied weights, as zero_to_fp32 does
        if source in model:
            model[alias] = model[source]
    return {"model": model, "optimizer": _named_optimizer_state(shards, param_shapes, paddings),
            **({"trainable_only": True} if trainable_only else {})}


def _merge(flat_per_rank: list[list[torch.Tensor]], param_shapes: list[Mapping[str, Any]],
           paddings: list[list[int]] | None) -> dict[str, torch.Tensor]:
    """Each parameter's tensor from the ranks' flat per-group slices (DeepSpeed's own reconstruction)."""
    from deepspeed.utils.zero_to_fp32 import _zero2_merge_trainable_params, zero_model_state

    merged: dict[str, torch.Tensor] = OrderedDict()
    shapes = zero_model_state(buffers={}, param_shapes=param_shapes, shared_params=[], ds_version=None,
                              frozen_param_shapes=None, frozen_param_fragments=None)
    with contextlib.redirect_stdout(io.StringIO()):  # it prints a summary line per call
        _zero2_merge_trainable_params(merged, len(flat_per_rank), flat_per_rank, [shapes], paddings)
    return {name: tensor.detach().clone() for name, tensor in merged.items()}  # views of one concatenation: copies


def _named_optimizer_state(shards: list[Mapping[str, Any]], param_shapes: list[Mapping[str, Any]],
                           paddings: list[list[int]] | None) -> dict[str, Any]:
    """{"state": {name: {step, exp_avg, exp_avg_sq, ...}}, "param_groups": [{..., "params": [names]}]}."""
    saved_groups = shards[0]["base_optimizer_state"]
    if not isinstance(saved_groups, Mapping):  # elastic_checkpoint: _get_base_optimizer_state's lean list
        raise ValueError("a ZeRO checkpoint written with elastic_checkpoint holds no optimizer hyper-parameters: it "
                         "does not convert to another engine; resume it with engine: deepspeed")
    per_rank = [_lean_group_states(shard) for shard in shards]  # [rank][group] -> {key: lean slice or scalar}
    state: dict[str, dict[str, Any]] = {}
    for group, shapes in enumerate(param_shapes):
        keys = per_rank[0][group].keys()
        slices = {key: [[ranks[group][key]] for ranks in per_rank] for key in keys
                  if torch.is_tensor(per_rank[0][group][key]) and per_rank[0][group][key].dim() > 0}
        merged = {key: _merge(flat, [shapes], paddings and [paddings[group]]) for key, flat in slices.items()}
        for name in shapes:  # a scalar (step) copied per parameter: the optimizer increments each in place
            state[name] = {key: merged[key][name] if key in merged else _copy(per_rank[0][group][key]) for key in keys}
    groups = [{**group, "params": list(shapes)}
              for group, shapes in zip(saved_groups["param_groups"], param_shapes, strict=True)]
    return {"state": state, "param_groups": groups}


def _copy(value: Any) -> Any:
    return value.clone() if torch.is_tensor(value) else value


def _lean_group_states(shard: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One rank's optimizer state per group, the rank's alignment padding cut off its flat tensors
    (``DeepSpeedZeroOptimizer._get_state_without_padding``)."""
    base, padding = shard["base_optimizer_state"], shard["group_paddings"]
    return [{key: value[:value.numel() - padding[group]] if torch.is_tensor(value) and value.dim() > 0 else value
             for key, value in base["state"][group].items()} for group in range(len(base["param_groups"]))]


def _full_state_from_zero3(folder: Path, shards: list[Mapping[str, Any]], trainable_only: bool) -> dict[str, Any]:
    """A ZeRO-3 checkpoint's full state: one model-state file per rank (buffers, ``param_shapes``, the frozen
    parameters' fragments) and per rank the flat fp32 partitions of each sub-group (``fp32_flat_groups``, every
    parameter cut into equal padded slices: ``stage3.py`` ``_rigid_state_dict``) with the wrapped Adam's state over
    them (keyed by sub-group). DeepSpeed's ``zero_to_fp32._zero3_merge_trainable_params`` zips each parameter back
    from the ranks' slices (``_zero3_merge_frozen_params`` the frozen ones); ``exp_avg`` / ``exp_avg_sq`` lie as the
    weights do, so the same function rebuilds them; each sub-group's one step is copied to its parameters."""
    from deepspeed.utils.zero_to_fp32 import _zero3_merge_frozen_params, get_model_state_files, zero_model_state

    states = [load_weights_only(file) for file in get_model_state_files(str(folder))]
    models = [zero_model_state(buffers={k: v for k, v in m["module"].items() if k in m["buffer_names"]},
                               param_shapes=m["param_shapes"], shared_params=list(m["shared_params"].items()),
                               ds_version=m.get("ds_version"), frozen_param_shapes=m.get("frozen_param_shapes"),
                               frozen_param_fragments=m.get("frozen_param_fragments")) for m in states]
    model: dict[str, Any] = OrderedDict((name, value.detach()) for name, value in models[0].buffers.items())
    with contextlib.redirect_stdout(io.StringIO()):  # it prints a summary line
        _zero3_merge_frozen_params(model, len(shards), models)
    model.update(_merge3([shard["fp32_flat_groups"] for shard in shards], models))
    for alias, source in models[0].shared_params:  # tied weights, as zero_to_fp32 does
        if source in model:
            model[alias] = model[source]
    per_rank = [shard["optimizer_state_dict"]["state"] for shard in shards]  # [rank][sub-group] -> {key: flat}
    sub_groups = sorted(per_rank[0])
    first = per_rank[0][sub_groups[0]]
    keys = [key for key, value in first.items() if torch.is_tensor(value) and value.dim() > 0]
    merged = {key: _merge3([[ranks[g][key] for g in sub_groups] for ranks in per_rank], models) for key in keys}
    param_shapes = models[0].param_shapes
    state = {name: {**{key: merged[key][name] for key in keys},
                    **{key: _copy(value) for key, value in per_rank[0][g].items() if key not in keys}}
             for g, shapes in zip(sub_groups, param_shapes, strict=True) for name in shapes}
    saved_groups = shards[0]["optimizer_state_dict"]["param_groups"]  # params: sub-group numbers
    groups = [{**group, "params": [name for g in group["params"] for name in param_shapes[g]]}
              for group in saved_groups]
    return {"model": model, "optimizer": {"state": state, "param_groups": groups},
            **({"trainable_only": True} if trainable_only else {})}


def _merge3(flat_per_rank: list[list[torch.Tensor]], models: list[Any]) -> dict[str, torch.Tensor]:
    """Each trainable parameter's tensor from the ranks' flat per-sub-group ZeRO-3 slices (DeepSpeed's own)."""
    from deepspeed.utils.zero_to_fp32 import _zero3_merge_trainable_params

    merged: dict[str, Any] = OrderedDict()
    with contextlib.redirect_stdout(io.StringIO()), _quiet_progress():
        _zero3_merge_trainable_params(merged, len(flat_per_rank), flat_per_rank, models)
    return {name: tensor.contiguous().detach().clone() for name, tensor in merged.items()}


def _quiet_progress() -> contextlib.AbstractContextManager[Any]:
    """zero_to_fp32 wraps its loop in tqdm (to stderr): silenced."""
    return contextlib.redirect_stderr(io.StringIO())


def _full_state_from_zero0(module_state: Mapping[str, Any], trainable_only: bool) -> dict[str, Any]:
    """A ZeRO-0 checkpoint in fp32: DeepSpeed stepped vlmfast's optimizer itself and saved its ``state_dict()`` next to
    the module's (``engine.py`` ``_common_checkpoint_state``: ``optimizer`` when there is no ZeRO optimizer)."""
    optimizer = module_state.get("optimizer")
    if not isinstance(optimizer, Mapping) or not {"state", "param_groups"} <= set(optimizer):
        raise ValueError("a ZeRO-0 checkpoint without a torch optimizer state (DeepSpeed's bf16 / fp16 optimizer "
                         "wrote it): it does not convert to another engine; resume it with engine: deepspeed")
    return {"model": {name: value.detach() for name, value in module_state["module"].items()},
            "optimizer": optimizer, **({"trainable_only": True} if trainable_only else {})}
