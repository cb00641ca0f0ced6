"""See which attention kernel really ran: torch's profiler records the op of every SDPA kernel by name.

:func:`record_attention_calls` (in ``dispatch``) tells which backend vlmfast chose; this module tells which kernel
torch then ran, for any model (Hugging Face ones included), by profiling a forward/backward pass.

Usage::

    with trace_attention_kernels() as trace:
        model(**batch).loss.backward()
    trace.kernels          # Counter({'sdpa-flash': 4}) on CPU, {'sdpa-efficient': 4} under sdpa_kernels=[efficient]
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from vlmfast.common.utils import quiet_profiler_log

__all__ = ["KernelTrace", "trace_attention_kernels"]

# Profiler op name fragment -> kernel name; forward ops only (backward ops are skipped by name).
_KERNEL_OPS = {
    "_scaled_dot_product_flash_attention": "sdpa-flash",  # CUDA, and `..._for_cpu` on CPU
    "_scaled_dot_product_efficient_attention": "sdpa-efficient",
    "_scaled_dot_product_cudnn_attention": "sdpa-cudnn",
    "_scaled_dot_product_attention_math": "sdpa-math",
    "_varlen_attn": "torch-varlen",
    "flashattn::": "flash_attn",  # flash_attn_interface.py registers its custom ops as flashattn::_flash_attn_*
    "flash_attn::": "flash_attn",
    "flex_attention": "flex",
}


@dataclass
class KernelTrace:
    """Forward attention kernel calls seen while tracing, by kernel name."""

    kernels: Counter[str] = field(default_factory=Counter)


def _kernel_of(op_name: str) -> str | None:
    if "backward" in op_name.lower():
        return None
    return next((kernel for fragment, kernel in _KERNEL_OPS.items() if fragment in op_name), None)


@contextmanager
def trace_attention_kernels() -> Iterator[KernelTrace]:
    """Profile the block (CPU op events, plus CUDA when present) and count the attention kernels that ran."""
    trace = KernelTrace()
    activities = [torch.profiler.ProfilerActivity.CPU]
    quiet_profiler_log()
    with torch.profiler.profile(activities=activities) as profiler:
        yield trace
    for event in profiler.events():
        kernel = _kernel_of(event.name)
        if kernel is not None:
            trace.kernels[kernel] += 1
