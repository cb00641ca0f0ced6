"""Distributed training: process group from the launcher, DDP wrapping, gradient-communication hooks."""

from vlmfast.distributed.ddp import explain_ddp_error, wrap_ddp
from vlmfast.distributed.process_group import DistributedEnv, distributed_env, init_distributed

__all__ = ["DistributedEnv", "distributed_env", "explain_ddp_error", "init_distributed", "wrap_ddp"]
