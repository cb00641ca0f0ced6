"""What to say when memory runs out: a short summary and the spec changes that usually help, cheapest first.

Usage: ``print(memory_summary(device)); print("\\n".join(oom_advice(spec)))``
"""

from __future__ import annotations

import torch

from vlmfast.memory.stats import memory_stats
from vlmfast.spec import TrainSpec


def memory_summary(device: torch.device) -> str:
    """The allocator's abbreviated summary on CUDA; current/peak RSS on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_summary(device, abbreviated=True)
    stats = memory_stats(device)
    return ", ".join(f"{key.removeprefix('mem/')} {value:.2f}" for key, value in stats.items())


def oom_advice(spec: TrainSpec) -> list[str]:
    """Spec changes that cut memory, in the reference guide's priority order, skipping those already on."""
    advice = []
    if not spec.activation_checkpointing.enabled:
        advice.append("activation_checkpointing.enabled: true  (recompute block activations: ~30% more compute, "
                      "activations drop by half or more)")
    if spec.precision == "fp32":
        advice.append("precision: bf16  (activations and matmuls in half precision)")
    if not any("vision" in pattern for pattern in spec.optimizer.freeze):
        advice.append("optimizer.freeze: [vision_tower]  (no gradients or optimizer states for the vision encoder)")
    if not spec.activation_checkpointing.offload_to_cpu:
        advice.append("activation_checkpointing.offload_to_cpu: true  (saved activations in host memory)")
    advice.append("a shorter sequence / fewer or smaller images per sample, or more GPUs with ZeRO sharding")
    advice.append("vlmfast estimate-memory shows where the memory goes and the cheapest changes that make it fit")
    return advice
