"""The training spec: one Pydantic model, one sub-model per strategy.

Usage::

    spec = TrainSpec.from_file("run.yaml")          # or TrainSpec(batch_size=16, precision="bf16")
    spec.to_file("resolved.yaml")

Every optimisation is one field (or one section) that is off by default. Unknown keys are errors that name the key
and suggest the closest valid one; cross-field mistakes fail here, before any model or data is touched. Checks
that depend on the machine (fp16 needs CUDA) live in :func:`check_environment`, so a spec written for a GPU box can
still be validated on a laptop.
"""

from __future__ import annotations

import json
import logging
import re
import sys
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from vlmfast.common.sections import Section, SpecError, set_root
from vlmfast.reporting.tracking import MLflowSpec, WandbSpec
from vlmfast.strategies.ema import EMASpec
from vlmfast.strategies.linear_cross_entropy import LinearCrossEntropySpec
from vlmfast.strategies.lora import LoRASpec
from vlmfast.strategies.vision_cache import VisionCacheSpec

log = logging.getLogger(__name__)

Precision = Literal["fp32", "bf16", "fp16"]
DEVICE_NAME = re.compile(r"auto|cpu|mps|(cuda|xpu|hpu|npu)(:\d+)?")


def _check_backend(spec: TrainSpec) -> None:
    """What the sharded backends cannot do, said before any work (docs/distributed.md explains why)."""
    name = {"deepspeed": "engine: deepspeed", "fsdp": "engine: fsdp"}.get(spec.engine)
    if name is None:
        return
    if spec.oom.enabled:
        raise ValueError(f"oom.enabled does not work with {name}: a rank that runs out of memory mid-backward leaves "
                         "the others inside a sharded reduction. Use `vlmfast find-batch-size` to pick "
                         "micro_batch_size, or activation_checkpointing / ZeRO offload for headroom")
    if spec.ddp.comm_hook != "none":
        raise ValueError(f"ddp.comm_hook is a DDP feature and does nothing with {name}: set ddp.comm_hook: none")
    if spec.lora.quantize != "none":
        raise ValueError(f"lora.quantize: {spec.lora.quantize} is not supported with {name} (sharding bitsandbytes' "
                         "4-bit weights is untested here): use engine: ddp (one GPU or DDP), or lora.quantize: none")
    if spec.engine == "deepspeed" and spec.loss.on_nonfinite == "skip" and spec.precision != "fp16":
        raise ValueError("loss.on_nonfinite: skip needs precision fp16 with engine: deepspeed (DeepSpeed's loss "
                         "scaler skips overflowing steps; other steps are reduced before vlmfast sees them): "
                         "use loss.on_nonfinite: stop")


class ParamGroupSpec(Section):
    """Optimizer settings for the parameters of some sub-modules (matched by name prefix or glob)."""

    modules: list[str] = Field(min_length=1, description="module paths (at any depth) or globs, e.g. ['vision_tower']")
    lr: float | None = Field(None, gt=0, description="learning rate for these parameters (default: optimizer.lr)")
    weight_decay: float | None = Field(None, ge=0, description="weight decay for these parameters")


class OptimizerSpec(Section):
    """Optimizer, parameter groups and frozen sub-modules."""

    name: Literal["adamw", "sgd", "adafactor"] = Field("adamw", description="optimizer")
    lr: float = Field(1e-3, gt=0, description="base learning rate")
    weight_decay: float = Field(0.0, ge=0, description="decoupled weight decay (AdamW) / L2 (SGD)")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    eps: float = Field(1e-8, gt=0, description="AdamW epsilon")
    momentum: float = Field(0.0, ge=0, description="SGD momentum")
    implementation: Literal["auto", "fused", "foreach", "for_loop"] = Field(
        "auto", description="AdamW/SGD kernel: auto takes fused where torch supports it on the device, else foreach"
    )
    no_decay_norm_and_bias: bool = Field(True, description="exclude norms, biases and embeddings from weight decay")
    param_groups: list[ParamGroupSpec] = Field(
        default_factory=list, description="per-module learning rates, e.g. a lower lr for the vision tower"
    )
    freeze: list[str] = Field(
        default_factory=list, description="module paths (at any depth) or globs to freeze, e.g. ['vision_tower']"
    )


class SchedulerSpec(Section):
    """Learning-rate schedule with linear warm-up."""

    name: Literal["constant", "linear", "cosine"] = Field("constant", description="shape after warm-up")
    warmup_steps: int = Field(0, ge=0, description="linear warm-up from 0 over this many optimizer steps")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final lr as a fraction of the peak (linear, cosine)")


class LossSpec(Section):
    """How micro-batch losses are weighted so that any micro-batch split gives the full-batch gradient."""

    weighting: Literal["auto", "tokens", "samples"] = Field(
        "auto", description="tokens: by loss tokens (labels != ignore_index); samples: by samples; auto: tokens "
        "when the batch has labels, else samples"
    )
    label_key: str = Field("labels", description="batch key holding the labels")
    ignore_index: int = Field(-100, description="label value that carries no loss")
    shift_labels: Literal["auto", "yes", "no"] = Field(
        "auto", description="whether the model predicts labels[t+1] at t (causal LM); auto asks the model"
    )
    on_nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="a NaN/Inf loss or gradient norm: stop with a message naming the step, or skip the step"
    )
    max_consecutive_skips: int = Field(5, ge=1, description="with on_nonfinite=skip, stop after this many in a row")


