"""Count host-device synchronisations of a training step, on any machine, CPU included.

A GPU step is fast when the host never waits for the device: every ``.item()``, ``.tolist()``, ``bool(tensor)``,
``nonzero``, copy to the host or ``torch.tensor(python_values, device=cuda)`` makes the CPU wait until the GPU has
finished all queued work, so the next kernels are launched late. Such reads hide easily (a ``bool`` on a mask, an
``int(labels.sum())``) and cost nothing visible on a CPU test machine. This module makes them countable there.

How, on CPU: values that would live on the accelerator are *tagged*: the parameters, buffers, gradients and optimizer
states of the objects you pass, every tensor moved with ``.to(device)`` / ``.cuda()`` (the moved copy, never the host
original: on CPU ``.to("cpu")`` would alias, so a copy is made), every tensor a factory creates with an explicit
``device=`` argument, and everything computed from a tagged tensor (a ``TorchDispatchMode`` follows each op). A read
of a tagged value on the host is one sync. On CUDA nothing needs tagging: a tensor on the GPU is a device value; and
``torch.cuda.set_sync_debug_mode("warn")`` is switched on too, so syncs inside torch's own kernels are counted
(:attr:`HostSyncs.cuda_warnings`).

What counts as a read (one event each, with where it happened): ``_local_scalar_dense`` (``.item()``, ``float()``,
``int()``, ``bool()``, formatting), ``.tolist()``, ``.numpy()``, ``.cpu()``, ``nonzero``,
``masked_select``, boolean-mask indexing, ``unique``, ``repeat_interleave`` without ``output_size``, ``equal``,
``allclose``, ``bincount``, and ``torch.tensor(values, device=accelerator)`` (a blocking copy from pageable memory);
on CUDA also ``.to("cpu")`` and copies into host tensors. A non-blocking copy to the host is not a sync but a race
until the host waits; it is listed apart (:attr:`HostSyncs.async_host_copies`).

Limits on CPU: ``.to("cpu")`` of a device value cannot be told from a move to the accelerator when the accelerator *is*
the CPU, so it is treated as a no-op (use ``.cpu()`` for host copies); code that branches on ``device.type == "cuda"``
(stream waits, ``torch.cuda.synchronize``) only shows on CUDA. Threads started inside the block are followed (the
prefetch thread); processes are not (DataLoader workers only see host data anyway).

Usage::

    with count_host_syncs(model) as syncs:
        OptimizedTrainer(model, data, spec, callbacks=[syncs]).fit()   # as a callback it marks step boundaries
    print(syncs.per_step, syncs.report())
    assert max(syncs.per_step[1:]) <= 1, syncs.report()
"""

from __future__ import annotations

import contextlib
import sys
import threading
import warnings
from collections import Counter
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["HostSync", "HostSyncs", "count_host_syncs"]

aten = torch.ops.aten
_CUDA_SYNC_WARNING = "called a synchronizing CUDA operation"  # c10/cuda/CUDAFunctions.cpp, warn_or_error_on_sync

# Ops whose result size or value the host must know: on CUDA each one waits for the device.
_READ_OPS = {
    aten._local_scalar_dense.default: "item/float/int/bool",
    aten.nonzero.default: "nonzero",
    aten.masked_select.default: "masked_select",
    aten.equal.default: "equal",
    aten.allclose.default: "allclose",
    aten.bincount.default: "bincount",
    aten._unique.default: "unique",
    aten._unique2.default: "unique",
    aten.unique_dim.default: "unique",
    aten.unique_consecutive.default: "unique",
    aten.is_nonzero.default: "bool",
}
_BOOL_INDEX_OPS = {aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default}
_REPEAT_INTERLEAVE = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
# Tensor methods that hand a device value to the host and never reach the dispatcher on CPU.
_HOST_METHODS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy", torch.Tensor.cpu: "cpu"}
# Factories that copy Python values into a new tensor: with device=<accelerator> a blocking host-to-device copy.
_FROM_HOST_VALUES = {torch.tensor, torch.as_tensor, torch.scalar_tensor}
_COUNTED_READ = threading.local()  # .active while a host method counted as one read runs (its ops are that read)
_SKIP_FRAMES = (str(Path(torch.__file__).parent), __file__, contextlib.__file__, threading.__file__, warnings.__file__)


@dataclass(frozen=True)
class HostSync:
    """One read of a device value on the host: what, where (first frame outside torch), in which step and thread."""

    kind: str
    where: str
    step: int
    thread: str

    def __str__(self) -> str:
        return f"step {self.step}: {self.kind} at {self.where} ({self.thread})"


