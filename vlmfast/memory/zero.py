"""DeepSpeed ZeRO: DeepSpeed's own model-state formulas, and how the estimate shards each component's states.

Usage: ``zero2_model_states_bytes(7_000_000_000, num_gpus_per_node=8, cpu_offload=False).gpu_bytes``

ZeRO (world size N, L = the largest layer's parameters, counted like DeepSpeed: one module's own parameters).
DeepSpeed's ZeRO optimizers in mixed precision also keep an fp32 copy of the gradient partition: +4 bytes per
parameter. That is where its "18" comes from: 18 = 2 (16-bit grads) + 4 (fp32 grads) + 4 (fp32 master) + 8 (m, v)
for ZeRO-2, and 2 (16-bit weights) + 4 + 4 + 8 for ZeRO-3, whose 16-bit gradients only live, with the gathered
weights, in the 4L working set. With w, g the 16-bit weights and grads, f the fp32 gradient partition, o the
master + states::

    stage 0 (plain DDP):  w + g + o                     (16P mixed AdamW)
    stage 1:              w + g + (f + o) / N           (4P + 16P/N; DeepSpeed has no ZeRO-1 estimator)
    stage 2:              w + (g + f + o) / N           (2P + 18P/N = DeepSpeed's estimate_zero2_model_states_mem_needs)
    stage 3:              (w + f + o) / N + (w + g) L   (4L + 18P/N = DeepSpeed's estimate_zero3_model_states_mem_needs)

``offload_optimizer`` moves o and the gradient partition f to host memory (ZeRO-2: 2P on the GPU, 16P on the
host), ``offload_params`` (ZeRO-3) moves w too (4L on the GPU, 18P on the host). Host bytes are per node, times
DeepSpeed's ``additional_buffer_factor`` 1.5; DeepSpeed's estimators also reserve 4 bytes per parameter per process
for loading the model without ``zero_init`` (its ``max(4 * gpus, 16)``), which is left out here.
"""

from __future__ import annotations

from typing import NamedTuple

from torch import nn

from vlmfast.memory.options import EstimateOptions, StateBytes

__all__ = ["DS_BUFFER_FACTOR", "ZeroStates", "zero2_model_states_bytes", "zero3_model_states_bytes"]

DS_BUFFER_FACTOR = 1.5  # DeepSpeed's additional_buffer_factor for host memory


# ----------------------------------------------------------------------------------------------------------------
# DeepSpeed's formulas, as DeepSpeed computes them


class ZeroStates(NamedTuple):
    """Host and per-GPU bytes for model states, in DeepSpeed's order (cpu, gpu)."""

    cpu_bytes: int
    gpu_bytes: int


def zero2_model_states_bytes(
    total_params: int, *, num_gpus_per_node: int = 1, num_nodes: int = 1, cpu_offload: bool = True,
    additional_buffer_factor: float = DS_BUFFER_FACTOR,
) -> ZeroStates:
    """DeepSpeed's ``estimate_zero2_model_states_mem_needs`` (same arguments and defaults): 2P + 18P/N on the GPU.

    Usage: ``zero2_model_states_bytes(7_000_000_000, num_gpus_per_node=8, cpu_offload=False).gpu_bytes``
    """
    gpus = num_nodes * num_gpus_per_node
    if cpu_offload:
        gpu = 2 * total_params
        cpu = total_params * max(4 * gpus, 16) * additional_buffer_factor
    else:
        gpu = 2 * total_params + int(18 * total_params / gpus)
        cpu = total_params * 4 * num_gpus_per_node * additional_buffer_factor
    return ZeroStates(int(cpu), int(gpu))


def zero3_model_states_bytes(
    total_params: int, largest_layer_params: int, *, num_gpus_per_node: int = 1, num_nodes: int = 1,
    cpu_offload: bool = True, cpu_offload_params: bool = True, zero_init: bool = True,
    additional_buffer_factor: float = DS_BUFFER_FACTOR,
) -> ZeroStates:
    """DeepSpeed's ``estimate_zero3_model_states_mem_needs`` (same arguments and defaults): 4L + 18P/N on the GPU.

    Usage: ``zero3_model_states_bytes(7_000_000_000, 131_000_000, num_gpus_per_node=8, cpu_offload=False)``
    """
    gpus = num_nodes * num_gpus_per_node
    per_node = 1 / num_nodes
    largest = 4 * largest_layer_params
    if cpu_offload and cpu_offload_params:
        gpu = largest
        factor = 18 * per_node if zero_init else max(4 * num_gpus_per_node, 18 * per_node)
        cpu = total_params * factor * additional_buffer_factor
    elif cpu_offload:
        gpu = largest + int(2 * total_params / gpus)
        factor = 16 * per_node if zero_init else max(4 * num_gpus_per_node, 16 * per_node)
        cpu = total_params * factor * additional_buffer_factor
    else:
        gpu = largest + int(18 * total_params / gpus)
        loaded = largest_layer_params if zero_init else total_params
        cpu = loaded * 4 * num_gpus_per_node * additional_buffer_factor
    return ZeroStates(int(cpu), int(gpu))


# ----------------------------------------------------------------------------------------------------------------
# the estimate's sharding


def _shard(b: StateBytes, opts: EstimateOptions) -> tuple[int, int, int, int]:
    """(weights, grads, optimizer, host) bytes per GPU for one component under the ZeRO stage and offload."""
    n, stage = opts.world_size, opts.zero_stage
    optim = b.master + b.states
    # ZeRO-3 reduce-scatters 16-bit gradients straight into the fp32 partition (fp32 training: the gradients).
    fp32_part = b.grad_partition or b.grads
    if stage == 0:
        weights, grads, opt = b.weights, b.grads, optim
    elif stage == 1:
        weights, grads, opt = b.weights, b.grads + b.grad_partition / n, optim / n
    elif stage == 2:
        weights, grads, opt = b.weights, (b.grads + b.grad_partition) / n, optim / n
    else:
        weights, grads, opt = b.weights / n, fp32_part / n, optim / n
    host = 0.0
    if opts.offload_optimizer:
        # As DeepSpeed counts it: master, states and the fp32 gradient partition live on the host; ZeRO-1 keeps
        # its full 16-bit gradients, ZeRO-2/3 only stream them through buckets.
        host += opt + (b.grad_partition / n if stage == 1 else fp32_part / n)
        opt = 0.0
        grads = b.grads if stage == 1 else 0.0
    if opts.offload_params:
        host += weights
        weights = 0.0
    return round(weights), round(grads), round(opt), round(host)


def _largest_layer_params(model: nn.Module) -> int:
    # DeepSpeed's definition: the most parameters one module owns directly (ZeRO-3 gathers one module at a time).
    return max((sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules()), default=0)