class ActivationCheckpointingSpec(Section):
    """Recompute activations of repeated blocks in backward instead of keeping them (memory for ~30% compute)."""

    enabled: bool = Field(False, description="checkpoint repeated blocks (non-reentrant torch.utils.checkpoint)")
    blocks: list[str] = Field(
        default_factory=list, description="module paths/globs of the blocks or ModuleLists to checkpoint; "
        "empty: auto-detect ModuleLists of identical blocks (Hugging Face models use their own method)"
    )
    every: int = Field(1, ge=1, description="checkpoint every k-th block (1: all)")
    scope: Literal["all", "language_model", "vision"] = Field(
        "all", description="which tower to checkpoint (the language model usually holds most activations)"
    )
    offload_to_cpu: bool = Field(False, description="also move saved activations to CPU (save_on_cpu)")
    budget_gb: float | None = Field(
        None, gt=0, description="activations kept per micro-batch (GiB): checkpoint only the blocks (and ops) needed "
        "to fit, recomputing the fewest FLOPs; measured per block with one probe forward of one sample"
    )
    budget_seq_len: int | None = Field(
        None, ge=2, description="with budget_gb: tokens per sample (image tokens included) to plan for; default: "
        "the model's longest"
    )
    selective: bool = Field(
        True, description="with budget_gb: a block may also be checkpointed op by op (keep matmul and attention "
        "outputs, recompute the elementwise ops: torch's selective checkpointing)"
    )

    @model_validator(mode="after")
    def _check_budget(self) -> ActivationCheckpointingSpec:
        if self.budget_gb is not None and not self.enabled:
            raise ValueError("activation_checkpointing.budget_gb is set but enabled is false: set enabled: true")
        if self.budget_gb is not None and self.every != 1:
            raise ValueError("activation_checkpointing.budget_gb picks the blocks itself: leave every at 1")
        return self


class OOMSpec(Section):
    """Out-of-memory fallback: halve the micro-batch and retry the same optimizer batch (same gradient)."""

    enabled: bool = Field(False, description="catch OOM in forward/backward, shrink the micro-batch and retry")
    min_micro_batch_size: int = Field(1, ge=1, description="below this, stop with a memory summary and advice")
    grow_after_steps: int | None = Field(
        200, ge=1, description="after this many clean steps try doubling the micro-batch again (null: never)"
    )
    expandable_segments: bool = Field(
        False, description="PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before CUDA starts (less fragmentation)"
    )


class MemorySpec(Section):
    """Memory monitoring: leak detection, allocator history snapshots, the timeline plot."""

    leak_check: bool = Field(True, description="warn when memory keeps growing after warm-up (names the rate)")
    leak_warmup_steps: int = Field(20, ge=0, description="steps ignored before leak detection starts")
    leak_window_steps: int = Field(50, ge=5, description="steps over which the growth trend is measured")
    leak_threshold_mb_per_step: float = Field(1.0, gt=0, description="growth rate that counts as a leak")
    record_history: bool = Field(
        False, description="CUDA: record allocator history and dump a snapshot (memory_viz) on OOM into log.dir"
    )
    timeline_plot: bool = Field(True, description="write memory_timeline.png to log.dir at the end of the run")


class PowerSGDSpec(Section):
    """PowerSGD gradient compression (low-rank), torch's powerSGD_hook settings."""

    rank: int = Field(1, ge=1, description="matrix approximation rank: higher is more exact and sends more")
    start_iter: int = Field(10, ge=2, description="plain all-reduce for this many steps first (>= 2: DDP rebuilds "
                            "its buckets after step 1)")
    warm_start: bool = Field(True, description="reuse last step's low-rank factors (faster convergence)")
    error_feedback: bool = Field(True, description="carry the compression error to the next step")
    min_compression_rate: float = Field(2.0, gt=0, description="compress a tensor only if it saves this factor")


class DDPSpec(Section):
    """DistributedDataParallel: bucketing, graph options and gradient-communication hooks."""

    bucket_cap_mb: float = Field(25.0, gt=0, le=1e6, description="gradient bucket size for the overlapped all-reduce")
    gradient_as_bucket_view: bool = Field(True, description="gradients are views into the buckets (saves a copy)")
    static_graph: bool = Field(False, description="the graph is the same every step (enables extra optimisations)")
    find_unused_parameters: bool = Field(
        False, description="search the graph for parameters without gradient each step (slower; needed when a "
        "trainable module is skipped in forward)"
    )
    broadcast_buffers: bool = Field(True, description="broadcast buffers (e.g. BatchNorm stats) from rank 0")
    sync_each_micro_batch: bool = Field(
        False, description="all-reduce after every micro-batch instead of only the last (less peak memory, more "
        "communication)"
    )
    comm_hook: Literal["none", "fp16", "bf16", "powersgd", "batched_powersgd"] = Field(
        "none", description="gradient communication: fp16/bf16 compression or PowerSGD (bf16 needs NCCL)"
    )
    comm_wrapper: Literal["none", "fp16", "bf16"] = Field(
        "none", description="with PowerSGD: also send the compressed factors in fp16/bf16"
    )
    powersgd: PowerSGDSpec = Field(default_factory=PowerSGDSpec)
    timeout_minutes: float = Field(
        10.0, gt=0, le=1e6, description="collective timeout: a rank that dies makes the others fail after this long"
    )
    nccl_presets: list[Literal["async_errors", "infiniband", "nvlink", "small_buffers"]] = Field(
        default_factory=list, description="NCCL environment presets applied before the process group starts "
        "(never overriding variables already set); see docs/distributed.md"
    )


Offload = Literal["none", "cpu", "nvme"]


