"""The process group, from whatever launcher started us (torchrun, accelerate launch, the deepspeed launcher).

All three set RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT; vlmfast reads those, picks NCCL on CUDA
and gloo on CPU, binds each process to its local GPU, and sets a collective timeout so a rank that dies makes the
others fail with an error instead of hanging forever.

A peer that dies is noticed at once (its connection closes); one that hangs alive is noticed when a collective has
waited `timeout_minutes`. :func:`explain_rank_failure` turns the backend's low-level error into a
:class:`RankFailureError` that says which of the two happened and what to do.

Usage::

    env = init_distributed(timeout_minutes=10)      # a no-op for a single process
    env.rank, env.world_size, env.is_main
    with explain_rank_failure(env.world_size, timeout_minutes=10):
        train()
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from contextlib import contextmanager
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
        if env.world_size <= 1:  # a launcher asked for several processes but started one: say so (issue 20)
            from vlmfast.engines.foreign_loops import warn_if_launched_alone

            warn_if_launched_alone()
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


class RankFailureError(RuntimeError):
    """A collective failed because another rank died or stopped answering; the message says what to do."""


# What gloo / NCCL / the TCP store say when a peer's process is gone, and when it did not answer in time.
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe", "Connection refused",
             "remote process exited", "NCCL communicator was aborted", "Socket closed")
PEER_SILENT = ("Timed out waiting", "Socket Timeout", "Watchdog caught collective operation timeout",
               "timed out after", "Timeout waiting for key")


def explain_collective_error(exc: BaseException, timeout_minutes: float) -> RankFailureError | None:
    """A :class:`RankFailureError` for a collective's error caused by another rank, else None."""
    text = str(exc)
    first = text.strip().splitlines()[0] if text.strip() else type(exc).__name__
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else distributed_env().rank
    setting = f"ddp.timeout_minutes ({timeout_minutes:g} min)"
    if any(p in text for p in PEER_GONE) or isinstance(exc, getattr(torch.distributed, "DistNetworkError", ())):
        return RankFailureError(
            f"rank {rank}: another rank died during a collective operation (its connection closed): see that rank's "
            "log for why (an exception, the out-of-memory killer, a lost node). This rank stops instead of hanging; "
            f"resume from the last checkpoint. A rank that hangs without dying is detected after {setting}; set "
            f"ddp.timeout_minutes in the spec to change that. Backend said: {first}"
        )
    if any(p in text for p in PEER_SILENT):
        return RankFailureError(
            f"rank {rank}: no answer from another rank within {setting} during a collective operation: a rank "
            "hangs or died (see the other ranks' logs). This rank stops instead of hanging; resume from the last "
            "checkpoint. If some step legitimately takes longer (a slow checkpoint write or evaluation on one rank), "
            f"raise ddp.timeout_minutes in the spec. Backend said: {first}"
        )
    return None


@contextmanager
def explain_rank_failure(world_size: int, timeout_minutes: float) -> Iterator[None]:
    """Re-raise a collective's error caused by another rank as :class:`RankFailureError` (no-op for one process)."""
    try:
        yield
    except RuntimeError as exc:
        explained = explain_collective_error(exc, timeout_minutes) if world_size > 1 else None
        if explained is None or isinstance(exc, RankFailureError):
            raise
        raise explained from exc


def ensure_process_group() -> None:
    """A private one-rank group when none exists: DeepSpeed and FSDP2 need a group even on one process (no ports)."""
    if torch.distributed.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    torch.distributed.init_process_group(backend, store=torch.distributed.HashStore(), rank=0, world_size=1)
