"""DistributedDataParallel with the spec's bucketing and graph options, and its comm hook.

Usage::

    model = wrap_ddp(model, spec.ddp, device)       # after strategies changed the model, before training
    engine = DDPEngine(spec.ddp, device, precision, world_size)   # the trainer's engine when launched on several ranks
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from vlmfast.engines.base import Engine, OptimizerFactory
from vlmfast.engines.collectives import all_reduce_gradients
from vlmfast.spec import DDPSpec
from vlmfast.strategies.base import Strategy

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
        from vlmfast.engines.comm_hooks import register_comm_hook_from_spec

        register_comm_hook_from_spec(ddp, spec)
    return ddp


def _buffer_sync_kwargs(enabled: bool) -> dict[str, bool]:
    """torch >= 2.13 renames broadcast_buffers to forward_sync_buffers (the old name warns)."""
    params = inspect.signature(DistributedDataParallel.__init__).parameters
    return {"forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers": enabled}


@contextmanager
def ddp_errors_explained(world_size: int) -> Iterator[None]:
    """Re-raise DDP's unused-parameter error with the fix (other errors pass unchanged)."""
    try:
        yield
    except RuntimeError as exc:
        explained = explain_ddp_error(exc) if world_size > 1 else exc
        if explained is not exc:
            raise explained from exc
        raise


def explain_ddp_error(exc: RuntimeError) -> RuntimeError:
    """Add the fix to DDP's unused-parameter error; other errors pass through unchanged."""
    text = str(exc)
    if "Expected to have finished reduction in the prior iteration" in text or "did not receive grad" in text:
        return RuntimeError(f"{UNUSED_PARAMETERS_HINT}\n(DDP said: {text.splitlines()[0]})")
    return exc


class DDPEngine(Engine):
    """DistributedDataParallel: gradients all-reduced in buckets during the last micro-batch's backward.

    With `manual_sync` (the OOM fallback on several ranks) DDP's in-backward all-reduce would strand a peer whose
    rank ran out of memory, so gradients stay local until all ranks agree the step finished, then
    :meth:`finish_gradients` averages them by hand.
    """

    name = "ddp"

    def __init__(self, spec: DDPSpec, device: torch.device, precision: Strategy, world_size: int,
                 manual_sync: bool = False) -> None:
        super().__init__(precision, world_size)
        self.spec, self.device, self.manual_sync = spec, device, manual_sync
        if manual_sync and spec.comm_hook != "none":
            log.warning("ddp.comm_hook %s does not apply with oom.enabled on several ranks: gradients are averaged "
                        "by vlmfast after all ranks agree (see docs/oom.md)", spec.comm_hook)

    def setup(self, model: nn.Module, build_optimizer: OptimizerFactory) -> nn.Module:
        super().setup(model, build_optimizer)
        spec = self.spec if not self.manual_sync else self.spec.model_copy(update={"comm_hook": "none"})
        return wrap_ddp(model, spec, self.device)

    def sync_context(self, model: nn.Module, last_micro_batch: bool) -> AbstractContextManager[Any]:
        if (last_micro_batch or self.spec.sync_each_micro_batch) and not (self.manual_sync or self._local):
            return nullcontext()
        return model.no_sync()

    def finish_gradients(self) -> None:
        if self.manual_sync:
            all_reduce_gradients(self.trainable_parameters(), self.spec.bucket_cap_mb)

    def describe(self) -> list[str]:
        hook = "" if self.spec.comm_hook == "none" or self.manual_sync else f", comm hook {self.spec.comm_hook}"
        manual = ", gradients averaged after the OOM agreement" if self.manual_sync else ""
        return [*super().describe(), f"ddp: {self.world_size} ranks, buckets {self.spec.bucket_cap_mb:g} MB{hook}"
                f"{manual}"]