@dataclass
class HostSyncs:
    """What :func:`count_host_syncs` saw. Pass it in ``callbacks=`` and each ``on_step_end`` closes a step."""

    device: torch.device
    events: list[HostSync] = field(default_factory=list)
    async_host_copies: list[HostSync] = field(default_factory=list)
    torch_syncs: list[HostSync] = field(default_factory=list)  # what set_sync_debug_mode reported (CUDA only)
    step: int = 0  # steps closed so far; events belong to step `step + 1` until the next boundary

    def __post_init__(self) -> None:
        self._lock = threading.Lock()
        self.active = True

    def __getstate__(self) -> dict[str, Any]:  # picklable (sent back from spawned ranks): without the lock
        return {k: v for k, v in self.__dict__.items() if k != "_lock"}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def count(self) -> int:
        """All host reads of device values seen so far."""
        return len(self.events)

    @property
    def per_step(self) -> list[int]:
        """Host reads per closed step (the reads before the first boundary belong to step 1)."""
        return self._per_step(self.events)

    @property
    def cuda_warnings(self) -> int:
        """Syncs that ``torch.cuda.set_sync_debug_mode`` reported, torch's own kernels' included (CUDA only)."""
        return len(self.torch_syncs)

    @property
    def torch_per_step(self) -> list[int]:
        """Syncs per closed step as torch's sync debug mode saw them (CUDA only; zeros elsewhere)."""
        return self._per_step(self.torch_syncs)

    def _per_step(self, events: list[HostSync]) -> list[int]:
        counts = Counter(e.step for e in events)
        return [counts.get(step, 0) for step in range(1, self.step + 1)]

    def mark_step(self) -> None:
        """Close the current step (the trainer callback does it for you)."""
        self.step += 1

    def on_step_end(self, trainer: Any, metrics: dict[str, Any]) -> None:
        self.mark_step()

    def report(self, steps: Iterable[int] | None = None) -> str:
        """Each distinct read with its count, most frequent first (optionally only for some steps)."""
        wanted = set(steps) if steps is not None else None
        chosen = [e for e in self.events if wanted is None or e.step in wanted]
        counts = Counter((e.kind, e.where, e.thread) for e in chosen)
        lines = [f"{n} x {kind} at {where}" + ("" if thread == "main" else f" ({thread} thread)")
                 for (kind, where, thread), n in counts.most_common()]
        head = f"{len(chosen)} host read(s) of device values over {self.step} step(s): {self.per_step}"
        torch_chosen = [e for e in self.torch_syncs if wanted is None or e.step in wanted]
        if torch_chosen:
            head += f"; torch.cuda.set_sync_debug_mode reported {len(torch_chosen)}: {self.torch_per_step}"
            torch_counts = Counter(e.where for e in torch_chosen)
            lines += [f"{n} x torch sync at {where}" for where, n in torch_counts.most_common()]
        return "\n".join([head, *("  " + line for line in lines)])

    def _record(self, kind: str, blocking: bool = True) -> None:
        event = HostSync(kind, _caller(), self.step + 1, _thread_name())
        with self._lock:
            (self.events if blocking else self.async_host_copies).append(event)


def _thread_name() -> str:
    thread = threading.current_thread()
    return "main" if thread is threading.main_thread() else thread.name


def _caller() -> str:
    """``file:line in function`` of the innermost frame outside torch and this module."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(_SKIP_FRAMES):
        frame = frame.f_back
    if frame is None:
        return "?"
    return f"{_short_path(frame.f_code.co_filename)}:{frame.f_lineno} in {frame.f_code.co_name}"


def _short_path(filename: str) -> str:
    """deepspeed/runtime/utils.py for a library, vlmfast/... for ours, else the file's name."""
    parts = Path(filename).parts
    if "site-packages" in parts:
        parts = parts[parts.index("site-packages") + 1:]
    elif "vlmfast" in parts[:-1]:
        parts = parts[len(parts) - 1 - parts[::-1].index("vlmfast"):]
    else:
        parts = parts[-1:]
    return "/".join(parts)


