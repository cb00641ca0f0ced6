"""The hooks inside someone else's loop: find the DDP module behind Fabric or Accelerate, use the loop's own no-sync,
refuse settings of the loop that would change the gradient, and hold cross-rank sums until every rank agrees.

A plain loop wraps the model in ``DistributedDataParallel`` itself; Accelerate's ``prepare`` returns the DDP module
(or a compiled one around it); Lightning Fabric's ``setup`` returns a ``_FabricModule`` whose ``_forward_module`` is
the DDP module and whose attribute lookups go to the *unwrapped* model, so ``hasattr(model, "no_sync")`` is False
there. :func:`find_sync_module` walks these wrappers; :func:`no_sync` prefers the loop's own context
(``fabric.no_backward_sync``, ``accelerator.no_sync``) when the loop object is known.

Usage::

    loop = accelerator                                   # or fabric, or None in a plain DDP loop
    check_loop(loop)                                     # refuses Accelerator(gradient_accumulation_steps > 1)
    with no_sync(model, loop):                           # no gradient all-reduce in this backward
        loop.backward(model(**batch).loss)
    ddp = find_sync_module(model)                        # the DistributedDataParallel inside, or None
"""

from __future__ import annotations

import contextvars
import logging
import os
import warnings
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch
from torch import nn

__all__ = [
    "after_agreement",
    "check_loop",
    "deferring",
    "filter_deepspeed_warnings",
    "find_ddp",
    "find_sync_module",
    "launch_warning",
    "loop_backward",
    "loop_forward_context",
    "loop_kind",
    "loop_of",
    "no_sync",
    "warn_if_launched_alone",
]

log = logging.getLogger(__name__)
_WRAPPER_ATTRIBUTES = ("_forward_module", "_orig_mod")  # Fabric's wrapper, torch.compile's OptimizedModule


def _inner_modules(model: nn.Module) -> Iterator[nn.Module]:
    """`model`, then each module a known wrapper holds, outermost first (DDP's `.module` ends the walk)."""
    seen: set[int] = set()
    current: Any = model
    while isinstance(current, nn.Module) and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = next((current._modules[name] for name in _WRAPPER_ATTRIBUTES
                        if current._modules.get(name) is not None), None)


def find_sync_module(model: nn.Module) -> nn.Module | None:
    """The module that owns gradient synchronisation: DDP (`no_sync`), FSDP2 (`set_requires_gradient_sync`),
    found through Fabric's and torch.compile's wrappers; None for a model that does not sync gradients.

    Usage: ``ddp = find_sync_module(fabric_model)  # fabric_model._forward_module under strategy="ddp"``
    """
    for module in _inner_modules(model):
        if hasattr(type(module), "no_sync") or hasattr(type(module), "set_requires_gradient_sync"):
            return module
    return None


def find_ddp(model: nn.Module) -> torch.nn.parallel.DistributedDataParallel | None:
    """The ``DistributedDataParallel`` inside a plain, Accelerate or Fabric model, or None.

    Usage: ``register_comm_hook(find_ddp(model), "fp16")`` (register_comm_hook does this itself)
    """
    for module in _inner_modules(model):
        if isinstance(module, torch.nn.parallel.DistributedDataParallel):
            return module
    return None


def loop_kind(loop: Any) -> str | None:
    """"accelerate", "fabric" or None: what drives the loop, from the object's class (no import of either)."""
    if loop is None:
        return None
    for cls in type(loop).__mro__:
        if cls.__name__ == "Accelerator" and cls.__module__.startswith("accelerate"):
            return "accelerate"
        if cls.__name__ == "Fabric" and cls.__module__.startswith(("lightning_fabric", "lightning.fabric")):
            return "fabric"
    raise TypeError(f"loop must be an accelerate.Accelerator or a lightning Fabric, got {type(loop).__name__}")


def loop_of(backward: Callable[..., Any] | None) -> Any:
    """The Accelerator or Fabric a bound ``backward`` belongs to (``accelerator.backward``), else None."""
    owner = getattr(backward, "__self__", None)
    try:
        return owner if loop_kind(owner) else None
    except TypeError:
        return None


def check_loop(loop: Any) -> None:
    """Refuse loop settings that would silently change a gradient vlmfast's accumulation already makes exact.

    ``Accelerator(gradient_accumulation_steps=k)`` divides every loss by k in ``accelerator.backward`` and skips
    k-1 of k optimizer steps inside ``accelerator.accumulate()``: with the batch already accumulated by vlmfast the
    gradient would be 1/k of the batch gradient.
    """
    if loop_kind(loop) != "accelerate":
        return
    _warn_once(launch_warning(loop))
    steps = int(getattr(loop, "gradient_accumulation_steps", 1) or 1)
    if steps > 1:
        raise ValueError(
            f"Accelerator(gradient_accumulation_steps={steps}) and vlmfast's accumulate_gradients would both "
            f"accumulate: accelerator.backward divides each loss by {steps}, so the gradient would be 1/{steps} of the "
            "batch gradient. Create the Accelerator with gradient_accumulation_steps=1, drop accelerator.accumulate(), "
            f"and give accumulate_gradients the whole optimizer batch (a loader batch {steps}x larger, the same "
            "micro_batch_size: the same memory and the exact token-weighted gradient)"
        )


