"""How long one optimizer step takes, estimated before training (``data.num_workers: auto`` sizes the loader by it).

The loader's workers must be chosen before any step runs (a worker started mid-run forks the training process and
stalls it), so the step cannot be timed by running it. Forward passes can be: without autograd, in eval mode, with
every random generator restored, so the run trains exactly as it would without the estimate.

Usage::

    seconds = estimate_step_seconds(model, batch, device, forward_context, micro_batches=4)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from vlmfast.models.outputs import call_model

BACKWARD_FORWARDS = 2  # a backward costs about two forwards (the 6N-per-token count's 4N of 6N)


def estimate_step_seconds(model: nn.Module, batch: Any, device: torch.device,
                          forward_context: Callable[[], AbstractContextManager[Any]], micro_batches: int,
                          repeats: int = 3) -> float:
    """Seconds of one step of `micro_batches` micro-batches like `batch` (on the device): the fastest of `repeats`
    forward passes (the first warms up) x (1 + BACKWARD_FORWARDS) x `micro_batches`. The model's mode and the
    random generators (torch's CPU and CUDA ones) are restored."""
    was_training = model.training
    times = []
    devices = [device] if device.type == "cuda" else []
    try:
        model.eval()
        with torch.random.fork_rng(devices=devices), torch.no_grad():
            for _ in range(repeats):
                _synchronize(device)
                start = time.perf_counter()
                with forward_context():
                    call_model(model, batch)
                _synchronize(device)
                times.append(time.perf_counter() - start)
    finally:
        model.train(was_training)
    return min(times[1:] or times) * (1 + BACKWARD_FORWARDS) * micro_batches


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