class DeepSpeedSpec(Section):
    """DeepSpeed ZeRO settings, used with `engine: deepspeed` (`pip install vlmfast[deepspeed]`)."""

    zero_stage: Literal[0, 1, 2, 3] = Field(2, description="0: none; 1: optimizer states; 2: + gradients; "
                                            "3: + parameters sharded across ranks")
    offload_optimizer: Offload = Field("none", description="keep optimizer states (and the step) on CPU or NVMe")
    offload_param: Offload = Field("none", description="keep parameters on CPU or NVMe (ZeRO-3 only)")
    nvme_path: Path | None = Field(None, description="folder for NVMe offload")
    overlap_comm: bool | None = Field(None, description="overlap gradient reduction with backward "
                                      "(default: DeepSpeed's own, on for ZeRO-3)")
    contiguous_gradients: bool | None = Field(None, description="copy gradients into one buffer (less fragmentation)")
    reduce_bucket_size: int | None = Field(None, ge=1, description="elements reduced at once")
    allgather_bucket_size: int | None = Field(None, ge=1, description="elements all-gathered at once (ZeRO-1/2)")
    stage3_prefetch_bucket_size: int | None = Field(None, ge=1, description="elements prefetched ahead (ZeRO-3)")
    config: Path | dict[str, Any] | None = Field(
        None, description="your own DeepSpeed JSON (path or dict), merged under the fields above; batch sizes, "
        "precision and clipping always come from the spec (a conflicting value is an error)"
    )

    @model_validator(mode="after")
    def _check(self) -> DeepSpeedSpec:
        if self.offload_param != "none" and self.zero_stage != 3:
            raise ValueError(f"deepspeed.offload_param needs zero_stage 3 (got {self.zero_stage}): "
                             "set deepspeed.zero_stage: 3 or offload_param: none")
        if "nvme" in (self.offload_optimizer, self.offload_param) and self.nvme_path is None:
            raise ValueError("deepspeed NVMe offload needs deepspeed.nvme_path (a folder on a fast local disk)")
        if isinstance(self.config, Path) and not self.config.is_file():
            raise ValueError(f"deepspeed.config: file not found: {self.config}")
        return self


class FSDPSpec(Section):
    """FSDP2 (`torch.distributed.fsdp.fully_shard`) settings, used with `engine: fsdp`."""

    reshard_after_forward: bool = Field(True, description="free gathered parameters after forward (ZeRO-3-like); "
                                        "off keeps them until backward (ZeRO-2-like, faster, more memory)")
    blocks: list[str] = Field(default_factory=list, description="classes or globs of the modules sharded one by one "
                              "(default: the repeated blocks activation checkpointing finds)")


class RankBalanceCost(Section):
    """A sample's estimated cost: tokens x per_token + tokens^2 x per_token_pair + images x per_image."""

    per_token: float = Field(1.0, ge=0, description="cost of a text token")
    per_token_pair: float = Field(0.0, ge=0, description="cost per squared token (attention)")
    per_image: float = Field(0.0, ge=0, description="cost of an image (the vision tower)")


class DataSpec(Section):
    """DataLoader settings for the per-rank optimizer batch."""

    num_workers: int | Literal["auto"] = Field(
        0, description="DataLoader worker processes; auto: measure a few batches at candidate counts (bounded by "
        "CPU count and memory, within autotune_budget_s) and take the fastest"
    )
    pin_memory: bool | None = Field(None, description="page-locked host batches; default: on when training on CUDA")
    persistent_workers: bool = Field(
        True, description="keep a stream's workers alive across epochs (a Dataset's loader reads the whole run in "
        "one iteration, so its workers start once, before the first step, either way)")
    prefetch_factor: int | None = Field(None, ge=1, description="batches prefetched per worker")
    autotune_budget_s: float = Field(10.0, gt=0, description="num_workers auto: seconds of measuring, in all")
    autotune_max_workers: int | None = Field(
        None, ge=1, description="num_workers auto: largest count tried (default: CPU count, lowered to fit memory)"
    )
    device_prefetch: bool | None = Field(
        None, description="load and copy the next batches to the device in a background thread while the step "
        "computes (side CUDA stream, non_blocking from pinned memory); default: on when training on CUDA (on CPU the "
        "thread competes with the step for cores: measured 0.86-0.95x on 2 cores)"
    )
    device_image_size: int | None = Field(
        None, ge=1, description="resize + normalise the batch's raw images (key image_key: a list of uint8 [3, H, W] "
        "tensors) on the device, one batched op per image size, into pixel_values; implies device_prefetch"
    )
    image_key: str = Field("images", description="batch key of the raw images for device_image_size")
    image_mean: tuple[float, float, float] = Field((0.5, 0.5, 0.5), description="normalisation mean (0-1 scale)")
    image_std: tuple[float, float, float] = Field((0.5, 0.5, 0.5), description="normalisation std (0-1 scale)")
    check_samples: Literal["skip", "error", "off"] = Field(
        "skip", description="host-side check of every batch (integer token ids and labels within the model's "
        "vocabulary, finite pixel values; no device sync): skip: drop a failing sample and count it as bad; error: "
        "stop naming it; off: no check"
    )
    max_bad_sample_fraction: float = Field(
        0.01, ge=0, le=1, description="stop with an error naming the sample (or shard) when more than this share of "
        "samples (over at least 100) is unreadable or does not fit its batch; they are skipped and counted until then"
    )
    timeout_s: float = Field(
        600.0, ge=0, allow_inf_nan=False, description="stop with a DataLoaderTimeoutError naming the worker and "
        "sample indices when a batch takes longer than this to load (the final checkpoint is written first, on one "
        "rank); 0: wait forever. Enforced with and without worker processes and under device_prefetch (docs/data.md)"
    )

    @field_validator("num_workers")
    @classmethod
    def _workers_not_negative(cls, value: int | str) -> int | str:
        if isinstance(value, int) and value < 0:
            raise ValueError(f"num_workers must be >= 0 or 'auto', got {value}")
        return value

    shuffle: bool = Field(True, description="reshuffle every epoch (seeded, so resume is exact)")
    drop_last: bool = Field(True, description="drop a final partial batch so every step sees batch_size samples")
    group_by_length: Literal["none", "length", "modality_length"] = Field(
        "none", description="batches of similar length, longest first (modality_length: image and text-only "
        "samples apart, LLaVA); needs dataset.lengths / modality_lengths, see docs/grouping.md"
    )
    rank_balance: Literal["off", "tokens", "cost"] = Field(
        "off", description="deal each global batch to ranks so the most loaded rank's estimated cost is lowest "
        "(tokens: text tokens; cost: tokens, their square and images, from FLOP counts or rank_balance_cost); needs "
        "dataset.lengths, see docs/distributed.md")
    rank_balance_cost: RankBalanceCost | None = Field(
        None, description="rank_balance: cost coefficients to use instead of the model's FLOP counts")


