"""DeepSpeed ZeRO as the training backend: the spec becomes a DeepSpeed config, `deepspeed.initialize` does the rest.

Usage::

    engine = DeepSpeedEngine(TrainSpec(precision="bf16", engine="deepspeed"), world_size)
    model = engine.setup(model, build_optimizer)         # deepspeed.initialize with vlmfast's optimizer
    for micro_batch in micro_batches:
        engine.backward(model(**engine.prepare_inputs(micro_batch)).loss * weight)
    result = engine.step()                                # StepResult(applied, grad_norm)

vlmfast keeps what it owns on the DDP path, so both give the same training: the micro-batch split and the loss
weighting (DeepSpeed's own division by `gradient_accumulation_steps` is turned off: `scale_wrt_gas=False`), the
optimizer and its parameter groups (a client optimizer) and the learning-rate schedule (stepped by the trainer).
DeepSpeed owns what ZeRO changes: precision (no autocast on top: the engine holds bf16/fp16 weights and fp32
master copies), gradient reduction, clipping and the sharded checkpoint. Accumulation runs in DeepSpeed's unmanaged
mode (`managed_gradient_accumulation: false`): `step()` is the boundary, so a step may have any number of
micro-batches (zero-token micro-batches are skipped, as on the DDP path).
"""

from __future__ import annotations

import copy
import json
import logging
import os
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any

import torch
from accelerate.utils import recursively_apply
from torch import nn

from vlmfast.common.utils import PRECISION_DTYPES, notice_if_slow
from vlmfast.engines.base import Engine, OptimizerFactory, StepResult, check_trainable_names
from vlmfast.engines.build_locks import explain_build_locks
from vlmfast.engines.deepspeed_safe_load import weights_only_loading
from vlmfast.engines.foreign_loops import filter_deepspeed_warnings
from vlmfast.engines.portable_state import parameter_names
from vlmfast.engines.process_group import ensure_process_group
from vlmfast.engines.zero_load import load_full_state
from vlmfast.spec import SpecError, TrainSpec
from vlmfast.strategies.precision import EnginePrecision

log = logging.getLogger(__name__)

# What ZeRO-3's parameter partitioning takes (deepspeed.zero.Init asserts it); DeepSpeed picks its own dtype from
# get_accelerator().is_fp16_supported(), so another one fails on GPUs and fp16-capable CPUs only, deep inside it.
ZERO3_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
CHECKPOINT_TAG = "deepspeed"  # the sub-folder of a vlmfast checkpoint that holds DeepSpeed's sharded files


def build_deepspeed_config(spec: TrainSpec, world_size: int) -> dict[str, Any]:
    """The DeepSpeed config for `spec`: the user's JSON, then the `deepspeed` fields, then what the spec owns."""
    section = spec.deepspeed
    config = _user_config(section.config)
    zero = config.setdefault("zero_optimization", {})
    zero["stage"] = section.zero_stage
    for key in ("overlap_comm", "contiguous_gradients", "reduce_bucket_size", "allgather_bucket_size",
                "stage3_prefetch_bucket_size"):
        value = getattr(section, key)
        if value is not None:  # None: DeepSpeed's default or the user's JSON
            zero[key] = value
    _set_offload(zero, "offload_optimizer", section.offload_optimizer, section.nvme_path)
    _set_offload(zero, "offload_param", section.offload_param, section.nvme_path)
    owned = {
        "train_micro_batch_size_per_gpu": spec.resolved_micro_batch_size,
        "gradient_accumulation_steps": 1,  # nominal: vlmfast owns the boundary (unmanaged mode)
        "train_batch_size": spec.resolved_micro_batch_size * world_size,
        "managed_gradient_accumulation": False,
        "gradient_clipping": spec.grad_clip or 0.0,
        "bf16": {"enabled": spec.precision == "bf16"},
        "fp16": {"enabled": spec.precision == "fp16"},
    }
    for key, value in owned.items():
        _refuse_conflict(config, key, value)
        config[key] = {**config.get(key, {}), **value} if isinstance(value, dict) else value
    config.setdefault("zero_allow_untested_optimizer", True)  # vlmfast passes its own (torch) optimizer
    config.setdefault("zero_force_ds_cpu_optimizer", False)  # ... also with optimizer offload
    config.setdefault("steps_per_print", 2**31 - 1)  # vlmfast logs the steps
    if "optimizer" in config or "scheduler" in config:
        raise SpecError("deepspeed.config: remove 'optimizer'/'scheduler': vlmfast builds them from the spec's "
                        "optimizer and scheduler sections (one place for each setting)")
    return config


