"""The process group, from whatever launcher started us (torchrun, accelerate launch, the deepspeed launcher).

All three set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; vlmfast reads those, picks NCCL on CUDA
and gloo on CPU, binds each process to its local GPU, and sets a collective timeout so a rank that dies makes the
others fail with an error instead of hanging forever.

Usage::

    env = init_distributed(timeout_minutes=10)      # a no-op for a single process
    env.rank, env.world_size, env.is_main
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from datetime import timedelta

import torch


@dataclass(frozen=True)
class DistributedEnv:
    """Where this process sits in the job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    launcher: str = "none"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def distributed_env() -> DistributedEnv:
    """Read the launcher's environment (or the initialised process group)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        return DistributedEnv(rank, world, int(os.environ.get("LOCAL_RANK", rank)), _launcher())
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    return DistributedEnv(rank, world, int(os.environ.get("LOCAL_RANK", "0")), _launcher())


def _launcher() -> str:
    if "TORCHELASTIC_RUN_ID" in os.environ:
        return "torchrun"
    if any(key.startswith("ACCELERATE_") for key in os.environ):
        return "accelerate"
    if "DEEPSPEED_ENVIRONMENT_NAME" in os.environ or "CROSS_RANK" in os.environ:
        return "deepspeed"
    return "env" if "WORLD_SIZE" in os.environ else "none"


# From the reference guide's NCCL tuning, one preset per purpose (docs/distributed.md says when each helps).
NCCL_PRESETS: dict[str, dict[str, str]] = {
    "async_errors": {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"},  # a failed collective raises instead of hanging
    "infiniband": {"NCCL_IB_DISABLE": "0", "NCCL_NET_GDR_LEVEL": "5"},  # multi-node: InfiniBand + GPUDirect RDMA
    "nvlink": {"NCCL_P2P_LEVEL": "NVL"},  # peer-to-peer only over NVLink
    "small_buffers": {"NCCL_BUFFSIZE": "2097152"},  # 2 MiB per channel (NCCL's default is 4 MiB): less memory
}


def apply_nccl_presets(names: list[str]) -> dict[str, str]:
    """Set the presets' NCCL variables that are not already set; returns what was set."""
    applied = {}
    for name in names:
        for key, value in NCCL_PRESETS[name].items():
            if key not in os.environ:
                os.environ[key] = applied[key] = value
    return applied


def init_distributed(timeout_minutes: float = 10.0, backend: str | None = None) -> DistributedEnv:
    """Initialise the default process group when the environment says we are one of several processes."""
    env = distributed_env()
    if env.world_size <= 1 or torch.distributed.is_initialized():
        _quiet_other_ranks(env)
        return env
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)  # before init: NCCL binds to the current device
    backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    torch.distributed.init_process_group(backend, timeout=timedelta(minutes=timeout_minutes))
    env = distributed_env()
    _quiet_other_ranks(env)
    return env


class _MainRankOnly(logging.Filter):
    """Lets through every record on rank 0, and only errors elsewhere: one copy of each message."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        self.rank = rank

    def filter(self, record: logging.LogRecord) -> bool:
        return self.rank == 0 or record.levelno >= logging.ERROR


def _quiet_other_ranks(env: DistributedEnv) -> None:
    logger = logging.getLogger("vlmfast")
    for old in [f for f in logger.filters if isinstance(f, _MainRankOnly)]:
        logger.removeFilter(old)
    if env.world_size > 1:
        logger.addFilter(_MainRankOnly(env.rank))
