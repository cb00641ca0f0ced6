"""Device memory readings: the CUDA caching allocator on GPU, the process RSS on CPU.

Usage: ``memory_stats(device)`` -> ``{"mem/allocated_gb": ..., "mem/peak_gb": ...}``
"""

from __future__ import annotations

import resource

import psutil
import torch

GB = 1024**3
_PROCESS = psutil.Process()  # one handle: constructing it on every step costs more than the reading


def memory_stats(device: torch.device) -> dict[str, float]:
    """Current and peak memory in GiB under stable metric names."""
    if device.type == "cuda":
        return {
            "mem/allocated_gb": torch.cuda.memory_allocated(device) / GB,
            "mem/reserved_gb": torch.cuda.memory_reserved(device) / GB,
            "mem/peak_gb": torch.cuda.max_memory_allocated(device) / GB,
        }
    return {"mem/rss_gb": _PROCESS.memory_info().rss / GB, "mem/peak_gb": peak_memory_gb(device)}


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated CUDA memory, or the process's peak RSS on CPU (Linux reports KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak window (CUDA only: the OS keeps the process's lifetime peak RSS)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
