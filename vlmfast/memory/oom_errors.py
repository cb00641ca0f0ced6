"""Recognising an out-of-memory error and cleaning up after one: shared by the OOM fallback, the token-budget sizer
and the batch-size finder.

Usage::

    try:
        step()
    except Exception as exc:
        if not is_oom_error(exc):
            raise
        oom = True
    if oom:
        free_memory()          # after the except block: its traceback pins the failed step's tensors
"""

from __future__ import annotations

import gc

import torch

__all__ = ["FAILED", "OK", "OOM", "OOM_MESSAGES", "OutOfMemoryAtMinimumError", "free_memory", "is_oom_error"]

# Messages of allocation failures that do not always arrive as torch.OutOfMemoryError.
OOM_MESSAGES = (
    "CUDA out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "HIP out of memory",
    "MPS backend out of memory",
    "XPU out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
)



OK, OOM, FAILED = 0, 1, 2  # what a rank reports after an attempt; the worst one wins


def is_oom_error(exc: BaseException) -> bool:
    """True for torch.OutOfMemoryError, and for RuntimeErrors whose message is a known allocation failure."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in OOM_MESSAGES)


def free_memory() -> None:
    """Release what an aborted step left: Python cycles first, then the CUDA cache."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


class OutOfMemoryAtMinimumError(RuntimeError):
    """Out of memory even at `oom.min_micro_batch_size`: the message carries the memory summary and advice."""