def _user_config(source: Path | dict[str, Any] | None) -> dict[str, Any]:
    if source is None:
        return {}
    if isinstance(source, dict):
        return copy.deepcopy(source)
    try:
        return json.loads(Path(source).read_text())
    except json.JSONDecodeError as exc:
        raise SpecError(f"deepspeed.config: {source} is not valid JSON: {exc}") from exc


def _set_offload(zero: dict[str, Any], key: str, device: str, nvme_path: Path | None) -> None:
    if device == "none":
        return
    target = {"device": device, "pin_memory": torch.cuda.is_available()}
    if device == "nvme":
        target["nvme_path"] = str(nvme_path)
    zero[key] = {**zero.get(key, {}), **target}


def _refuse_conflict(config: dict[str, Any], key: str, value: Any) -> None:
    """The user's JSON may not silently disagree with the spec on batch sizes, precision or clipping."""
    if key not in config or key in ("gradient_accumulation_steps", "train_batch_size"):
        return  # DeepSpeed's "auto"-style placeholders and GAS: vlmfast sets them (accumulation is its own)
    theirs = config[key]
    if isinstance(value, dict):
        theirs = theirs.get("enabled", value["enabled"]) if isinstance(theirs, dict) else theirs
        value = value["enabled"]
    if theirs not in (value, "auto"):
        field = {"train_micro_batch_size_per_gpu": "micro_batch_size", "gradient_clipping": "grad_clip",
                 "managed_gradient_accumulation": "(none: vlmfast splits the batch)"}.get(key, "precision")
        raise SpecError(f"deepspeed.config sets {key}={theirs!r} but the spec says {value!r}: set it through the "
                        f"spec field {field} and remove it from the DeepSpeed JSON")


DEEPSPEED_BUILD_NOTICE = (
    "DeepSpeed is still starting after 10 s: on first use it compiles its C++ ops with ninja (minutes on a CPU "
    "machine; cached under TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions, so later runs start at once). "
    "If nothing happens for much longer, another process may hold (or a killed one may have left) the build's "
    "lock file in that folder")


