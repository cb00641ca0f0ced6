"""Gradient-communication hooks for DDP: fp16/bf16 compression and PowerSGD, torch's own hooks behind one call.

The hooks themselves are torch's (``default_hooks``, ``powerSGD_hook``); this module picks one from a name,
checks the combination before DDP's first backward can fail on it, makes PowerSGD safe on gloo (one bucket at a
time), and offers a byte counter that proves which hook is installed.

Usage::

    ddp = DistributedDataParallel(model)
    state = register_comm_hook(ddp, "powersgd", rank=2, start_iter=10)  # or register_comm_hook_from_spec(ddp, spec.ddp)

    counter = count_bytes(ddp, "fp16")          # measurement only (tests, benchmarks): instead of register_comm_hook
    loss.backward(); sent = counter.take()      # bytes this rank all-reduced this step
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable
from typing import Any, Literal

import torch
import torch.distributed as dist
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from vlmfast.engines.foreign_loops import find_ddp
from vlmfast.spec import DDPSpec

log = logging.getLogger(__name__)
HookName = Literal["none", "fp16", "bf16", "powersgd", "batched_powersgd"]
WrapperName = Literal["none", "fp16", "bf16"]

_COMPRESS_HOOKS: dict[str, Callable[..., Any]] = {
    "fp16": default_hooks.fp16_compress_hook,
    "bf16": default_hooks.bf16_compress_hook,
}
_POWERSGD_HOOKS: dict[str, Callable[..., Any]] = {
    "powersgd": powerSGD_hook.powerSGD_hook,
    "batched_powersgd": powerSGD_hook.batched_powerSGD_hook,
}
_WRAPPERS: dict[str, Callable[..., Any]] = {
    "fp16": default_hooks.fp16_compress_wrapper,
    "bf16": default_hooks.bf16_compress_wrapper,
}
# Backends whose all-reduce DDP accepts bf16 hooks on (DDP refuses bf16 hooks without CUDA+NCCL or XPU+XCCL).
_BF16_BACKENDS = ("nccl", "xccl")


def register_comm_hook(
    ddp_model: DistributedDataParallel,
    hook: HookName = "powersgd",
    *,
    rank: int = 1,
    start_iter: int = 10,
    warm_start: bool = True,
    error_feedback: bool = True,
    min_compression_rate: float = 2.0,
    wrapper: WrapperName = "none",
    process_group: dist.ProcessGroup | None = None,
) -> object | None:
    """Install one of torch's comm hooks on a DDP model and return its state (``PowerSGDState`` for PowerSGD).

    `ddp_model` may be the DDP module, an Accelerate-prepared model or a Lightning Fabric model (``fabric.setup``):
    the DDP module inside is found. `process_group` is the group the hook all-reduces over (default: the DDP
    model's own). Call it once, after wrapping in DDP and before the first backward; "none" keeps DDP's built-in
    fp32 all-reduce and returns None.

    Usage: ``state = register_comm_hook(ddp, "powersgd", rank=2, start_iter=10, wrapper="fp16")``
    """
    _check_names(hook, wrapper)
    if hook == "none":
        return None
    ddp_model = _find_ddp(ddp_model, hook)
    group = process_group if process_group is not None else ddp_model.process_group
    _check_bf16_backend(ddp_model, group, hook, wrapper)
    if hook == "batched_powersgd" and not batched_powersgd_supported():
        raise ValueError(
            f"ddp.comm_hook='batched_powersgd' fails in torch {torch.__version__}: its batched_powerSGD_hook hands "
            "a single matrix to a helper that now expects a batch of them, and raises at the first compressed step. "
            "Use ddp.comm_hook: powersgd (per-layer, also more accurate)"
        )
    if hook in _COMPRESS_HOOKS:
        # For the plain compression hooks the state torch expects is the process group itself.
        ddp_model.register_comm_hook(group, _COMPRESS_HOOKS[hook])
        return group
    state = _powersgd_state(group, rank, start_iter, warm_start, error_feedback, min_compression_rate)
    _warn_powersgd_not_checkpointed(hook, start_iter, warm_start, error_feedback)
    hook_fn = _POWERSGD_HOOKS[hook]
    if wrapper != "none":
        hook_fn = _WRAPPERS[wrapper](hook_fn)
    if backend_name(group, _model_device(ddp_model)) != "nccl":
        hook_fn = one_bucket_at_a_time(hook_fn)
    ddp_model.register_comm_hook(state, hook_fn)
    return state


def register_comm_hook_from_spec(
    ddp_model: DistributedDataParallel, ddp_spec: DDPSpec, process_group: dist.ProcessGroup | None = None
) -> object | None:
    """Install the hook the spec's ``ddp`` section asks for; see :func:`register_comm_hook`.

    Usage: ``state = register_comm_hook_from_spec(ddp, spec.ddp)``
    """
    p = ddp_spec.powersgd
    return register_comm_hook(
        ddp_model, ddp_spec.comm_hook, rank=p.rank, start_iter=p.start_iter, warm_start=p.warm_start,
        error_feedback=p.error_feedback, min_compression_rate=p.min_compression_rate,
        wrapper=ddp_spec.comm_wrapper, process_group=process_group,
    )


def one_bucket_at_a_time(hook_fn: Callable[..., Any]) -> Callable[..., Any]:
    """Wrap a comm hook so a bucket's hook starts only after the previous bucket's communication has finished.

    Why: PowerSGD issues its P and Q all-reduces from future callbacks. NCCL futures complete as soon as the
    collective is queued on the stream, so those callbacks run at once on the calling thread; gloo futures complete
    on gloo's worker threads, where the callbacks race with the next bucket's all-reduce from the backward thread.
    Ranks then issue collectives in different orders and gloo aborts ("Received data size doesn't match expected
    size") or hangs. Serialising costs the overlap of communication with backward, which matters little on CPU.

    Usage: ``ddp.register_comm_hook(state, one_bucket_at_a_time(powerSGD_hook.powerSGD_hook))``
    """
    previous: list[torch.futures.Future[Any]] = []

    # functools.wraps keeps the wrapped hook's name and signature, which DDP inspects when registering.
    @functools.wraps(hook_fn)
    def serialized_hook(state: Any, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
        if previous:
            previous.pop().wait()
        future = hook_fn(state, bucket)
        previous.append(future)
        return future

    return serialized_hook


_POWERSGD_WARNED: list[bool] = []


def _warn_powersgd_not_checkpointed(hook: str, start_iter: int, warm_start: bool, error_feedback: bool) -> None:
    """Once per process: PowerSGD's state lives in the hook, outside every checkpoint.

    Why not saved: its error-feedback and warm-start tensors are keyed by DDP bucket index, and a resumed DDP
    starts with its initial buckets (rebuilt after the first step), so saved tensors would land on the wrong
    buckets. A resumed run therefore restarts compression from scratch: close to, not exactly, the run it resumes."""
    if _POWERSGD_WARNED:
        return
    _POWERSGD_WARNED.append(True)
    kept = [name for name, on in (("error feedback", error_feedback), ("warm start", warm_start)) if on]
    log.warning(
        "ddp.comm_hook=%s: PowerSGD's state (%s, its step counter) is not saved in checkpoints: a resumed run "
        "restarts PowerSGD (plain all-reduce for ddp.powersgd.start_iter=%d steps, then compression without the "
        "carried error), so it follows the uninterrupted run closely but not exactly. Use ddp.comm_hook: fp16 (no "
        "state) when bit-exact resume matters", hook, ", ".join(kept) or "no error feedback", start_iter)


def _check_names(hook: str, wrapper: str) -> None:
    hooks = ("none", *_COMPRESS_HOOKS, *_POWERSGD_HOOKS)
    if hook not in hooks:
        raise ValueError(f"ddp.comm_hook must be one of {hooks}, got {hook!r}")
    if wrapper not in ("none", *_WRAPPERS):
        raise ValueError(f"ddp.comm_wrapper must be one of ('none', 'fp16', 'bf16'), got {wrapper!r}")
    if wrapper != "none" and hook not in _POWERSGD_HOOKS:
        # A wrapper around a plain hook is either a no-op (fp16 around fp16) or the plain hook itself.
        raise ValueError(
            f"ddp.comm_wrapper={wrapper!r} only applies to PowerSGD (ddp.comm_hook: powersgd | batched_powersgd); "
            f"for plain compression set ddp.comm_hook: {wrapper} and ddp.comm_wrapper: none"
        )


def _find_ddp(model: object, hook: str) -> DistributedDataParallel:
    """The DDP module itself, or the one inside an Accelerate / Fabric / compiled model; refused otherwise."""
    ddp = find_ddp(model) if isinstance(model, torch.nn.Module) else None
    if ddp is None:
        raise TypeError(
            f"ddp.comm_hook={hook!r} needs a DistributedDataParallel model, got {type(model).__name__}: "
            "wrap the model in DDP first (comm hooks only exist for DDP; under Fabric use strategy='ddp', under "
            "Accelerate launch several processes)"
        )
    return ddp


def _check_bf16_backend(ddp_model: DistributedDataParallel, group: Any, hook: str, wrapper: str) -> None:
    field = "ddp.comm_hook" if hook == "bf16" else "ddp.comm_wrapper" if wrapper == "bf16" else None
    if field is None:
        return
    backend = backend_name(group, _model_device(ddp_model))
    if backend not in _BF16_BACKENDS:
        raise ValueError(
            f"{field}='bf16' needs the NCCL backend (CUDA) or XCCL (XPU), but gradients go over {backend!r}: DDP "
            "refuses bf16 hooks without them (even where gloo itself can all-reduce bf16). Use 'fp16', which works "
            "on gloo, or run on GPUs with NCCL"
        )


def _powersgd_state(
    group: Any, rank: int, start_iter: int, warm_start: bool, error_feedback: bool, min_compression_rate: float
) -> powerSGD_hook.PowerSGDState:
    if start_iter < 2:
        # Error feedback and warm start keep per-bucket tensors; DDP rebuilds its buckets after the first step,
        # which would leave those tensors sized for buckets that no longer exist.
        raise ValueError(
            f"ddp.powersgd.start_iter must be >= 2, got {start_iter}: DDP rebuilds its gradient buckets after the "
            "first step, so PowerSGD must run plain all-reduce until then"
        )
    if rank < 1:
        raise ValueError(f"ddp.powersgd.rank must be >= 1, got {rank}")
    if min_compression_rate <= 0:
        raise ValueError(f"ddp.powersgd.min_compression_rate must be > 0, got {min_compression_rate}")
    return powerSGD_hook.PowerSGDState(
        process_group=group, matrix_approximation_rank=rank, start_powerSGD_iter=start_iter,
        min_compression_rate=min_compression_rate, use_error_feedback=error_feedback, warm_start=warm_start,
    )


@functools.cache
def batched_powersgd_supported() -> bool:
    """Whether torch's ``batched_powerSGD_hook`` can run in this torch (checked on a tiny local tensor).

    The hook orthogonalises a single 2-D matrix with a helper that, since torch batched the per-layer PowerSGD,
    accepts only batches of matrices (3-D) and raises otherwise.

    Usage: ``hook = "batched_powersgd" if batched_powersgd_supported() else "powersgd"``
    """
    orthogonalize = getattr(powerSGD_hook, "_orthogonalize", None)
    if orthogonalize is None:  # the helper is gone: torch changed the hook, nothing known to be broken
        return True
    try:
        orthogonalize(torch.ones(4, 1))
    except (AssertionError, IndexError, RuntimeError):
        return False
    return True


def _model_device(ddp_model: DistributedDataParallel) -> torch.device:
    param = next(ddp_model.module.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def backend_name(group: Any, device: torch.device) -> str:
    """The backend that carries `device`'s tensors in `group`: "gloo", "nccl", ... (a counter: its inner group's).

    Usage: ``backend_name(ddp.process_group, torch.device("cuda"))  # -> "nccl"``
    """
    if isinstance(group, CommCounter):
        group = group.inner
    backend = str(dist.get_backend(group))
    if ":" in backend:  # one group, a backend per device: "cpu:gloo,cuda:nccl"
        per_device = dict(item.split(":", 1) for item in backend.split(","))
        return per_device.get(device.type, backend)
    return backend


class CommCounter(dist.ProcessGroup):
    """A process group that forwards all-reduces to a real one and counts the bytes this rank hands them.

    Measurement only: give it to a hook as its process group (:func:`count_bytes` does) and read the bytes per
    step. Counts are payload bytes per rank (what the hook all-reduces), not the wire traffic of the ring or tree
    algorithm underneath. Only all-reduce is forwarded: that is the one collective torch's comm hooks use.
    Hooks finish their later all-reduces (PowerSGD's P and Q) on the backend's threads, hence the lock.

    Usage: ``counter = CommCounter(ddp.process_group); register_comm_hook(ddp, "fp16", process_group=counter)``
    """

    def __init__(self, inner: dist.ProcessGroup | None = None) -> None:
        inner = inner if inner is not None else dist.group.WORLD
        if inner is None:
            raise RuntimeError("CommCounter needs an initialised process group (torch.distributed.init_process_group)")
        super().__init__(inner.rank(), inner.size())
        self.inner = inner
        self.bytes = 0
        self.calls = 0
        self._taken = 0
        self._lock = threading.Lock()

    def allreduce(self, tensors: Any, opts: Any = None) -> Any:
        """Count, then forward to the real group (``dist.all_reduce`` calls this with a tensor list)."""
        batch = tensors if isinstance(tensors, list | tuple) else [tensors]
        with self._lock:
            self.bytes += sum(t.numel() * t.element_size() for t in batch)
            self.calls += 1
        return self.inner.allreduce(tensors) if opts is None else self.inner.allreduce(tensors, opts)

    def take(self) -> int:
        """Bytes all-reduced since the last call: after ``backward()`` returns, one step's worth (DDP waits)."""
        with self._lock:
            new, self._taken = self.bytes - self._taken, self.bytes
        return new


def count_bytes(ddp_model: DistributedDataParallel, hook: HookName = "none", **options: Any) -> CommCounter:
    """Install `hook` (as :func:`register_comm_hook` would) with a :class:`CommCounter` in front; return the counter.

    "none" installs torch's ``allreduce_hook``, which sends exactly what DDP's built-in all-reduce sends, so the
    uncompressed baseline is counted too. For tests and benchmarks; training code calls register_comm_hook.

    Usage: ``counter = count_bytes(ddp, "powersgd", rank=2, start_iter=2); ...; per_step = counter.take()``
    """
    ddp_model = _find_ddp(ddp_model, hook)
    counter = CommCounter(options.pop("process_group", None) or ddp_model.process_group)
    if hook == "none":
        _check_names(hook, options.get("wrapper", "none"))
        ddp_model.register_comm_hook(counter, default_hooks.allreduce_hook)
    else:
        register_comm_hook(ddp_model, hook, process_group=counter, **options)
    return counter


__all__ = [
    "CommCounter",
    "backend_name",
    "batched_powersgd_supported",
    "count_bytes",
    "one_bucket_at_a_time",
    "register_comm_hook",
    "register_comm_hook_from_spec",
]
