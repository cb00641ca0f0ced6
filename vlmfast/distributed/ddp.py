"""DistributedDataParallel with the spec's bucketing and graph options, and its comm hook.

Usage::

    model = wrap_ddp(model, spec.ddp, device)       # after strategies changed the model, before training
"""

from __future__ import annotations

import inspect
import logging

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from vlmfast.spec import DDPSpec

log = logging.getLogger(__name__)

UNUSED_PARAMETERS_HINT = (
    "a trainable parameter received no gradient this step, so DDP waited for it. If a module is skipped in forward "
    "(an unused head, a tower bypassed for text-only batches), freeze it (optimizer.freeze) or set "
    "ddp.find_unused_parameters: true"
)


def wrap_ddp(model: nn.Module, spec: DDPSpec, device: torch.device) -> DistributedDataParallel:
    """Wrap `model` in DDP (already-wrapped models are returned as they are) and register the comm hook."""
    if isinstance(model, DistributedDataParallel):
        return model
    device_ids = [device.index] if device.type == "cuda" else None
    ddp = DistributedDataParallel(
        model,
        device_ids=device_ids,
        bucket_cap_mb=spec.bucket_cap_mb,
        gradient_as_bucket_view=spec.gradient_as_bucket_view,
        static_graph=spec.static_graph,
        find_unused_parameters=spec.find_unused_parameters,
        **_buffer_sync_kwargs(spec.broadcast_buffers),
    )
    if spec.comm_hook != "none":
        from vlmfast.distributed.comm_hooks import register_comm_hook_from_spec

        register_comm_hook_from_spec(ddp, spec)
    return ddp


def _buffer_sync_kwargs(enabled: bool) -> dict[str, bool]:
    """torch >= 2.13 renames broadcast_buffers to forward_sync_buffers (the old name warns)."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers": enabled}


def explain_ddp_error(exc: RuntimeError) -> RuntimeError:
    """Add the fix to DDP's unused-parameter error; other errors pass through unchanged."""
    text = str(exc)
    if "Expected to have finished reduction in the prior iteration" in text or "did not receive grad" in text:
        return RuntimeError(f"{UNUSED_PARAMETERS_HINT}\n(DDP said: {text.splitlines()[0]})")
    return exc