class DeepSpeedEngine(Engine):
    """The DeepSpeed engine behind the loop's backward / step / checkpoint points."""

    name = "deepspeed"
    writes_shards = True  # every rank writes its ZeRO shard
    can_probe = False

    @property
    def shards_parameters(self) -> bool:
        return self.spec.deepspeed.zero_stage == 3  # ZeRO-1/2 shard optimizer states and gradients only

    def __init__(self, spec: TrainSpec, world_size: int) -> None:
        super().__init__(EnginePrecision(spec.precision, "DeepSpeed (bf16/fp16 weights, fp32 masters)"), world_size)
        self.spec = spec
        self.config = build_deepspeed_config(spec, world_size)
        self.engine: Any = None

    def setup(self, model: nn.Module, build_optimizer: OptimizerFactory) -> nn.Module:
        """Wrap `model` and its optimizer in a DeepSpeed engine (the scheduler stays vlmfast's)."""
        try:
            import deepspeed
        except ImportError as exc:
            raise SpecError("engine: deepspeed needs DeepSpeed: pip install 'vlmfast[deepspeed]' (on a machine "
                            "without CUDA: DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed)") from exc
        if self.shards_parameters:
            refuse_zero3_dtypes(model)
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its per-step INFO lines drown vlmfast's report
        filter_deepspeed_warnings()  # torch's per-step deprecation FutureWarnings for DeepSpeed's collectives
        ensure_process_group()
        # DeepSpeed reads LOCAL_RANK at initialize and while the engine lives (runtime/engine.py
        # _do_args_sanity_check, zero/utils.py, zero/partition_parameters.py); a launcher sets it, one process not.
        os.environ.setdefault("LOCAL_RANK", "0")
        self.module, self.optimizer = model, build_optimizer(model)
        # a numbered optimizer state counts the parameters in this order; deepspeed.initialize replaces them
        self.parameter_names = parameter_names(self.optimizer, model)
        with explain_build_locks(), notice_if_slow(DEEPSPEED_BUILD_NOTICE):  # a stale lock; a slow first build
            self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=self.config,
                                                        dist_init_required=False)
        return self.engine

    @property
    def dtype(self) -> torch.dtype:
        return PRECISION_DTYPES[self.spec.precision]

    def sync_context(self, model: nn.Module, last_micro_batch: bool) -> AbstractContextManager[Any]:
        # The engine owns the reduction (at backward for ZeRO-2/3, at step for ZeRO-0/1); its no_sync would refuse
        # ZeRO-2/3.
        return nullcontext()

    def prepare_inputs(self, batch: Any) -> Any:
        """Floating inputs (pixel values) in the engine's dtype: DeepSpeed casts the weights, not the inputs."""
        if self.dtype == torch.float32:
            return batch
        return recursively_apply(lambda t: t.to(self.dtype) if t.is_floating_point() else t, batch)

    def backward(self, loss: torch.Tensor) -> None:
        # The loss is already this micro-batch's share of the global loss: no division by GAS; DeepSpeed averages
        # over ranks, so the share is multiplied back by the world size (as DDP's).
        self.engine.backward(loss * self.world_size if self.world_size > 1 else loss, scale_wrt_gas=False)

    def scale_gradients(self, factor: float) -> None:
        if factor != 1.0:
            raise SpecError("with engine: deepspeed, loss weights must be known before backward (the engine reduces "
                            "gradients as they come): let loss_fn return the mean loss and set loss.label_key, or "
                            "loss.weighting: samples")

    def clip_gradients(self, max_norm: float) -> torch.Tensor | None:
        return None  # DeepSpeed clips inside step() (gradient_clipping in its config) and reports the norm there

    def step(self) -> StepResult:
        """Reduce (ZeRO-0/1), clip, step and zero the gradients."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = None if norm is None else torch.as_tensor(norm, dtype=torch.float32)
        return StepResult(bool(self.engine.was_step_applied()), norm)

    def skip_step(self) -> None:
        # Only reached with fp16 (the spec refuses loss.on_nonfinite: skip otherwise): DeepSpeed's loss scaler sees
        # the overflow in step() and skips the update itself, backing off its scale.
        self.engine.step()

    @property
    def keeps_trainable_only(self) -> bool:
        """ZeRO-0/1/2: a LoRA checkpoint holds no frozen parameter (save_shards). ZeRO-3: the whole state (its frozen
        fragments). The frozen base's fingerprint (vlmfast.strategies.lora.frozen_fingerprint) now gathers ZeRO-3's
        placeholders, so a trainable-only ZeRO-3 checkpoint could be checked too; DeepSpeed's
        exclude_frozen_parameters under ZeRO-3 is not tried here yet."""
        return not self.shards_parameters

    def state_dict(self, trainable_only: bool = False) -> dict[str, Any]:
        return {}  # weights and optimizer states live in DeepSpeed's shards (save_shards)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """A full state another engine wrote (one process, DDP, FSDP2: "model" and "optimizer") goes into the ZeRO
        partitions (vlmfast.engines.zero_load); DeepSpeed's own checkpoint is restored by :meth:`load_shards`."""
        if "model" in state and self.engine.optimizer is self.optimizer:  # ZeRO-0 in fp32: no wrapper
            super().load_state_dict(state)  # the module and vlmfast's own optimizer, as DDP loads them
        elif "model" in state:
            load_full_state(self.engine, self.module, self.optimizer, state, self.parameter_names)

    def save_shards(self, directory: Path, trainable_only: bool = False) -> None:
        """Every rank writes its shard into `directory/deepspeed` (a collective: all ranks must call it).
        `trainable_only` (DeepSpeed 0.19.8, runtime/engine.py): `save_checkpoint(exclude_frozen_parameters=True)`
        drops the frozen parameters from `module_state_dict` (buffers stay) and, under ZeRO-2, the copy of them
        `_save_checkpoint` adds otherwise (`frozen_param_fragments`, `save_frozen_param`); the ZeRO optimizer shards
        (`_save_zero_checkpoint`) hold the optimizer's, i.e. trainable, parameters only in any case."""
        self.engine.save_checkpoint(str(directory), tag=CHECKPOINT_TAG, save_latest=False,
                                    exclude_frozen_parameters=trainable_only and self.keeps_trainable_only)

    def reads_shards(self, saved_spec: dict[str, Any], saved_world: int) -> bool:
        """Its own layout only: the same rank count and ZeRO stage (another one goes through the full state)."""
        stage = saved_spec.get("deepspeed", {}).get("zero_stage", 2)
        return (saved_world, stage) == (self.world_size, self.spec.deepspeed.zero_stage)

    def load_shards(self, directory: Path) -> None:
        """Restore model, optimizer and precision state from a checkpoint written by :meth:`save_shards` (every
        shard is unpickled weights-only: vlmfast.engines.deepspeed_safe_load)."""
        with weights_only_loading(self.engine):
            # A LoRA checkpoint lacks the frozen parameters. `load_module_strict=False` would accept any missing key;
            # `custom_load_fn` replaces the module load of `load_module_state_dict` (ignoring that flag), and ours
            # checks the names first. Under ZeRO-1/2 the trainable weights are then refreshed from the fp32
            # partitions of the optimizer shards (`_load_zero_checkpoint`).
            path, _ = self.engine.load_checkpoint(str(directory), tag=CHECKPOINT_TAG, load_lr_scheduler_states=False,
                                                  custom_load_fn=_load_module if self.keeps_trainable_only else None)
        if path is None:
            raise FileNotFoundError(f"{directory}/{CHECKPOINT_TAG}: no DeepSpeed checkpoint there (was this run "
                                    "trained with engine: deepspeed and the same zero_stage?)")

    def describe(self) -> list[str]:
        zero = self.config["zero_optimization"]
        offload = "".join(f", {key}={zero[key]['device']}" for key in ("offload_optimizer", "offload_param")
                          if key in zero)
        return [f"deepspeed: ZeRO-{zero['stage']}, {self.spec.precision}{offload}"]


