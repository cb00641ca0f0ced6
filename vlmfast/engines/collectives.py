"""Every collective the training step issues, in one place, so that ranks stay symmetric.

The rule (docs/architecture.md): every rank issues the same collectives in the same order every step, whatever
its data. Counts are agreed first (:func:`agree_max`), flags travel inside the loss all-reduce
(:func:`sum_loss_and_flags`), and a rank with nothing to do still joins.

Usage::

    total = all_reduce_sum(local_tokens)                     # host number summed over ranks (one small collective)
    loss, stop = sum_loss_and_flags(loss, wants_stop=False)  # the step's global loss and the agreed stop flag
    loss, stop, totals = sum_step_totals(loss, False, (samples, tokens))  # ... and counts summed over ranks
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.distributed as dist


def world_size() -> int:
    """Ranks in the default process group (1 without one)."""
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


_HOST_GROUPS: dict[int, object] = {}


def host_group() -> object:
    """A gloo group for host numbers (token counts, flags): under NCCL they would need a device tensor and a
    device-to-host read (a sync of the whole GPU queue) per collective; gloo reduces CPU tensors directly.
    Created on first use; every rank reaches it at the same point of the step, as `new_group` requires."""
    if dist.get_backend() != "nccl":
        return None  # the default group already reduces CPU tensors
    key = id(dist.group.WORLD)
    if key not in _HOST_GROUPS:
        _HOST_GROUPS[key] = dist.new_group(backend="gloo")
    return _HOST_GROUPS[key]


def all_reduce_sum(value: float) -> float:
    """Sum a host number over ranks (a no-op in a single process; never a device sync)."""
    if world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(tensor, group=host_group())
    return float(tensor)


def agree_max(value: int) -> int:
    """The largest `value` over ranks (MAX all-reduce): counts every rank must share, flags where any rank wins."""
    if world_size() == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=host_group())
    return int(tensor)


def sum_and_max(total: float, count: int) -> tuple[float, int]:
    """`total` summed and `count` maxed over ranks, in one collective (the step's loss items and micro-batches)."""
    if world_size() == 1:
        return total, count
    mine = torch.tensor([total, float(count)], dtype=torch.float64)
    gathered = [torch.empty_like(mine) for _ in range(world_size())]
    dist.all_gather(gathered, mine, group=host_group())
    stacked = torch.stack(gathered)
    return float(stacked[:, 0].sum()), int(stacked[:, 1].max())


def any_rank(flag: bool) -> bool:
    """Whether `flag` is set on any rank."""
    return bool(agree_max(int(flag)))


def sum_loss_and_flags(loss: torch.Tensor, wants_stop: bool) -> tuple[torch.Tensor, torch.Tensor | bool]:
    """The loss summed over ranks, and whether any rank wants to stop, in one all-reduce.

    The stop flag comes back as a device tensor (read with the step's one host read) under several ranks.
    """
    loss, stop, _ = sum_step_totals(loss, wants_stop, ())
    return loss, stop


def sum_step_totals(loss: torch.Tensor, wants_stop: bool, counts: tuple[float, ...]
                    ) -> tuple[torch.Tensor, torch.Tensor | bool, torch.Tensor | tuple[float, ...]]:
    """:func:`sum_loss_and_flags`, and `counts` (this rank's samples and tokens) summed over ranks in the same
    all-reduce: a float64 device vector under several ranks (exact up to 2**53, read with the step's one host
    read), the host values themselves under one."""
    if world_size() == 1:
        return loss, wants_stop, counts
    dtype = torch.float64 if counts else torch.float32  # counts past 2**24 tokens a step stay exact
    host = [float(wants_stop), *(float(c) for c in counts)]  # filled on the device: no host-to-device copy
    packed = torch.stack([loss.to(dtype), *(torch.full((), v, dtype=dtype, device=loss.device) for v in host)])
    dist.all_reduce(packed)
    return packed[0].float(), packed[1] > 0, packed[2:]


def all_reduce_gradients(parameters: Iterable[torch.Tensor], bucket_mb: float = 25.0) -> None:
    """Average gradients over ranks by hand, in flat buckets (used when DDP's own sync is off: OOM fallback).

    Every trainable parameter takes part (a missing gradient counts as zeros) so all ranks reduce the same buckets.
    """
    ranks = world_size()
    if ranks == 1:
        return
    params = [p for p in parameters if p.requires_grad]
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    limit = bucket_mb * 2**20
    bucket: list[torch.Tensor] = []
    size = 0
    for grad in [p.grad for p in params]:
        if bucket and (grad.dtype != bucket[0].dtype or size + grad.nbytes > limit):
            _reduce_bucket(bucket, ranks)
            bucket, size = [], 0
        bucket.append(grad)
        size += grad.nbytes
    if bucket:
        _reduce_bucket(bucket, ranks)


def _reduce_bucket(grads: list[torch.Tensor], ranks: int) -> None:
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

    flat = _flatten_dense_tensors(grads)
    dist.all_reduce(flat)
    flat /= ranks
    for grad, synced in zip(grads, _unflatten_dense_tensors(flat, grads), strict=True):
        grad.copy_(synced)


def broadcast_object(value: object, src: int = 0) -> object:
    """`value` from rank `src` on every rank (a checkpoint path, a decision only rank 0 can make)."""
    if world_size() == 1:
        return value
    shared = [value]
    dist.broadcast_object_list(shared, src=src)
    return shared[0]


def gather_objects(value: object) -> list[object]:
    """Every rank's `value`, in rank order, on every rank (per-rank RNG states for a checkpoint)."""
    if world_size() == 1:
        return [value]
    gathered: list[object] = [None] * world_size()
    dist.all_gather_object(gathered, value)
    return gathered


def barrier() -> None:
    """Wait for every rank (a no-op in one process)."""
    if world_size() > 1:
        dist.barrier()
