"""Out-of-memory fallback: on OOM, halve the micro-batch and retry the same optimizer batch.

The retried region is forward + backward of all micro-batches only: the optimizer never steps on a partial
gradient. Because accumulation weights each micro-batch by its share of the batch's loss items, the gradient of
the retried batch is the same as it would have been at the original size. Ranks agree through an all-reduce of
the OOM flag, so a rank that did not hit the OOM retries too and nobody hangs.

Usage in a hand-written, Accelerate or Fabric loop::

    fallback = OOMFallback(OOMSpec(enabled=True), micro_batch_size=16, model=model)  # model: DDP / prepared / set up
    for batch in loader:
        loss = fallback.run(lambda mbs: accumulate_gradients(model, batch, mbs),
                            cleanup=lambda: optimizer.zero_grad(set_to_none=True))
        optimizer.step(); optimizer.zero_grad(set_to_none=True)

Under DDP, give it the model (and the Accelerator or Fabric as `loop`): the attempt then runs with the gradient
all-reduce held back (the loop's no-sync), and the fallback averages the gradients itself once every rank reports
success. Without that, a rank that runs out of memory leaves its peers waiting inside DDP's backward all-reduce.
DDP's comm hooks do not run on those steps (the gradients are averaged in fp32, in buckets).

In the trainer it is the micro-batch sizer: the loop calls ``sizer.run(lambda size: train_step(batch, size), ...)``
and this object holds the only mutable micro-batch size (:class:`FixedMicroBatchSize` when the fallback is off).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, TypeVar

from torch import nn

from vlmfast.engines.collectives import agree_max, all_reduce_gradients, world_size
from vlmfast.engines.foreign_loops import deferring, find_sync_module, no_sync
from vlmfast.memory.oom_errors import FAILED, OK, OOM, OutOfMemoryAtMinimumError, free_memory, is_oom_error
from vlmfast.spec import OOMSpec
from vlmfast.strategies.base import Strategy

log = logging.getLogger(__name__)
T = TypeVar("T")

__all__ = ["FixedMicroBatchSize", "OOMFallback", "OutOfMemoryAtMinimumError", "build_micro_batching", "free_memory",
           "is_oom_error", "set_expandable_segments"]


def set_expandable_segments() -> bool:
    """Ask the CUDA caching allocator for expandable segments (less fragmentation), before or after CUDA starts."""
    from vlmfast.memory.allocator import set_expandable_segments as apply  # there: works after CUDA started too

    return apply()




class FixedMicroBatchSize(Strategy):
    """The micro-batch size when nothing changes it: `run` calls the attempt once at the spec's size."""

    name = "micro_batch_size"

    def __init__(self, micro_batch_size: int) -> None:
        self.micro_batch_size = micro_batch_size

    def run(self, attempt: Callable[[int], T], cleanup: Callable[[], None]) -> T:
        return attempt(self.micro_batch_size)

    def describe(self) -> str:
        return ""  # the accumulation line already says how the batch was split


