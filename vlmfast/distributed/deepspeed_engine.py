"""DeepSpeed ZeRO as the training backend: the spec becomes a DeepSpeed config, `deepspeed.initialize` does the rest.

Usage::

    backend = DeepSpeedBackend(TrainSpec(precision="bf16", deepspeed={"enabled": True}), device, world_size)
    engine = backend.initialize(model, optimizer)       # the trainer does this when deepspeed.enabled
    for micro_batch in micro_batches:
        backend.backward(engine(**backend.prepare_inputs(micro_batch)).loss * weight)
    grad_norm = backend.step()

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
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from accelerate.utils import recursively_apply
from torch import nn

from vlmfast.distributed.backend import TorchBackend
from vlmfast.distributed.process_group import ensure_process_group
from vlmfast.spec import SpecError, TrainSpec

if TYPE_CHECKING:
    from vlmfast.strategies.optimizer import Optimization

log = logging.getLogger(__name__)

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


class DeepSpeedBackend(TorchBackend):
    """The DeepSpeed engine behind the trainer's backward / step / checkpoint points."""

    name = "deepspeed"
    owns_precision = True  # bf16/fp16 weights with fp32 master copies in the engine
    sharded_checkpoint = True

    def __init__(self, spec: TrainSpec, device: torch.device, world_size: int) -> None:
        super().__init__(spec, device, world_size)
        self.config = build_deepspeed_config(spec, world_size)
        self.engine: Any = None

    def wrap(self, model: nn.Module, optimization: Optimization) -> nn.Module:
        engine = self.initialize(model, optimization.optimizer)
        optimization.owns_optimizer_state = False  # in DeepSpeed's shards
        return engine

    def weights_state_dict(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        return {}  # weights and optimizer states live in DeepSpeed's shards (save_shards)

    def initialize(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> nn.Module:
        """Wrap `model` and `optimizer` in a DeepSpeed engine (the scheduler stays vlmfast's)."""
        try:
            import deepspeed
        except ImportError as exc:
            raise SpecError("deepspeed.enabled needs DeepSpeed: pip install 'vlmfast[deepspeed]' (on a machine "
                            "without CUDA: DS_BUILD_OPS=0 pip install --no-build-isolation deepspeed)") from exc
        from vlmfast.distributed.build_locks import explain_build_locks

        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)  # its per-step INFO lines drown vlmfast's report
        ensure_process_group()
        with explain_build_locks():  # a killed op build's lock file would make this wait forever, silently
            self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=self.config,
                                                        dist_init_required=False)
        return self.engine

    @property
    def dtype(self) -> torch.dtype:
        return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.spec.precision, torch.float32)

    def sync_context(self, model: nn.Module, is_last: bool) -> AbstractContextManager[Any]:
        # The engine owns the reduction (at backward for ZeRO-2/3, at step for ZeRO-0/1); its no_sync would refuse
        # ZeRO-2/3.
        return nullcontext()

    def prepare_inputs(self, batch: Any) -> Any:
        """Floating inputs (pixel values) in the engine's dtype: DeepSpeed casts the weights, not the inputs."""
        if self.dtype == torch.float32:
            return batch
        return recursively_apply(lambda t: t.to(self.dtype) if t.is_floating_point() else t, batch)

    def backward(self, loss: torch.Tensor) -> None:
        # The loss is already this micro-batch's weighted share of the step's loss: no division by GAS.
        self.engine.backward(loss, scale_wrt_gas=False)

    def step(self) -> tuple[torch.Tensor | None, bool]:
        """Reduce (ZeRO-0/1), clip, step and zero the gradients. Returns (gradient norm before clipping, applied)."""
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = None if norm is None else torch.as_tensor(norm, dtype=torch.float32)
        return norm, bool(self.engine.was_step_applied())

    def save_shards(self, directory: Path) -> None:
        """Every rank writes its shard into `directory/deepspeed` (a collective: all ranks must call it)."""
        self.engine.save_checkpoint(str(directory), tag=CHECKPOINT_TAG, save_latest=False)

    def load_shards(self, directory: Path) -> None:
        """Restore model, optimizer and precision state from a checkpoint written by :meth:`save` (every shard is
        unpickled weights-only: vlmfast.distributed.deepspeed_safe_load)."""
        from vlmfast.distributed.deepspeed_safe_load import weights_only_loading

        with weights_only_loading(self.engine):
            path, _ = self.engine.load_checkpoint(str(directory), tag=CHECKPOINT_TAG, load_lr_scheduler_states=False)
        if path is None:
            raise FileNotFoundError(f"{directory}/{CHECKPOINT_TAG}: no DeepSpeed checkpoint there (was this run "
                                    "trained with deepspeed.enabled and the same zero_stage?)")

    def describe(self) -> list[str]:
        zero = self.config["zero_optimization"]
        offload = "".join(f", {key}={zero[key]['device']}" for key in ("offload_optimizer", "offload_param")
                          if key in zero)
        return [f"deepspeed: ZeRO-{zero['stage']}, {self.spec.precision}{offload}"]
