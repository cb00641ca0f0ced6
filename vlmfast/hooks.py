"""Every strategy as a standalone function or small object, for hand-written, Accelerate or Fabric loops.

Usage::

    from vlmfast.hooks import accumulate_gradients, MixedPrecision, build_optimizer

    precision = MixedPrecision("bf16", device)
    loss = accumulate_gradients(model, batch, micro_batch_size=4, device=device,
                                forward_context=precision.forward_context, backward=precision.backward)
    precision.optimizer_step(optimizer); optimizer.zero_grad(set_to_none=True)
"""

from vlmfast.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from vlmfast.data.batch import move_to_device, split_batch
from vlmfast.distributed import init_distributed, register_comm_hook, wrap_ddp
from vlmfast.interrupt import InterruptGuard
from vlmfast.memory.advice import memory_summary, oom_advice
from vlmfast.memory.batch_size import find_max_micro_batch_size
from vlmfast.memory.stats import memory_stats, peak_memory_gb
from vlmfast.strategies.accumulation import (
    accumulate_gradients,
    all_reduce_gradients,
    count_loss_tokens,
    extract_loss,
    model_accepts_num_items,
    model_shifts_labels,
    sync_context,
)
from vlmfast.strategies.checkpointing import (
    apply_activation_checkpointing,
    checkpoint_call,
    detach_frozen_modules,
    saved_tensor_bytes,
)
from vlmfast.strategies.oom import OOMFallback, free_memory, is_oom_error, set_expandable_segments
from vlmfast.strategies.optimizer import (
    build_optimizer,
    build_param_groups,
    build_scheduler,
    clip_gradients,
    freeze_modules,
    lr_multiplier,
)
from vlmfast.strategies.precision import MixedPrecision, autocast_context, enable_tf32

__all__ = [
    "InterruptGuard",
    "MixedPrecision",
    "OOMFallback",
    "accumulate_gradients",
    "all_reduce_gradients",
    "apply_activation_checkpointing",
    "autocast_context",
    "build_optimizer",
    "build_param_groups",
    "build_scheduler",
    "checkpoint_call",
    "clip_gradients",
    "count_loss_tokens",
    "detach_frozen_modules",
    "enable_tf32",
    "extract_loss",
    "find_max_micro_batch_size",
    "free_memory",
    "freeze_modules",
    "init_distributed",
    "is_oom_error",
    "latest_checkpoint",
    "load_checkpoint",
    "lr_multiplier",
    "memory_stats",
    "memory_summary",
    "model_accepts_num_items",
    "model_shifts_labels",
    "move_to_device",
    "oom_advice",
    "peak_memory_gb",
    "register_comm_hook",
    "save_checkpoint",
    "saved_tensor_bytes",
    "set_expandable_segments",
    "split_batch",
    "sync_context",
    "wrap_ddp",
]
