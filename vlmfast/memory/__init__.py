"""Memory readings (and, as the memory issue lands, estimation, monitoring and leak detection)."""

from vlmfast.memory.stats import memory_stats, peak_memory_gb, reset_peak_memory

__all__ = ["memory_stats", "peak_memory_gb", "reset_peak_memory"]