class ExportSpec(Section):
    """The trained model exported at the end of a completed fit() (not an interrupted one): docs/lora.md#export."""

    dir: Path | None = Field(None, description="folder for the exported model (a LoRA run: PEFT's adapter folder; a "
                             "Hugging Face model: save_pretrained; else model.safetensors and vlmfast_export.json, "
                             "what rebuilds it); written into a private folder that then takes its place; no export "
                             "when unset")
    merge: bool = Field(False, description="a LoRA run exports the merged model (adapters folded into the base: "
                        "from_pretrained without PEFT) instead of the adapter folder")
    overwrite: bool = Field(False, description="replace dir whatever it holds; off: a dir holding anything but a "
                            "previous export of the same kind is refused when the trainer is built")


class SaveSpec(Section):
    """Checkpoints: atomic, the newest `keep_last` kept, exact resume."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, validate_by_name=True, validate_by_alias=True)

    dir: Path | None = Field(None, description="checkpoint folder; no checkpoints when unset")
    every_steps: int | None = Field(None, ge=1, description="save every N optimizer steps (and at the end)")
    keep_last: int = Field(3, ge=1, description="complete checkpoints to keep")
    resume: str = Field(
        "auto", description="'auto': newest complete checkpoint in dir if any; 'never'; or a checkpoint path"
    )
    on_interrupt: bool = Field(True, description="SIGTERM / Ctrl-C writes a final checkpoint before exiting")
    accept_data_change: bool = Field(
        False, description="resume even though the training data differs from the checkpoint's (its fingerprint: "
        "length, per-sample lengths, a hash of a few samples, the sampler's settings); the data position is mapped "
        "onto the new data and the change is logged. Off: such a resume is refused, naming what changed"
    )
    async_: bool = Field(
        False, alias="async", description="the step waits only for a copy of the state in host memory; writing, "
        "fsync, the manifest and the rename run in a background thread (one save in flight; the next save and the "
        "end of the run wait for it; a failed save is reported at the next step)"
    )
    export: ExportSpec = Field(default_factory=ExportSpec, description="export the model when a fit() completes")


class EvalSpec(Section):
    """Evaluation on `eval_data`: token-weighted mean loss, no gradients."""

    every_steps: int | None = Field(None, ge=1, description="evaluate every N steps (always once at the end)")
    max_batches: int | None = Field(None, ge=1, description="cap on evaluation batches (default: all)")


class LogSpec(Section):
    """Metrics and progress output."""

    dir: Path | None = Field(None, description="folder for metrics.jsonl, TensorBoard events and the report")
    every_steps: int = Field(1, ge=1, description="write metrics every N optimizer steps")
    memory_every_steps: int = Field(
        10, ge=1, description="read device memory every N steps (a process-RSS read costs ~0.1 ms on CPU)"
    )
    tensorboard: bool = Field(False, description="also write TensorBoard events to dir (needs tensorboard)")
    straggler: bool = Field(False, description="several ranks: each rank's compute time up to its last gradient "
                            "and the spread across ranks per step (one small all-reduce; on with data.rank_balance)")
    wandb: WandbSpec = Field(default_factory=WandbSpec, description="Weights & Biases: the metrics.jsonl figures")
    mlflow: MLflowSpec = Field(default_factory=MLflowSpec, description="MLflow: the metrics.jsonl figures")
    progress: Literal["auto", "on", "off", "lines"] = Field(
        "auto", description="on: a progress bar; lines: a plain line (step, loss, samples/s, tokens/s, ETA) every "
        "lines_every_steps steps or lines_every_s seconds, whichever comes first (for a log file); auto: the bar on "
        "a terminal, lines when stderr is not one (a file, nohup, a cluster job); off: neither"
    )
    lines_every_steps: int = Field(50, ge=1, description="progress: lines: a line every N optimizer steps (and the "
                                   "first and last step)")
    lines_every_s: float = Field(30.0, gt=0, description="progress: lines: a line at the first step that ends N "
                                 "seconds or more after the previous line")
    history_steps: int = Field(
        10_000, ge=1, description="per-step records kept in memory (FitResult.history, the profiler's step times); "
        "older ones are dropped so long runs do not grow (metrics.jsonl keeps every step)"
    )

    @field_validator("progress", mode="before")
    @classmethod
    def _yaml_on_off(cls, value: Any) -> Any:
        # YAML 1.1 reads a bare on/off as a boolean: `progress: off` must still mean "off".
        return {True: "on", False: "off"}.get(value, value) if isinstance(value, bool) else value


class CompileSpec(Section):
    """torch.compile of the whole model or of each repeated block; a compile error falls back to eager."""

    enabled: bool = Field(False, description="compile with torch.compile (the work happens at the first step)")
    scope: Literal["model", "blocks"] = Field(
        "model", description="model: the whole forward in one graph; blocks: each repeated transformer block on its "
        "own (faster to compile: one graph serves every block of a stack)"
    )
    mode: Literal["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"] = Field(
        "default", description="inductor mode: reduce-overhead adds CUDA graphs, max-autotune searches kernels"
    )
    dynamic: bool | None = Field(
        None, description="dynamic shapes: null: recompile once, then generalise the sizes that changed; true: "
        "dynamic from the start; false: one graph per shape"
    )
    fullgraph: bool = Field(False, description="treat any graph break as a compile error instead of splitting")
    backend: str = Field("inductor", description="torch.compile backend: inductor, aot_eager, eager, cudagraphs")
    fallback: bool = Field(True, description="on a compile error log the reason and run eager instead of stopping")

    @model_validator(mode="after")
    def _mode_needs_inductor(self) -> CompileSpec:
        if self.mode != "default" and self.backend != "inductor":
            raise ValueError(f"compile.mode '{self.mode}' is an inductor setting but compile.backend is "
                             f"'{self.backend}': set backend: inductor or mode: default")
        return self


class TraceSpec(Section):
    """torch.profiler trace of a few steps: Chrome trace and/or TensorBoard, optional memory and shapes."""

    enabled: bool = Field(False, description="profile optimizer steps start_step .. start_step + active_steps - 1")
    start_step: int = Field(10, ge=1, description="first profiled optimizer step (1-based)")
    warmup_steps: int = Field(1, ge=0, description="steps traced but discarded just before start_step")
    active_steps: int = Field(3, ge=1, description="steps recorded")
    dir: Path | None = Field(None, description="output folder (default: log.dir/profiler, else ./profiler)")
    format: Literal["chrome", "tensorboard", "both"] = Field(
        "both", description="chrome: trace.json for chrome://tracing / Perfetto; tensorboard: the profiler plugin"
    )
    profile_memory: bool = Field(False, description="record tensor allocations (memory view; slower)")
    record_shapes: bool = Field(False, description="record operator input shapes")
    with_stack: bool = Field(False, description="record Python stacks (much slower, larger traces)")

    @model_validator(mode="after")
    def _warmup_before_start(self) -> TraceSpec:
        if self.enabled and self.warmup_steps >= self.start_step:
            raise ValueError(f"trace.warmup_steps ({self.warmup_steps}) must be below trace.start_step "
                             f"({self.start_step}): warm-up steps run before the first profiled step")
        return self


class ProfileSpec(Section):
    """Where the time goes: sampled phase timer, FLOPs and MFU, torch.profiler trace, NVTX ranges, plots."""

    timing: bool = Field(True, description="time data wait / copy / forward / backward / optimizer / communication")
    every_steps: int = Field(10, ge=1, description="time one step in this many (one device sync per timed step)")
    warmup_steps: int = Field(1, ge=0, description="first steps never timed (lazy init, allocator warm-up)")
    mfu: bool = Field(True, description="FLOPs of the timed steps; report TFLOP/s and MFU")
    flops: Literal["auto", "measured", "analytic"] = Field(
        "auto", description="analytic: 6N per token + attention (a transformer whose config names layers/heads; "
        "costs nothing); measured: torch FlopCounterMode on a timed step's new batch shape (~6x that step, left out "
        "of the timings); auto: analytic where the model allows it, else measured"
    )
    peak_tflops: float | None = Field(
        None, gt=0, description="device peak TFLOP/s for MFU (default: table of common GPUs at the run's "
        "precision; none on CPU, where only TFLOP/s is reported)"
    )
    nvtx: bool = Field(False, description="NVTX ranges per phase for Nsight Systems (CUDA only)")
    plots: bool = Field(True, description="write step_time_breakdown.png to log.dir at the end of the run")
    trace: TraceSpec = Field(default_factory=TraceSpec)


AttentionBackendName = Literal["auto", "eager", "sdpa", "flex", "flash_attn"]


class AttentionSpec(Section):
    """Attention backend per tower (Hugging Face attn_implementation, or vlmfast.attention in other models)."""

    backend: AttentionBackendName | None = Field(
        None, description="null: leave the model's attention alone; auto: pick per device, dtype, head dim and mask "
        "(flash_attn -> sdpa -> eager, logged); or eager / sdpa / flex / flash_attn (an error if it cannot run)"
    )
    vision_backend: AttentionBackendName | None = Field(None, description="vision tower's backend (default: backend)")
    sdpa_kernels: list[Literal["flash", "efficient", "cudnn", "math"]] | None = Field(
        None, min_length=1, description="restrict SDPA to these kernels (torch.nn.attention.sdpa_kernel)"
    )

    @model_validator(mode="after")
    def _check_backends(self) -> AttentionSpec:
        if self.vision_backend is not None and self.backend is None:
            raise ValueError("attention.vision_backend is set but attention.backend is not: set attention.backend "
                             "too (e.g. sdpa)")
        if self.sdpa_kernels and "sdpa" not in (self.backend, self.vision_backend):
            raise ValueError("attention.sdpa_kernels restricts SDPA's kernels: set attention.backend (or "
                             "vision_backend) to sdpa")
        return self


class PackingSpec(Section):
    """Sequence packing: several samples per row up to a token budget; attention never crosses samples."""

    enabled: bool = Field(False, description="pack samples into rows (per-document position_ids, no cross attention)")
    max_tokens: int = Field(2048, ge=8, description="token budget per packed row, image tokens included")
    algorithm: Literal["best_fit_decreasing", "first_fit_decreasing"] = Field(
        "best_fit_decreasing", description="how samples are placed into rows (longest first)"
    )
    image_tokens: int | None = Field(
        None, ge=0, description="placeholder tokens per image for models that put image tokens before the text "
        "(default: the model's prepended_image_tokens, e.g. the built-in tiny VLM; else 0: they are in input_ids)"
    )
    image_layout: Literal["auto", "per_row", "flat"] = Field(
        "auto", description="auto: the layout the collated batch has (what the model takes; images of all samples "
        "stay in row order, per-sample slots become per-row slots); per_row: pixel_values [rows, K, ...] + "
        "images_per_row; flat: [images, ...] in row order (needs micro_batch_size = batch_size)"
    )
    pad_to_max_tokens: bool = Field(False, description="pad every row to max_tokens (static shapes for compile)")
    level: Literal["ids", "embeddings", "auto"] = Field(
        "ids", description="ids: the loader packs input_ids (each family's image layout must be known); "
        "embeddings: the loader pads and each micro-batch is packed on the device where the language model "
        "receives its inputs_embeds (any family whose language model takes them; the model's own image merge runs "
        "first), and the outputs are unpacked for the head and loss; auto: ids where measured exact, else "
        "embeddings. Each is checked against padding before training"
    )

    @model_validator(mode="after")
    def _ids_only_fields(self) -> PackingSpec:
        if self.level == "embeddings":
            set_here = [name for name, default in (("pad_to_max_tokens", False), ("image_layout", "auto"),
                                                   ("image_tokens", None)) if getattr(self, name) != default]
            if set_here:
                raise ValueError(f"packing.{set_here[0]} shapes the loader's packed rows, which packing.level "
                                 "embeddings has none of (each micro-batch is packed at the language model): leave "
                                 "it unset, or use packing.level: ids")
        return self

    @property
    def packs_ids(self) -> bool:
        """The loader packs input_ids (``enabled`` at ``level: ids``)."""
        return self.enabled and self.level == "ids"

    @property
    def packs_embeddings(self) -> bool:
        """Each micro-batch is packed at its language model's entry (``enabled`` at ``level: embeddings``)."""
        return self.enabled and self.level == "embeddings"


