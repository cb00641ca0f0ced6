"""Helpers to test training code without a GPU: simulate out-of-memory errors on any device.

Usage::

    with simulated_oom(4) as oom:         # any top-level forward on > 4 samples raises torch.OutOfMemoryError
        trainer.fit()
    print(oom.count)
    with simulated_oom(phase="optimizer"):   # every optimizer.step() runs out of memory (AdamW's first states)
        ...
    with count_host_syncs(model) as syncs:   # host reads of device values (see vlmfast.profiling.host_syncs)
        ...
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.optim.optimizer import register_optimizer_step_pre_hook

from vlmfast.data.batch import batch_size_of

SIMULATED_MESSAGE = "CUDA out of memory. Tried to allocate 2.00 GiB (simulated by vlmfast.testing.simulated_oom)"


@dataclass
class SimulatedOOM:
    """What the context reports: how many OOMs it raised."""

    max_micro_batch_size: int
    phase: str
    count: int = 0


@contextmanager
def simulated_oom(
    max_micro_batch_size: int = 0,
    *,
    phase: Literal["forward", "backward", "optimizer"] = "forward",
    ranks: Iterable[int] | None = None,
) -> Iterator[SimulatedOOM]:
    """Make the outermost module call on more than `max_micro_batch_size` samples raise `torch.OutOfMemoryError`.

    `phase="forward"` raises when that forward returns; `phase="backward"` raises when the gradient reaches its
    output during backward; `phase="optimizer"` raises in every ``optimizer.step()`` instead, whatever the batch
    (an OOM outside forward/backward, like AdamW allocating its states on the first step; `max_micro_batch_size` is
    ignored). `ranks` limits it to some torch.distributed ranks (default: every process). Works on CPU and GPU
    through torch's global module and optimizer hooks (no patching); only the outermost call is checked, so inner
    modules that reshape the batch never trigger it.
    """
    state = SimulatedOOM(max_micro_batch_size, phase)
    active = ranks is None or _rank() in set(ranks)
    if phase == "optimizer":
        with _oom_in_optimizer_step(state, active):
            yield state
        return
    depth = threading.local()

    def before(module: nn.Module, args: Any) -> None:
        depth.value = getattr(depth, "value", 0) + 1

    def after(module: nn.Module, args: Any, kwargs: Any, output: Any = None) -> None:
        # always_call: also when forward raised (then torch passes no output); the depth must come down either way.
        depth.value -= 1
        if depth.value or not active or _samples(args, kwargs) <= max_micro_batch_size:
            return
        if phase == "forward":
            state.count += 1
            raise torch.OutOfMemoryError(SIMULATED_MESSAGE)
        tensor = _first_grad_tensor(output)
        if tensor is not None:
            tensor.register_hook(lambda grad: _raise_in_backward(state))

    handles = [register_module_forward_pre_hook(before),
               register_module_forward_hook(after, with_kwargs=True, always_call=True)]
    try:
        yield state
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def _oom_in_optimizer_step(state: SimulatedOOM, active: bool) -> Iterator[None]:
    def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        if active:
            state.count += 1
            raise torch.OutOfMemoryError(SIMULATED_MESSAGE.replace("simulated", "simulated in optimizer.step"))

    handle = register_optimizer_step_pre_hook(before_step)
    try:
        yield
    finally:
        handle.remove()


def _raise_in_backward(state: SimulatedOOM) -> None:
    state.count += 1
    raise torch.OutOfMemoryError(SIMULATED_MESSAGE)


def _samples(args: Any, kwargs: Any) -> int:
    """Samples of a call: its keyword batch's text keys (input_ids...) first, so that a VLM's flattened image patches
    (Qwen2-VL's pixel_values rows) are not taken for samples; else the first tensor's dim 0."""
    try:
        return batch_size_of(kwargs) if kwargs and not args else batch_size_of([*args, *kwargs.values()])
    except TypeError:
        return 0


def _first_grad_tensor(output: Any) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output if output.requires_grad else None
    values = output.values() if isinstance(output, dict) else vars(output).values() if hasattr(output, "__dict__") \
        else output if isinstance(output, (list, tuple)) else ()
    for value in values:
        found = _first_grad_tensor(value)
        if found is not None:
            return found
    return None


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


from vlmfast.profiling.host_syncs import HostSync, HostSyncs, count_host_syncs  # noqa: E402  (re-exported)

__all__ = ["SIMULATED_MESSAGE", "HostSync", "HostSyncs", "SimulatedOOM", "count_host_syncs", "simulated_oom"]
