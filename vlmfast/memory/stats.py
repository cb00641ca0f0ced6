"""Device memory readings: the CUDA caching allocator on GPU, the process RSS on CPU.

Usage: ``memory_stats(device)`` -> ``{"mem/allocated_gb": ..., "mem/peak_gb": ...}``

Metric names are stable (they end up in metrics.jsonl, TensorBoard and the memory timeline):

- CUDA: ``mem/allocated_gb``, ``mem/reserved_gb``, ``mem/peak_gb`` (peak allocated), ``mem/fragmentation``
  (1 - allocated/reserved: the share of the cache no tensor uses), ``mem/alloc_retries`` (cudaMalloc failed and
  the allocator freed its cache to retry; a steady rise means the run is close to OOM), ``mem/num_ooms``.
- CPU: ``mem/rss_gb`` (process resident set) and ``mem/peak_gb`` (peak RSS).
"""

from __future__ import annotations

import resource

import psutil
import torch

GB = 1024**3
_PROCESS = psutil.Process()  # one handle: constructing it on every step costs more than the reading


def memory_stats(device: torch.device) -> dict[str, float]:
    """Current and peak memory in GiB (plus allocator health on CUDA) under stable metric names; no device sync."""
    if device.type == "cuda":
        return cuda_memory_stats(device)
    return {"mem/rss_gb": _PROCESS.memory_info().rss / GB, "mem/peak_gb": peak_memory_gb(device)}


def cuda_memory_stats(device: torch.device) -> dict[str, float]:
    """The CUDA metrics of :func:`memory_stats` from one allocator query (host-side counters, no sync)."""
    # One torch.cuda.memory_stats call: memory_allocated/reserved/max_memory_allocated each rebuild this same dict.
    stats = torch.cuda.memory_stats(device)  # empty before CUDA is initialised: every value reads as 0
    allocated = stats.get("allocated_bytes.all.current", 0)
    reserved = stats.get("reserved_bytes.all.current", 0)
    return {
        "mem/allocated_gb": allocated / GB,
        "mem/reserved_gb": reserved / GB,
        "mem/peak_gb": stats.get("allocated_bytes.all.peak", 0) / GB,
        "mem/fragmentation": 1.0 - allocated / reserved if reserved else 0.0,
        "mem/alloc_retries": stats.get("num_alloc_retries", 0),
        "mem/num_ooms": stats.get("num_ooms", 0),
    }


def peak_memory_gb(device: torch.device) -> float:
    """Peak allocated CUDA memory, or the process's peak RSS on CPU (Linux reports KiB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GB


def reset_peak_memory(device: torch.device) -> None:
    """Start a new peak window (CUDA only: the OS keeps the process's lifetime peak RSS)."""
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