class TrainSpec(Section):
    """Everything a run needs besides the model and the data.

    Usage: ``TrainSpec(max_steps=200, batch_size=16, micro_batch_size=4, precision="bf16")``
    """

    seed: int = Field(0, ge=0, le=2**32 - 1, description="seeds torch, numpy and random, and the data order")
    max_steps: int = Field(100, ge=1, description="optimizer steps; a resumed run stops at the same step")
    batch_size: int = Field(8, ge=1, description="samples per optimizer step per rank")
    micro_batch_size: int | None = Field(
        None, ge=1, description="samples per forward/backward; the rest is gradient accumulation (default: "
        "batch_size). Any size: 8 at 3 runs 3 + 3 + 2, exact, since micro-batches are weighted by loss items"
    )
    micro_batch_tokens: int | None = Field(
        None, ge=1, description="cut each batch into micro-batches of at most this many tokens (padded length x rows, "
        "image tokens counted; packed rows count their width), longest samples first; micro_batch_size then caps "
        "the rows. Same gradient as the full batch; the OOM fallback halves it"
    )
    precision: Precision = Field("fp32", description="fp32, bf16 autocast, or fp16 autocast + GradScaler (CUDA)")
    tf32: bool = Field(False, description="allow TF32 matmuls and convolutions on CUDA")
    device: str = Field("auto", description="'auto' (CUDA when available), 'cpu', 'cuda' or 'cuda:N'")
    grad_clip: float | None = Field(None, gt=0, description="clip the global gradient norm to this value")
    engine: Literal["ddp", "fsdp", "deepspeed"] = Field(
        "ddp", description="who runs backward and the step: ddp (one process, or DistributedDataParallel when "
        "launched on several ranks), fsdp (FSDP2, settings in `fsdp`), deepspeed (ZeRO, settings in `deepspeed`)"
    )
    optimizer: OptimizerSpec = Field(default_factory=OptimizerSpec)
    scheduler: SchedulerSpec = Field(default_factory=SchedulerSpec)
    loss: LossSpec = Field(default_factory=LossSpec)
    linear_cross_entropy: LinearCrossEntropySpec = Field(default_factory=LinearCrossEntropySpec)
    activation_checkpointing: ActivationCheckpointingSpec = Field(default_factory=ActivationCheckpointingSpec)
    attention: AttentionSpec = Field(default_factory=AttentionSpec)
    oom: OOMSpec = Field(default_factory=OOMSpec)
    memory: MemorySpec = Field(default_factory=MemorySpec)
    ddp: DDPSpec = Field(default_factory=DDPSpec)
    deepspeed: DeepSpeedSpec = Field(default_factory=DeepSpeedSpec)
    fsdp: FSDPSpec = Field(default_factory=FSDPSpec)
    compile: CompileSpec = Field(default_factory=CompileSpec)
    ema: EMASpec = Field(default_factory=EMASpec)
    data: DataSpec = Field(default_factory=DataSpec)
    packing: PackingSpec = Field(default_factory=PackingSpec)
    vision_cache: VisionCacheSpec = Field(default_factory=VisionCacheSpec)
    lora: LoRASpec = Field(default_factory=LoRASpec)
    save: SaveSpec = Field(default_factory=SaveSpec)
    eval: EvalSpec = Field(default_factory=EvalSpec)
    log: LogSpec = Field(default_factory=LogSpec)
    profile: ProfileSpec = Field(default_factory=ProfileSpec)

    @field_validator("device")
    @classmethod
    def _device_name(cls, value: str) -> str:
        # Checked here so a typo fails validation, not torch.device() deep inside the run.
        if not DEVICE_NAME.fullmatch(value):
            raise ValueError(f"device '{value}' is not a device name: use auto, cpu, cuda, cuda:N, mps or xpu[:N]")
        return value

    @model_validator(mode="after")
    def _check_cross_fields(self) -> TrainSpec:
        mbs = self.micro_batch_size
        if mbs is not None and mbs > self.batch_size:
            raise ValueError(
                f"micro_batch_size ({mbs}) is larger than batch_size ({self.batch_size}): "
                f"set micro_batch_size <= {self.batch_size}"
            )
        # Any micro-batch size: 8 at 3 is 3 + 3 + 2, exact because micro-batches are weighted by their loss items.
        if self.precision == "fp16" and self.device.startswith("cpu"):
            raise ValueError("precision 'fp16' needs a CUDA device (GradScaler); on CPU use precision: bf16")
        if self.scheduler.warmup_steps >= self.max_steps and self.scheduler.warmup_steps > 0:
            # A short run (a smoke test, --set max_steps=10) must not stop on a warm-up sized for a long one.
            clamped = self.max_steps // 10
            log.warning("scheduler.warmup_steps %d is not below max_steps %d: warming up over %d step(s) instead "
                        "(a tenth of the run)", self.scheduler.warmup_steps, self.max_steps, clamped)
            self.scheduler.warmup_steps = clamped
        if self.save.every_steps is not None and self.save.dir is None:
            raise ValueError("save.every_steps is set but save.dir is not: set save.dir to a folder")
        if self.oom.enabled and self.oom.min_micro_batch_size > self.resolved_micro_batch_size:
            raise ValueError(
                f"oom.min_micro_batch_size ({self.oom.min_micro_batch_size}) is above micro_batch_size "
                f"({self.resolved_micro_batch_size}): lower oom.min_micro_batch_size"
            )
        if self.ddp.comm_wrapper != "none" and "powersgd" not in self.ddp.comm_hook:
            raise ValueError(f"ddp.comm_wrapper '{self.ddp.comm_wrapper}' wraps PowerSGD only: set ddp.comm_hook to "
                             "powersgd or batched_powersgd, or use ddp.comm_hook: fp16/bf16 for plain compression")
        splits = mbs not in (None, self.batch_size) or self.oom.enabled or self.micro_batch_tokens is not None
        if self.micro_batch_tokens is not None and self.packing.packs_ids and self.micro_batch_tokens < \
                self.packing.max_tokens:
            raise ValueError(f"micro_batch_tokens ({self.micro_batch_tokens}) is below packing.max_tokens "
                             f"({self.packing.max_tokens}): a packed row costs its width; raise micro_batch_tokens to "
                             f"a multiple of {self.packing.max_tokens}")
        if self.packing.packs_ids and self.packing.image_layout == "flat" and splits:
            raise ValueError(
                "packing.image_layout 'flat' puts the batch's images in one tensor that cannot be split into "
                "micro-batches: set micro_batch_size to batch_size and oom.enabled: false, or use "
                "packing.image_layout: per_row"
            )
        if self.log.tensorboard and self.log.dir is None:
            raise ValueError("log.tensorboard needs log.dir: set log.dir to a folder")
        if self.lora.quantize != "none" and self.save.export.merge:
            raise ValueError(f"save.export.merge with lora.quantize: {self.lora.quantize} would fold the adapters "
                             "into rounded 4-bit weights: export the adapter folder (save.export.merge: false) and "
                             "merge it onto the full-precision base")
        _check_backend(self)
        return self

    @property
    def resolved_micro_batch_size(self) -> int:
        """The micro-batch size, with the default (the whole batch) filled in."""
        return self.micro_batch_size or self.batch_size

    @classmethod
    def coerce(cls, spec: TrainSpec | dict[str, Any] | str | Path) -> TrainSpec:
        """A spec from a TrainSpec, a dict, or a .yaml/.yml/.json path."""
        if isinstance(spec, TrainSpec):
            return spec
        return cls.from_file(spec) if isinstance(spec, (str, Path)) else cls.model_validate(spec)

    @classmethod
    def from_file(cls, path: str | Path) -> TrainSpec:
        """Load a spec from .yaml/.yml/.json; every error names the file (and the field, or the key and line)."""
        path = Path(path)
        data = load_spec_file(path)
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise SpecError(f"{path}: invalid spec\n{format_validation_error(exc)}") from exc
        except (ValueError, TypeError) as exc:
            raise SpecError(f"{path}: invalid spec: {exc}") from exc

    def to_dict(self) -> dict[str, Any]:
        """A plain, YAML/JSON-serialisable dict that :meth:`model_validate` reads back unchanged."""
        return self.model_dump(mode="json", by_alias=True)  # save.async: its YAML name, not the Python one

    def to_file(self, path: str | Path) -> None:
        """Write the spec as YAML or JSON, chosen by the suffix."""
        path = Path(path)
        data = self.to_dict()
        text = json.dumps(data, indent=2) if path.suffix == ".json" else yaml.safe_dump(data, sort_keys=False)
        path.write_text(text)