_MPI_WORLD = ("PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
_warned: set[str] = set()


def launch_warning(accelerator: Any = None, environ: dict[str, str] | None = None) -> str | None:
    """Why this process trains alone although a launcher asked for several, or None.

    Two cases seen on machines without GPUs: ``accelerate launch --num_processes N`` uses its simple launcher, which
    starts one process and sets no WORLD_SIZE (only MASTER_ADDR); and an ``Accelerator()`` under torchrun (or
    ``--multi_gpu``) that finds no GPU ignores WORLD_SIZE, so every process trains alone on its own data.

    Usage: ``if (message := launch_warning(accelerator)): print(message)``
    """
    env = os.environ if environ is None else environ
    world = int(env.get("WORLD_SIZE", "1"))
    if (accelerator is not None and world > 1 and int(getattr(accelerator, "num_processes", world)) == 1):
        return (f"WORLD_SIZE is {world} but this Accelerator runs alone (distributed type NO: it found no GPU), so "
                "each process trains on its own: create it with Accelerator(cpu=True) on CPU, or set "
                "ACCELERATE_USE_CPU=true")
    launched_by_accelerate = any(key.startswith("ACCELERATE_") for key in env)
    if (launched_by_accelerate and "MASTER_ADDR" in env and "WORLD_SIZE" not in env
            and not any(key in env for key in _MPI_WORLD)):
        return ("accelerate launch was asked for several processes but started only this one (its simple launcher, "
                "used without GPUs or without --multi_gpu): this run trains alone. On CPU use `accelerate launch "
                "--multi_gpu --num_processes N ...` (Accelerate loops also need Accelerator(cpu=True)) or "
                "`torchrun --nproc_per_node N ...`")
    return None


def _warn_once(message: str | None) -> None:
    if message and message not in _warned:
        _warned.add(message)
        log.warning("%s", message)


def warn_if_launched_alone(accelerator: Any = None) -> str | None:
    """Log :func:`launch_warning` once per process (the trainer calls it when it finds a single process)."""
    message = launch_warning(accelerator)
    _warn_once(message)
    return message


def loop_forward_context(loop: Any) -> Callable[[], AbstractContextManager[Any]] | None:
    """The loop's autocast (``accelerator.autocast`` / ``fabric.autocast``), or None without a loop."""
    return loop.autocast if loop_kind(loop) else None


def loop_backward(loop: Any) -> Callable[[torch.Tensor], None] | None:
    """The loop's backward (precision scaling included), or None without a loop."""
    return loop.backward if loop_kind(loop) else None


def no_sync(model: nn.Module, loop: Any = None, enabled: bool = True) -> AbstractContextManager[Any]:
    """Skip the gradient all-reduce of the backward passes inside (when `enabled`): the loop's own context when the
    loop object is given (Fabric's ``no_backward_sync``, Accelerate's ``no_sync``), else DDP's ``no_sync`` or FSDP2's
    ``set_requires_gradient_sync(False)`` on the module found by :func:`find_sync_module`. Nested uses are safe.

    Usage: ``with no_sync(model, fabric): fabric.backward(loss)``
    """
    if not enabled:
        return nullcontext()
    kind = loop_kind(loop)
    if kind == "fabric":
        return loop.no_backward_sync(model, enabled=True)
    if kind == "accelerate" and find_sync_module(model) is model:
        return loop.no_sync(model)
    module = find_sync_module(model)
    if module is None:
        return nullcontext()
    if hasattr(type(module), "set_requires_gradient_sync") and not hasattr(type(module), "no_sync"):
        return _fsdp2_no_sync(module)
    return module.no_sync()


@contextmanager
def _fsdp2_no_sync(module: nn.Module) -> Iterator[None]:
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)


# ---- collectives that must wait until every rank agrees the step ran (the OOM fallback's agreement) -------------

_DEFERRED: contextvars.ContextVar[list[Callable[[], None]] | None] = contextvars.ContextVar(
    "vlmfast_deferred_collectives", default=None)


@contextmanager
def deferring() -> Iterator[list[Callable[[], None]]]:
    """Collect cross-rank work registered with :func:`after_agreement` instead of running it at once.

    Why: inside an OOM-fallback attempt a rank that ran out of memory goes straight to the agreement all-reduce,
    while its peers would be in the loss all-reduce: same sizes, different collectives, silently wrong numbers or a
    hang. The fallback runs the collected work after every rank reported success (and drops it on a retry).
    """
    pending: list[Callable[[], None]] = []
    token = _DEFERRED.set(pending)
    try:
        yield pending
    finally:
        _DEFERRED.reset(token)


def after_agreement(work: Callable[[], None]) -> None:
    """Run `work` (which issues collectives) now, or after the enclosing fallback's agreement when deferring."""
    pending = _DEFERRED.get()
    if pending is None:
        work()
    else:
        pending.append(work)


# ---- DeepSpeed's warning flood ------------------------------------------------------------------------------------

# torch deprecates the collectives DeepSpeed's ZeRO calls every step (reduce_scatter_tensor, all_gather_into_tensor,
# ...). Python shows a FutureWarning once per call site, but every warnings.catch_warnings() anywhere resets that
# memory, so ZeRO-3 printed ~6 identical lines per step (76 in 12 steps).
_DEEPSPEED_DEPRECATIONS = r"`torch\.distributed\.\w+` is deprecated"


def filter_deepspeed_warnings() -> None:
    """Silence torch's deprecation FutureWarnings for the collectives DeepSpeed calls (logged once instead).

    Usage: ``filter_deepspeed_warnings()`` before ``deepspeed.initialize`` (the DeepSpeed engine does it)."""
    warnings.filterwarnings("ignore", message=_DEEPSPEED_DEPRECATIONS, category=FutureWarning)
    _warn_once("torch's FutureWarnings for the deprecated torch.distributed collectives DeepSpeed calls every step "
               "(reduce_scatter_tensor, all_gather_into_tensor, ...) are filtered: they are DeepSpeed's to update")
