"""Per-rank compute time and the straggler time of a step: what balanced ranks (data.rank_balance) cut.

A rank's compute time runs from the start of its step (its batch in hand) to the moment its backward accumulated the
last gradient (post-accumulate-grad hooks on the trainable parameters): DDP's bucketed all-reduce overlaps backward
and then waits for the slowest rank inside it, so timing the step would give every rank the same figure. The
straggler time is the spread across ranks (max minus min), from one small all-reduce per step. On CUDA the clock
reads events on the compute stream at the end of the step (one host read), on CPU the wall clock.

Usage::

    clock = ComputeClock(model)
    clock.start(); ...forward/backward...; seconds = clock.seconds()
    spread = straggler_seconds(seconds)        # max - min over ranks (0 on one process)
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn

__all__ = ["ComputeClock", "straggler_seconds"]


class ComputeClock:
    """This rank's compute time per step, up to its last gradient (see the module doc)."""

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        # Two events recorded again each step (a hook fires per parameter: no allocation there)
        self._events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
            if self.cuda else None
        self._start = self._last = 0.0
        self._seen = False  # a gradient was accumulated since start()
        self._handles = [p.register_post_accumulate_grad_hook(self._grad_ready)
                         for p in model.parameters() if p.requires_grad]

    def _mark(self, index: int) -> float:
        if self._events is not None:
            self._events[index].record()
            return 0.0
        return time.perf_counter()

    def _grad_ready(self, _param: torch.Tensor) -> None:
        self._last, self._seen = self._mark(1), True

    def start(self) -> None:
        self._start, self._seen = self._mark(0), False

    def seconds(self) -> float:
        """Seconds from :meth:`start` to the last gradient accumulated since (to now, when none was)."""
        if not self._seen:
            self._last = self._mark(1)
        if self._events is not None:
            self._events[1].synchronize()
            return self._events[0].elapsed_time(self._events[1]) / 1000.0
        return self._last - self._start

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def straggler_seconds(seconds: float, device: torch.device | None = None) -> float:
    """max - min of every rank's `seconds` (one all-reduce of two values); 0.0 on one process."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0.0
    device = device if device is not None and device.type == "cuda" else torch.device("cpu")
    both = torch.tensor([seconds, -seconds], dtype=torch.float64, device=device)
    dist.all_reduce(both, op=dist.ReduceOp.MAX)
    return float(both[0] + both[1])