class _Tags:
    """Which tensors hold device values: their storages (so views and ``param.data`` aliases count too).

    Keys are StorageImpl addresses; each entry keeps a weak reference to its storage, which keeps the address from
    being reused by a new storage while the entry exists (no false tags). Tensors without a storage (wrapper
    subclasses such as DTensor) are tagged by object and through their inner tensors.
    """

    def __init__(self, device: torch.device) -> None:
        from torch.multiprocessing.reductions import StorageWeakRef

        self._weak = StorageWeakRef
        self.device = device
        self.by_storage: dict[int, Any] = {}
        self.by_object: WeakIdKeyDictionary = WeakIdKeyDictionary()
        self._lock = threading.Lock()

    def is_device(self, tensor: torch.Tensor) -> bool:
        if tensor.device.type not in ("cpu", "meta"):  # a real accelerator tensor: no tag needed
            return tensor.device.type == self.device.type
        if self.device.type != "cpu":  # the accelerator is real, and this tensor is on the host
            return False
        inner = _inner_tensors(tensor)
        if inner is not None:
            return tensor in self.by_object or any(self.is_device(t) for t in inner)
        cdata = _storage_key(tensor)
        return cdata is not None and cdata in self.by_storage

    def untag(self, tensor: torch.Tensor) -> None:
        with self._lock:
            self.by_storage.pop(_storage_key(tensor), None)

    def tag(self, tensor: torch.Tensor) -> None:
        if self.device.type != "cpu" or tensor.device.type != "cpu":
            return
        inner = _inner_tensors(tensor)
        if inner is not None:
            self.by_object[tensor] = True
            for t in inner:
                self.tag(t)
            return
        cdata = _storage_key(tensor)
        if cdata is None or cdata in self.by_storage:
            return
        with self._lock:
            self.by_storage[cdata] = self._weak(tensor.untyped_storage())
            if len(self.by_storage) % 4096 == 0:  # drop the entries of freed storages now and then
                self.by_storage = {k: v for k, v in self.by_storage.items() if not v.expired()}


