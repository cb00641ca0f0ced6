"""Memory: readings, the OOM advice, the batch-size finder, leak detection and the monitor.

Usage: ``from vlmfast.memory import memory_stats, MemoryMonitor``
"""

from vlmfast.memory.advice import memory_summary, oom_advice
from vlmfast.memory.batch_size import BatchSizeSearch, find_max_micro_batch_size
from vlmfast.memory.estimator import MemoryEstimate, estimate_memory
from vlmfast.memory.leaks import LeakDetector, LeakWarning, live_tensor_census, tensor_growth
from vlmfast.memory.monitor import MemoryLeakWarning, MemoryMonitor
from vlmfast.memory.plots import plot_memory_timeline
from vlmfast.memory.stats import memory_stats, peak_memory_gb, reset_peak_memory

__all__ = [
    "BatchSizeSearch",
    "LeakDetector",
    "LeakWarning",
    "MemoryEstimate",
    "MemoryLeakWarning",
    "MemoryMonitor",
    "estimate_memory",
    "find_max_micro_batch_size",
    "live_tensor_census",
    "memory_stats",
    "memory_summary",
    "oom_advice",
    "peak_memory_gb",
    "plot_memory_timeline",
    "reset_peak_memory",
    "tensor_growth",
]