def load_spec_file(path: str | Path) -> dict[str, Any]:
    """The mapping in a .yaml/.yml/.json spec file; a duplicate key, bad bytes or bad syntax is a SpecError naming
    the file (and the key and lines)."""
    path = Path(path)
    if not path.is_file():
        raise SpecError(f"spec file not found: {path}" if not path.exists() else f"{path}: not a file")
    if path.suffix not in (".yaml", ".yml", ".json"):
        raise SpecError(f"{path}: unsupported spec format '{path.suffix}'; use .yaml, .yml or .json")
    try:
        text = path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SpecError(f"{path}: not UTF-8 text (byte {exc.object[exc.start]:#04x} at offset {exc.start}): save it "
                        "as UTF-8") from exc
    except OSError as exc:
        raise SpecError(f"{path}: cannot read it ({exc.strerror or exc})") from exc
    data = parse_spec_text(text, str(path), json_syntax=path.suffix == ".json") or {}
    if not isinstance(data, dict):
        raise SpecError(f"{path}: the spec must be a mapping of field names to values")
    return data


def parse_spec_text(text: str, where: str, json_syntax: bool = False) -> Any:
    """YAML (or JSON) text of a spec or a ``--set`` value, parsed safely (no Python objects, no repeated keys);
    every failure is a SpecError starting with `where` (the file, or the --set item).

    Usage: ``parse_spec_text("{lr: 0.1}", "--set optimizer={lr: 0.1}")``
    """
    try:
        if json_syntax:
            return json.loads(text, object_pairs_hook=_unique_json_keys)
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no Python objects
    except _DuplicateKeyError as exc:
        raise SpecError(f"{where}: {exc}") from exc
    except (yaml.YAMLError, json.JSONDecodeError) as exc:
        raise SpecError(f"{where}: cannot parse: {exc}") from exc
    except RecursionError as exc:  # the parsers recurse once per level of nesting
        raise SpecError(f"{where}: nested too deeply to read (more levels than Python's recursion limit, "
                        f"{sys.getrecursionlimit()}); a spec is a few levels deep: check what wrote it") from exc


