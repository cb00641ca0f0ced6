"""Find the largest micro-batch that fits: binary search over forward + backward + optimizer step.

Usage::

    search = trainer.find_micro_batch_size()      # model and optimizer state are restored afterwards
    print(search.largest, search.recommended)

(vlmfast.train.batch_size), or for any loop ``find_max_micro_batch_size(probe, max_size=64)`` with ``probe(n)``
running one step on n samples.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from vlmfast.engines.collectives import any_rank
from vlmfast.memory.oom_errors import free_memory, is_oom_error

log = logging.getLogger(__name__)


@dataclass
class BatchSizeSearch:
    """The outcome: the largest size that fitted on every rank, the size to use, and every probe's result."""

    largest: int
    recommended: int
    tried: dict[int, bool] = field(default_factory=dict)
    margin_note: str = ""

    def to_text(self) -> str:
        probes = ", ".join(f"{n}: {'fits' if ok else 'OOM'}" for n, ok in sorted(self.tried.items()))
        return (f"largest micro-batch that fits: {self.largest} ({probes})\n"
                f"recommended: micro_batch_size: {self.recommended}  ({self.margin_note})")


def find_max_micro_batch_size(
    probe: Callable[[int], None],
    max_size: int,
    *,
    min_size: int = 1,
    safety_margin: float = 0.9,
    device: torch.device | None = None,
) -> BatchSizeSearch:
    """Binary search of the largest n in [min_size, max_size] for which `probe(n)` runs without OOM on all ranks.

    On CUDA a probe only counts as fitting when its peak allocation stays under `safety_margin` of the device's
    memory; without a memory reading (CPU) the recommendation is the largest size scaled by `safety_margin`.
    """
    tried: dict[int, bool] = {}

    def fits(n: int) -> bool:
        tried[n] = _probe_fits(probe, n, safety_margin, device)
        log.info("batch-size search: %d %s", n, "fits" if tried[n] else "does not fit")
        return tried[n]

    if not fits(min_size):
        raise torch.OutOfMemoryError(f"even micro_batch_size {min_size} does not fit: see vlmfast estimate-memory")
    low, high = min_size, max_size + 1  # low fits, high does not (or is out of range)
    if fits(max_size):
        low = max_size
    else:
        high = max_size
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if fits(middle) else (low, middle)
    measured = device is not None and device.type == "cuda"
    limit = low if measured else max(min_size, int(low * safety_margin))
    # A divisor of max_size (the batch size) so micro-batches are equal, as the spec requires.
    recommended = max((d for d in range(min_size, limit + 1) if max_size % d == 0), default=min_size)
    note = (f"peak memory kept under {safety_margin:.0%} of the device" if measured
            else f"{safety_margin:.0%} of the largest: no device memory reading on {device.type if device else 'cpu'}")
    return BatchSizeSearch(low, recommended, tried, note + f"; a divisor of the batch size {max_size}")


def _probe_fits(probe: Callable[[int], None], n: int, safety_margin: float, device: torch.device | None) -> bool:
    cuda = device is not None and device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    ok = True
    try:
        probe(n)
    except Exception as exc:
        if not is_oom_error(exc):
            raise
        ok = False  # leave the except block before freeing: the traceback pins the probe's tensors
    free_memory()
    if ok and cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        ok = torch.cuda.max_memory_allocated(device) <= safety_margin * total
    return not any_rank(not ok)


def snapshot_to_host(state: Any) -> Any:
    """A host copy of every tensor in a (nested) state dict, complete when this returns.

    Each tensor is copied with a blocking ``.to("cpu", copy=True)``: a device-to-host copy with ``non_blocking=True``
    returns before the data has arrived (the host buffer is only valid after a synchronisation; torch's
    ``Tensor.to`` docs), so a snapshot taken that way and then deep-copied could hold half-written values. ``copy=True``
    also makes a CPU tensor a separate copy (``.to`` would alias it). Non-tensor leaves are deep-copied.
    Usage: ``saved = snapshot_to_host(model.state_dict()); ...; model.load_state_dict(saved)``
    """
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)  # blocking: complete on return
    if isinstance(state, dict):
        return type(state)((key, snapshot_to_host(value)) for key, value in state.items())
    if isinstance(state, (list, tuple)) and not hasattr(state, "_fields"):
        return type(state)(snapshot_to_host(value) for value in state)
    return copy.deepcopy(state)


def restore_from_host(model: torch.nn.Module, optimizer: torch.optim.Optimizer, model_state: dict[str, Any],
                      optimizer_state: dict[str, Any]) -> None:
    """Put a :func:`snapshot_to_host` of a model and its optimizer back, exactly.

    ``load_state_dict`` copies into the existing parameters (the optimizer keeps pointing at them) and moves the
    optimizer's states to each parameter's device (``Optimizer._process_value_according_to_param_policy``, which keeps
    ``step`` on the host unless the optimizer is fused or capturable), so the step after the search is the one
    that would have run without it.
    Usage: ``restore_from_host(model, optimizer, saved_model, saved_optimizer)``
    """
    model.load_state_dict(model_state)
    optimizer.load_state_dict(optimizer_state)
