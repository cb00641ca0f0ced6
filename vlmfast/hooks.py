"""Every strategy as a standalone function or small object, for hand-written, Accelerate or Fabric loops.

Usage::

    from vlmfast.hooks import accumulate_gradients, MixedPrecision, build_optimizer

    precision = MixedPrecision("bf16", device)
    loss = accumulate_gradients(model, batch, micro_batch_size=4, device=device,
                                forward_context=precision.forward_context, backward=precision.backward)
    precision.optimizer_step(optimizer); optimizer.zero_grad(set_to_none=True)
"""

from vlmfast.attention import (
    record_attention_calls,
    set_attention_backend,
    trace_attention_kernels,
    use_attention_backend,
)
from vlmfast.checkpoints.store import latest_checkpoint, load_checkpoint, save_checkpoint
from vlmfast.data.autotune import autotune_num_workers
from vlmfast.data.batch import move_to_device, split_batch
from vlmfast.data.batch_layout import BatchLayout, BatchSplitError, split_collated
from vlmfast.data.images import BatchImagePreprocessor, preprocess_images
from vlmfast.data.micro_batches import SampleBatch, split_micro_batches
from vlmfast.data.mmap import MemmapTensorDataset, MemmapTokenDataset, write_tensors, write_token_sequences
from vlmfast.data.packing import (
    ModelPositions,
    PackingCollator,
    PackingError,
    build_packing_collator,
    count_packed_tokens,
    pack_documents,
    packed_batch_counts,
    plan_rows,
)
from vlmfast.data.packing_check import check_packing
from vlmfast.data.prefetch import DevicePrefetcher
from vlmfast.data.samplers import LengthGroupedSampler, dataset_lengths, padding_waste
from vlmfast.data.shards import ShardDataset, write_shards
from vlmfast.engines import init_distributed, register_comm_hook, wrap_ddp
from vlmfast.engines.collectives import all_reduce_gradients
from vlmfast.engines.deepspeed import build_deepspeed_config
from vlmfast.engines.foreign_loops import find_ddp, launch_warning
from vlmfast.engines.fsdp import full_state_dict, load_full_state_dict, shard_model
from vlmfast.features import FeatureStore, KeyedCollate, check_deterministic
from vlmfast.features.cache import FeatureCache
from vlmfast.memory.advice import memory_summary, oom_advice
from vlmfast.memory.batch_size import find_max_micro_batch_size
from vlmfast.memory.stats import memory_stats, peak_memory_gb
from vlmfast.models.conventions import LabelConventions, probe_label_conventions
from vlmfast.profiling import (
    FlopsMeter,
    PhaseTimer,
    RunProfiler,
    StepProfiler,
    diagnose,
    measure_flops,
    peak_tflops,
    timed_comm_hook,
)
from vlmfast.strategies.accumulation import (
    accumulate_gradients,
    count_loss_tokens,
    extract_loss,
    model_accepts_num_items,
    model_shifts_labels,
    sync_context,
)
from vlmfast.strategies.activation_checkpointing import (
    apply_activation_checkpointing,
    apply_checkpoint_plan,
    checkpoint_call,
    detach_frozen_modules,
    plan_activation_checkpointing,
    saved_tensor_bytes,
)
from vlmfast.strategies.clipping import clip_gradients
from vlmfast.strategies.compile import CompileResult, compile_model
from vlmfast.strategies.ema import ExponentialMovingAverage, update_ema
from vlmfast.strategies.linear_cross_entropy import (
    apply_linear_cross_entropy,
    linear_cross_entropy,
    shift_targets,
)
from vlmfast.strategies.oom import OOMFallback, free_memory, is_oom_error, set_expandable_segments
from vlmfast.strategies.optimizer import (
    build_optimizer,
    build_param_groups,
    build_scheduler,
    freeze_modules,
    lr_multiplier,
)
from vlmfast.strategies.precision import MixedPrecision, autocast_context, enable_tf32
from vlmfast.strategies.token_budget import TokenBudget, plan_token_micro_batches, split_by_tokens
from vlmfast.strategies.vision_cache import cache_vision_features
from vlmfast.train.evaluation import evaluate_loss
from vlmfast.train.interrupt import InterruptGuard

__all__ = [
    "BatchImagePreprocessor",
    "BatchLayout",
    "BatchSplitError",
    "CompileResult",
    "DevicePrefetcher",
    "ExponentialMovingAverage",
    "FeatureCache",
    "FeatureStore",
    "FlopsMeter",
    "InterruptGuard",
    "KeyedCollate",
    "LabelConventions",
    "LengthGroupedSampler",
    "MemmapTensorDataset",
    "MemmapTokenDataset",
    "MixedPrecision",
    "ModelPositions",
    "OOMFallback",
    "PackingCollator",
    "PackingError",
    "PhaseTimer",
    "RunProfiler",
    "SampleBatch",
    "ShardDataset",
    "StepProfiler",
    "TokenBudget",
    "accumulate_gradients",
    "all_reduce_gradients",
    "apply_activation_checkpointing",
    "apply_checkpoint_plan",
    "apply_linear_cross_entropy",
    "autocast_context",
    "autotune_num_workers",
    "build_deepspeed_config",
    "build_optimizer",
    "build_packing_collator",
    "build_param_groups",
    "build_scheduler",
    "cache_vision_features",
    "check_deterministic",
    "check_packing",
    "checkpoint_call",
    "clip_gradients",
    "compile_model",
    "count_loss_tokens",
    "count_packed_tokens",
    "dataset_lengths",
    "detach_frozen_modules",
    "diagnose",
    "enable_tf32",
    "evaluate_loss",
    "extract_loss",
    "find_ddp",
    "find_max_micro_batch_size",
    "free_memory",
    "freeze_modules",
    "full_state_dict",
    "init_distributed",
    "is_oom_error",
    "latest_checkpoint",
    "launch_warning",
    "linear_cross_entropy",
    "load_checkpoint",
    "load_full_state_dict",
    "lr_multiplier",
    "measure_flops",
    "memory_stats",
    "memory_summary",
    "model_accepts_num_items",
    "model_shifts_labels",
    "move_to_device",
    "oom_advice",
    "pack_documents",
    "packed_batch_counts",
    "padding_waste",
    "peak_memory_gb",
    "peak_tflops",
    "plan_activation_checkpointing",
    "plan_rows",
    "plan_token_micro_batches",
    "preprocess_images",
    "probe_label_conventions",
    "record_attention_calls",
    "register_comm_hook",
    "save_checkpoint",
    "saved_tensor_bytes",
    "set_attention_backend",
    "set_expandable_segments",
    "shard_model",
    "shift_targets",
    "split_batch",
    "split_by_tokens",
    "split_collated",
    "split_micro_batches",
    "sync_context",
    "timed_comm_hook",
    "trace_attention_kernels",
    "update_ema",
    "use_attention_backend",
    "wrap_ddp",
    "write_shards",
    "write_tensors",
    "write_token_sequences",
]