class _DuplicateKeyError(ValueError):
    pass


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, refusing a key repeated in one mapping (PyYAML keeps the last one silently, so a second
    `optimizer:` section would drop the first one's settings). Merge keys (`<<: *base`) still override."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                first = seen.get(key)
                seen.setdefault(key, line)
            except TypeError:  # an unhashable key: the base constructor reports it
                continue
            if first is not None:  # also on the same line: a flow mapping {lr: 0.1, lr: 0.0001}
                lines = f"line {line}" if first == line else f"lines {first} and {line}"
                raise _DuplicateKeyError(f"key '{key}' appears twice in one mapping ({lines}); YAML would keep only "
                                         "the last one and silently drop the other: merge them")
        return super().construct_mapping(node, deep=deep)


def _unique_json_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _DuplicateKeyError(f"key '{key}' appears twice in one object; JSON readers keep only the last one "
                                     "and silently drop the other: merge them")
        seen[key] = value
    return seen


def format_validation_error(exc: ValidationError) -> str:
    """One line per problem: the dotted field path, then what to change."""
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "spec"
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"  {where}: {msg}")
    return "\n".join(lines)


def check_environment(spec: TrainSpec) -> None:
    """Fail before any work when the machine cannot run the spec (fp16, lora.quantize or a CUDA device without CUDA,
    lora.quantize without bitsandbytes, a save.dir, save.export.dir, log.dir or tracker store that cannot be written,
    a tracker's package missing)."""
    import torch

    from vlmfast.checkpoints.save_dir import check_output_dirs
    from vlmfast.common.utils import resolve_device
    from vlmfast.reporting.tracking import check_trackers
    from vlmfast.strategies.lora import quantize_refusal

    check_output_dirs(spec)
    device = resolve_device(spec.device)
    if spec.device.startswith("cuda") and not torch.cuda.is_available():
        raise SpecError(f"device '{spec.device}': CUDA is not available on this machine; use device: auto or cpu")
    if spec.precision == "fp16" and device.type != "cuda":
        raise SpecError("precision 'fp16' needs a CUDA device (autocast + GradScaler); on CPU use precision: bf16")
    if refusal := quantize_refusal(spec.lora, device):
        raise SpecError(refusal)
    check_trackers(spec.log)  # TensorBoard, W&B, MLflow: package present, local store writable