def refuse_zero3_dtypes(model: nn.Module) -> None:
    """A SpecError naming the dtype and a parameter when ZeRO-3 cannot partition the model's floating parameters
    (float64): checked before DeepSpeed sees the model, on every machine alike."""
    for name, param in model.named_parameters():
        if param.is_floating_point() and param.dtype not in ZERO3_DTYPES:
            raise SpecError(f"deepspeed.zero_stage: 3 partitions float32, bfloat16 or float16 parameters; {name} is "
                            f"{param.dtype}: convert the model first (model.float(); precision: bf16 or fp16 then "
                            "sets the compute dtype), or use deepspeed.zero_stage: 2 or engine: ddp | fsdp")


def _load_module(src: dict[str, Any], dst: nn.Module) -> None:
    """DeepSpeed's `custom_load_fn`: a module state with every key (any run), or without the frozen parameters (a LoRA
    checkpoint: save_shards(trainable_only=True); the frozen base was checked by its fingerprint before loading)."""
    frozen = {name for name, p in dst.named_parameters() if not p.requires_grad}
    if not frozen or not frozen.isdisjoint(src):
        dst.load_state_dict(src)  # strict: the whole state
        return
    check_trainable_names(dst, src, also=(name for name, _ in dst.named_buffers()))
    dst.load_state_dict(src, strict=False)
