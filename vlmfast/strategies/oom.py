"""Out-of-memory fallback: on OOM, halve the micro-batch and retry the same optimizer batch.

The retried region is forward + backward of all micro-batches only: the optimizer never steps on a partial
gradient. Because accumulation weights each micro-batch by its share of the batch's loss items, the gradient of
the retried batch is the same as it would have been at the original size. Ranks agree through an all-reduce of
the OOM flag, so a rank that did not hit the OOM retries too and nobody hangs.

Usage in a hand-written loop::

    fallback = OOMFallback(OOMSpec(enabled=True), micro_batch_size=16)
    for batch in loader:
        loss = fallback.run(lambda mbs: accumulate_gradients(model, batch, mbs),
                            cleanup=lambda: optimizer.zero_grad(set_to_none=True))
        optimizer.step(); optimizer.zero_grad(set_to_none=True)
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import torch

from vlmfast.spec import OOMSpec
from vlmfast.strategies.base import Strategy

log = logging.getLogger(__name__)
T = TypeVar("T")

# Messages of allocation failures that do not always arrive as torch.OutOfMemoryError.
OOM_MESSAGES = (
    "CUDA out of memory",
    "CUBLAS_STATUS_ALLOC_FAILED",
    "CUDNN_STATUS_ALLOC_FAILED",
    "HIP out of memory",
    "MPS backend out of memory",
    "XPU out of memory",
    "DefaultCPUAllocator: can't allocate memory",
    "DefaultCPUAllocator: not enough memory",
)


class OutOfMemoryAtMinimumError(RuntimeError):
    """Out of memory even at `oom.min_micro_batch_size`: the message carries the memory summary and advice."""


def is_oom_error(exc: BaseException) -> bool:
    """True for torch.OutOfMemoryError, and for RuntimeErrors whose message is a known allocation failure."""
    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(text in str(exc) for text in OOM_MESSAGES)


def free_memory() -> None:
    """Release what an aborted step left: Python cycles first, then the CUDA cache."""
    gc.collect()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.empty_cache()


def set_expandable_segments() -> bool:
    """Ask the CUDA caching allocator for expandable segments (less fragmentation), before or after CUDA starts."""
    from vlmfast.memory.allocator import set_expandable_segments as apply  # there: works after CUDA started too

    return apply()


def rank_max(value: int) -> int:
    """The largest `value` over ranks (MAX all-reduce; the value itself in a single process)."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return value
    device = torch.device("cuda", torch.cuda.current_device()) if torch.distributed.get_backend() == "nccl" else "cpu"
    tensor = torch.tensor([value], device=device)
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.MAX)
    return int(tensor.item())


def any_rank(flag: bool) -> bool:
    """Whether `flag` is set on any rank."""
    return bool(rank_max(int(flag)))


OK, OOM, FAILED = 0, 1, 2  # what a rank reports after an attempt; the worst one wins


class OOMFallback(Strategy):
    """Retries a step at half the micro-batch on OOM, grows back after a run of clean steps."""

    name = "oom"

    def __init__(self, spec: OOMSpec, micro_batch_size: int, describe_memory: Callable[[], str] | None = None,
                 on_oom: Callable[[], None] | None = None) -> None:
        self.spec = spec
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
        """Call `attempt(micro_batch_size)` until it finishes without OOM on every rank; return its result."""
        self._maybe_grow()
        while True:
            status, error = OK, None
            try:
                result = attempt(self.micro_batch_size)
            except Exception as exc:
                if is_oom_error(exc):
                    status = OOM  # the exception (and the tensors its traceback pins) dies with this block
                else:
                    status, error = FAILED, exc
            worst = rank_max(status)  # every rank joins, even one about to raise, so no peer waits for it
            if error is not None:
                raise error
            if worst == FAILED:
                raise RuntimeError("another rank failed during forward/backward (its traceback shows why); "
                                   "stopping this rank too")
            if worst == OK:
                self.clean_steps += 1
                return result
            result = None  # a rank that did not OOM drops its gradients too: everybody retries the batch
            self._recover(cleanup, status == OOM)

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