def defaults_yaml(values: dict[str, Any] | None = None) -> str:
    """A commented YAML template of every field with its default (``vlmfast spec --defaults``), or with the values
    of a spec given as a dict (``vlmfast spec --demo``: the built-in demo's)."""
    return "\n".join(_commented_fields(TrainSpec, TrainSpec.model_validate(values or {}).to_dict(), indent=0)) + "\n"


def _commented_fields(model: type[BaseModel], values: dict[str, Any], indent: int) -> list[str]:
    pad = " " * indent
    lines: list[str] = []
    for name, field in model.model_fields.items():
        name = field.alias or name  # save.async (async is a Python keyword: the attribute is async_)
        value = values[name]
        sub = _section_type(field.annotation)
        if field.description:
            lines.append(f"{pad}# {field.description}")
        if sub is not None:
            lines.append(f"{pad}{name}:")
            lines.extend(_commented_fields(sub, value, indent + 2))
        else:
            dumped = yaml.safe_dump({name: value}, default_flow_style=True, width=1000).strip()
            lines.append(f"{pad}{dumped.strip('{}')}")
    return lines


def _section_type(annotation: Any) -> type[BaseModel] | None:
    return annotation if isinstance(annotation, type) and issubclass(annotation, BaseModel) else None


set_root(TrainSpec)