def _inner_tensors(tensor: torch.Tensor) -> list[torch.Tensor] | None:
    """The tensors inside a wrapper subclass (DTensor's local shard, ...), None for a plain tensor."""
    if type(tensor) in (torch.Tensor, nn.Parameter) or not hasattr(tensor, "__tensor_flatten__"):
        return None
    names, _ = tensor.__tensor_flatten__()
    return [inner for inner in (getattr(tensor, name, None) for name in names) if isinstance(inner, torch.Tensor)]


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError):  # no storage (a functional or fake tensor)
        return None


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in nested tuples / lists / dicts of op arguments or outputs (cheaper than a pytree flatten)."""
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, (tuple, list)):
        return [t for item in tree for t in _tensors(item)]
    if isinstance(tree, dict):
        return [t for item in tree.values() for t in _tensors(item)]
    return []


class _DispatchCounter(TorchDispatchMode):
    """Follows device values through every op; counts ops that make the host read them."""

    def __init__(self, syncs: HostSyncs, tags: _Tags) -> None:
        super().__init__()
        self.syncs, self.tags = syncs, tags

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.syncs.active:
            return func(*args, **kwargs)
        inputs = _tensors((args, kwargs))
        on_device = [self.tags.is_device(t) for t in inputs]
        if any(on_device) and not getattr(_COUNTED_READ, "active", False):
            self._count(func, args, kwargs, inputs)
        out = func(*args, **kwargs)
        if any(on_device):  # what is computed from a device value is one too (for copy_: the destination)
            for tensor in _tensors(out):
                self.tags.tag(tensor)
        return out

    def _count(self, func: Any, args: tuple, kwargs: dict, inputs: list[torch.Tensor]) -> None:
        packet = func.overloadpacket
        if func in _READ_OPS:
            self.syncs._record(_READ_OPS[func])
        elif func in _BOOL_INDEX_OPS and any(t.dtype in (torch.bool, torch.uint8) for t in _tensors(args[1])):
            self.syncs._record("boolean-mask indexing (nonzero)")
        elif func in _REPEAT_INTERLEAVE and kwargs.get("output_size") is None:
            self.syncs._record("repeat_interleave without output_size")
        elif self.tags.device.type != "cpu":  # a real accelerator: the host side of a copy is known
            self._count_host_copy(packet, args, kwargs, inputs)

    def _count_host_copy(self, packet: Any, args: tuple, kwargs: dict, inputs: list[torch.Tensor]) -> None:
        # On CPU (the accelerator simulated) a copy's direction is unknown: the destination is tagged instead.
        if packet is aten.copy_ and args[0].device.type == "cpu" and self.tags.is_device(args[1]):
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            self.syncs._record("copy to a host tensor", blocking=not non_blocking)
        elif packet is aten._to_copy and torch.device(kwargs.get("device") or inputs[0].device).type == "cpu":
            self.syncs._record("copy to the host", blocking=not kwargs.get("non_blocking", False))


class _FunctionCounter(TorchFunctionMode):
    """The reads and moves that never reach the dispatcher on CPU: ``.tolist()``, ``.to(device)``, factories."""

    def __init__(self, syncs: HostSyncs, tags: _Tags) -> None:
        super().__init__()
        self.syncs, self.tags = syncs, tags

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.syncs.active:
            return func(*args, **kwargs)
        if func in _HOST_METHODS and self.tags.is_device(args[0]):
            self.syncs._record(_HOST_METHODS[func])
            _COUNTED_READ.active = True  # on CUDA .tolist() dispatches its copy to the host: one read, not two
            try:
                out = func(*args, **kwargs)
            finally:
                _COUNTED_READ.active = False
            if out is args[0]:  # .cpu() on the CPU aliases; the host copy it stands for is a host value
                out = out.clone()
                self.tags.untag(out)
            return out
        if func is torch.Tensor.to:
            return self._move(func, args, kwargs)
        explicit_device = kwargs.get("device")
        out = func(*args, **kwargs)
        if explicit_device is not None and self._is_accelerator(explicit_device):
            if func in _FROM_HOST_VALUES and not (args and isinstance(args[0], torch.Tensor)):
                self.syncs._record(f"torch.{func.__name__}(host values, device=...)")
            for tensor in _tensors(out):
                self.tags.tag(tensor)
        return out

    def _is_accelerator(self, device: Any) -> bool:
        return torch.device(device).type == self.tags.device.type

    def _move(self, func: Any, args: tuple, kwargs: dict) -> Any:
        tensor = args[0]
        target = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})[0]
        out = func(*args, **kwargs)
        if target is None or self.tags.device.type != "cpu" or not self._is_accelerator(target):
            return out  # a dtype change (followed by dispatch), or a real device: nothing to simulate
        if self.tags.is_device(tensor):
            return out  # already on the device: a no-op, as on a GPU
        if out is tensor:  # the CPU aliases; a GPU would copy, and the host original must stay untagged
            with torch._C.DisableTorchFunctionSubclass():
                out = tensor.clone()
        self.tags.tag(out)
        return out


@contextlib.contextmanager
def count_host_syncs(
    *roots: nn.Module | torch.Tensor | torch.optim.Optimizer,
    device: torch.device | str | None = None,
    cuda_sync_debug: bool = True,
) -> Iterator[HostSyncs]:
    """Count host reads of device values inside the block; see the module docstring for what counts.

    ``roots``: modules, tensors or optimizers whose tensors are device values from the start (a model moved with
    ``.to(device)`` inside the block is tagged by the move itself). ``device``: the accelerator; default: the device
    of the first root parameter, else CUDA when available, else the CPU (which then plays the accelerator).
    Usage: ``with count_host_syncs(model) as syncs: train(); print(syncs.report())``
    """
    device = torch.device(device) if device is not None else _default_device(roots)
    syncs, tags = HostSyncs(device), _Tags(device)
    for tensor in _root_tensors(roots):
        tags.tag(tensor)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_follow_threads(syncs, tags))
        if device.type == "cuda" and cuda_sync_debug:
            stack.enter_context(_cuda_sync_debug(syncs))
        stack.enter_context(_FunctionCounter(syncs, tags))
        stack.enter_context(_DispatchCounter(syncs, tags))
        try:
            yield syncs
        finally:
            syncs.active = False


def _default_device(roots: tuple[Any, ...]) -> torch.device:
    for tensor in _root_tensors(roots):
        return tensor.device
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def _root_tensors(roots: Iterable[Any]) -> Iterator[torch.Tensor]:
    for root in roots:
        if isinstance(root, nn.Module):
            yield from root.parameters()
            yield from root.buffers()
            yield from (p.grad for p in root.parameters() if p.grad is not None)
        elif isinstance(root, torch.optim.Optimizer):
            yield from _tensors(root.state_dict()["state"])
            yield from (p for group in root.param_groups for p in group["params"])
        elif isinstance(root, torch.Tensor):
            yield root
        else:
            raise TypeError(f"count_host_syncs: cannot tag a {type(root).__name__}: pass modules, tensors or "
                            "optimizers")


@contextlib.contextmanager
def _follow_threads(syncs: HostSyncs, tags: _Tags) -> Iterator[None]:
    """Threads started inside the block count too (a prefetch thread moves batches and may read them)."""
    original = threading.Thread.run

    def run(thread: threading.Thread) -> None:
        with _FunctionCounter(syncs, tags), _DispatchCounter(syncs, tags):  # modes are per thread: new instances
            original(thread)

    threading.Thread.run = run  # type: ignore[method-assign]
    try:
        yield
    finally:
        threading.Thread.run = original  # type: ignore[method-assign]


@contextlib.contextmanager
def _cuda_sync_debug(syncs: HostSyncs) -> Iterator[None]:
    """torch.cuda.set_sync_debug_mode("warn") for the block; each of its warnings is recorded in the step it happened
    in, with the first frame outside torch that led to it; other warnings are passed on."""
    previous = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        passed_on = warnings.showwarning

        def record(message: Any, category: Any, filename: str, lineno: int, *args: Any, **kwargs: Any) -> None:
            if _CUDA_SYNC_WARNING not in str(message):
                passed_on(message, category, filename, lineno, *args, **kwargs)
                return
            event = HostSync("torch sync", _caller(), syncs.step + 1, _thread_name())
            with syncs._lock:
                syncs.torch_syncs.append(event)

        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
