"""The workload of any bench size, whichever data it has: the built-in tiny VLM on generated shapes, or a Hugging
Face model collated as its processor would (gpu-1b). A module of its own so that neither builder imports the other.

Usage::

    workload = build_workload("cpu", steps=40, warmup=5)
    workload = build_workload("gpu-1b", toy=True)          # the same classes at CI scale, for a dry run on a CPU
"""

from __future__ import annotations

from vlmfast.bench.workload import SIZES, Workload, build_shapes_workload


def build_workload(size: str = "cpu", steps: int | None = None, warmup: int | None = None, seed: int = 0,
                   batch_size: int | None = None, toy: bool = False) -> Workload:
    """The shared model init, data order and held-out batches for a size in :data:`SIZES` (steps and warm-up steps:
    the size's defaults unless given; ``toy``: the same classes at a tiny scale, for a dry run on a CPU: gpu-1b)."""
    if size not in SIZES:
        raise ValueError(f"unknown benchmark size '{size}': choose from {sorted(SIZES)}")
    if SIZES[size].data == "processor":
        from vlmfast.bench.hf_vlm import build_hf_workload

        return build_hf_workload(size, steps=steps, warmup=warmup, seed=seed, batch_size=batch_size, toy=toy)
    if toy:
        raise ValueError(f"benchmark size '{size}' has no toy scale (gpu-1b has): it is small already")
    return build_shapes_workload(size, steps=steps, warmup=warmup, seed=seed, batch_size=batch_size)