class OOMFallback(Strategy):
    """Retries a step at half the micro-batch on OOM, grows back after a run of clean steps."""

    name = "oom"

    def __init__(self, spec: OOMSpec, micro_batch_size: int, describe_memory: Callable[[], str] | None = None,
                 on_oom: Callable[[], None] | None = None, *, model: nn.Module | None = None,
                 loop: Any = None) -> None:
        self.spec = spec
        self.model, self.loop = model, loop  # set: the fallback holds the gradient sync (user loops under DDP)
        self.configured = micro_batch_size
        self.micro_batch_size = micro_batch_size
        self.clean_steps = 0
        self.grow_after = spec.grow_after_steps
        self.events: list[dict[str, Any]] = []  # every change: {"from", "to", "reason"}
        self.describe_memory = describe_memory or (lambda: "")
        self.on_oom = on_oom
        if spec.expandable_segments:
            set_expandable_segments()

    def run(self, attempt: Callable[[int], T], cleanup: Callable[[], None]) -> T:
        """Call `attempt(micro_batch_size)` until it finishes without OOM on every rank; return its result.

        Cross-rank sums the attempt registers through :func:`vlmfast.engines.foreign_loops.after_agreement` (the
        global loss of ``accumulate_gradients``) run after the agreement, so a rank that ran out of memory never
        meets a peer in a different collective."""
        self._maybe_grow()
        while True:
            status, error = OK, None
            with deferring() as pending:
                try:
                    with self._held_sync():
                        result = attempt(self.micro_batch_size)
                except Exception as exc:
                    if is_oom_error(exc):
                        status = OOM  # the exception (and the tensors its traceback pins) dies with this block
                    else:
                        status, error = FAILED, exc
            worst = agree_max(status)  # every rank joins, even one about to raise, so no peer waits for it
            if error is not None:
                raise error
            if worst == FAILED:
                raise RuntimeError("another rank failed during forward/backward (its traceback shows why); "
                                   "stopping this rank too")
            if worst == OK:
                self._average_held_gradients()
                for work in pending:
                    work()
                self.clean_steps += 1
                return result
            result = None  # a rank that did not OOM drops its gradients too: everybody retries the batch
            self._recover(cleanup, status == OOM)

    def _holds_sync(self) -> bool:
        return self.model is not None and world_size() > 1 and find_sync_module(self.model) is not None

    def _held_sync(self) -> Any:
        """The loop's no-sync around the whole attempt (nested no-syncs inside it keep it held)."""
        return no_sync(self.model, self.loop, enabled=self._holds_sync())

    def _average_held_gradients(self) -> None:
        if self._holds_sync():
            all_reduce_gradients(self.model.parameters())

    def _recover(self, cleanup: Callable[[], None], oom_here: bool) -> None:
        cleanup()
        free_memory()
        if oom_here and self.on_oom is not None:
            self.on_oom()
        if self.micro_batch_size <= self.spec.min_micro_batch_size:
            raise OutOfMemoryAtMinimumError(self._exhausted_message())
        grow_failed = self.clean_steps == 0 and bool(self.events) and self.events[-1].get("after_grow", False)
        self._change(max(self.spec.min_micro_batch_size, self.micro_batch_size // 2),
                     "out of memory" + ("" if oom_here else " on another rank"))
        if grow_failed and self.grow_after:
            self.grow_after *= 2  # back off so a size that fails is not retried every few steps
        self.clean_steps = 0

    def _maybe_grow(self) -> None:
        if self.grow_after is None or self.micro_batch_size >= self.configured or self.clean_steps < self.grow_after:
            return
        self._change(min(self.configured, self.micro_batch_size * 2), f"{self.clean_steps} clean steps")
        self.events[-1]["after_grow"] = True
        self.clean_steps = 0

    def _change(self, new: int, reason: str) -> None:
        log.warning("oom fallback: micro_batch_size %d -> %d (%s)", self.micro_batch_size, new, reason)
        self.events.append({"from": self.micro_batch_size, "to": new, "reason": reason})
        self.micro_batch_size = new

    def _exhausted_message(self) -> str:
        return (f"out of memory at micro_batch_size {self.micro_batch_size} (oom.min_micro_batch_size "
                f"{self.spec.min_micro_batch_size}): the model does not fit even at the smallest micro-batch.\n"
                f"{self.describe_memory()}")

    def state_dict(self) -> dict[str, Any]:
        return {"configured": self.configured, "micro_batch_size": self.micro_batch_size,
                "clean_steps": self.clean_steps, "grow_after": self.grow_after}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state and state.get("configured") == self.configured:  # a deliberately changed spec wins
            self.micro_batch_size = state["micro_batch_size"]
            self.clean_steps = state["clean_steps"]
            self.grow_after = state["grow_after"]

    def describe(self) -> str:
        changes = "; ".join(f"{e['from']}->{e['to']} ({e['reason']})" for e in self.events) or "no OOM"
        return f"oom fallback: micro_batch_size {self.configured} -> {self.micro_batch_size} now; {changes}"


def build_micro_batching(spec: OOMSpec, micro_batch_size: int, describe_memory: Callable[[], str] | None = None,
                         on_oom: Callable[[], None] | None = None) -> FixedMicroBatchSize | OOMFallback:
    """The object that owns the micro-batch size: the OOM fallback when `oom.enabled`, else a fixed size."""
    if not spec.enabled:
        return FixedMicroBatchSize(micro_batch_size)
    return OOMFallback(spec, micro_batch_size, describe_memory=describe_memory, on_oom=on_oom)
