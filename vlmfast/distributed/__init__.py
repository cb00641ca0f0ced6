"""Distributed training: process group from the launcher, DDP wrapping, gradient-communication hooks."""

from vlmfast.distributed.comm_hooks import CommCounter, count_bytes, register_comm_hook, register_comm_hook_from_spec
from vlmfast.distributed.ddp import explain_ddp_error, wrap_ddp
from vlmfast.distributed.process_group import (
    NCCL_PRESETS,
    DistributedEnv,
    apply_nccl_presets,
    distributed_env,
    init_distributed,
)

__all__ = [
    "NCCL_PRESETS",
    "CommCounter",
    "DistributedEnv",
    "apply_nccl_presets",
    "count_bytes",
    "distributed_env",
    "explain_ddp_error",
    "init_distributed",
    "register_comm_hook",
    "register_comm_hook_from_spec",
    "wrap_ddp",
]
