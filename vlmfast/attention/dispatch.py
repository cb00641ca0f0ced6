"""``vlmfast.attention(q, k, v, ...)``: one call that runs the active backend, or picks one with ``auto``.

The backend is, in order: the ``backend`` argument, the ``backend`` of the :class:`ScaledDotProductAttention`
module making the call (set by ``set_attention_backend``), the default set with :func:`use_attention_backend`,
else ``sdpa``. An explicitly named backend that cannot run raises :class:`AttentionBackendError` with the reason;
``auto`` walks ``flash_attn -> sdpa -> eager`` and takes the first that can run, logging once what it chose and why.

Usage::

    out = vlmfast.attention(q, k, v, causal=True)                       # [B, H, T, D] in and out
    out = vlmfast.attention(q, k, v, causal=True, position_ids=pos)     # packed rows: no cross-document attention
    with use_attention_backend("eager"):
        model(**batch)
"""

from __future__ import annotations

import contextvars
import logging
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from vlmfast.attention.backends import BACKENDS, SDPA_KERNELS, AttentionInputs, _uses_varlen
from vlmfast.attention.documents import PackedDocuments

__all__ = [
    "AUTO_ORDER",
    "BACKEND_NAMES",
    "AttentionBackendError",
    "AttentionCall",
    "ScaledDotProductAttention",
    "attention",
    "record_attention_calls",
    "resolve_backend",
    "use_attention_backend",
]

log = logging.getLogger(__name__)

BACKEND_NAMES = ("auto", *BACKENDS)
AUTO_ORDER = ("flash_attn", "sdpa", "eager")
# Packed rows at least this long on CUDA: a dense [B, T, T] mask costs more than flex's block-sparse skipping.
FLEX_PACKED_MIN_LEN = 2048

_default_backend: contextvars.ContextVar[str] = contextvars.ContextVar("vlmfast_attention_backend", default="sdpa")
# The same value as a plain global for compiled code: torch.compile cannot trace ContextVar.get (a graph break in
# every attention call); it guards on globals, so a changed default recompiles.
_compiled_default = "sdpa"
_recorders: list[list[AttentionCall]] = []
_logged_choices: set[tuple[str, str]] = set()


class AttentionBackendError(RuntimeError):
    """An explicitly requested attention backend cannot run on these inputs; the message says why."""


@dataclass(frozen=True)
class AttentionCall:
    """One call through vlmfast's attention, as recorded by :func:`record_attention_calls`."""

    backend: str  # what ran
    requested: str  # what was asked for (auto, or a backend name)
    reason: str
    shape: tuple[int, ...]
    dtype: str
    packed: bool
    sdpa_kernels: tuple[str, ...] | None


def attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    *,
    causal: bool = False,
    attn_mask: Tensor | None = None,
    position_ids: Tensor | None = None,
    cu_seqlens: Tensor | None = None,
    documents: PackedDocuments | None = None,
    dropout_p: float = 0.0,
    scale: float | None = None,
    enable_gqa: bool = False,
    backend: str | None = None,
    sdpa_kernels: Sequence[str] | None = None,
) -> Tensor:
    """Attention over ``[B, H, T, D]`` q/k/v with the active backend.

    Packed rows: pass per-document ``position_ids`` [B, T], ``cu_seqlens`` (one flattened row, B = 1) or a prebuilt
    ``documents`` (build it once per forward with ``PackedDocuments.from_position_ids`` and share it across
    layers); tokens then attend only within their own document. mRoPE ``[3, B, T]`` position ids are not packing.
    """
    inputs = AttentionInputs(causal=causal, attn_mask=attn_mask, documents=_documents(documents, position_ids,
                             cu_seqlens, q), dropout_p=dropout_p, scale=scale, enable_gqa=enable_gqa,
                             sdpa_kernels=tuple(sdpa_kernels) if sdpa_kernels else None)
    requested = backend or (_compiled_default if torch.compiler.is_compiling() else _default_backend.get())
    name, reason = resolve_backend(requested, q, inputs)
    if _recorders:
        call = AttentionCall(name, requested, reason, tuple(q.shape), str(q.dtype).removeprefix("torch."),
                             inputs.documents is not None, inputs.sdpa_kernels)
        for calls in _recorders:
            calls.append(call)
    return BACKENDS[name].run(q, k, v, inputs)


def _documents(documents: PackedDocuments | None, position_ids: Tensor | None, cu_seqlens: Tensor | None,
               q: Tensor) -> PackedDocuments | None:
    if documents is not None:
        return documents.to(q.device)
    if position_ids is None and cu_seqlens is None:
        return None
    if cu_seqlens is not None and position_ids is None and q.shape[0] != 1:
        raise ValueError(f"cu_seqlens describes one flattened row (batch 1), got batch {q.shape[0]}: "
                         "pass per-row position_ids instead")
    return _documents_cache.get(position_ids, cu_seqlens, q)


class _DocumentsCache:
    """The documents of the last ``position_ids`` / ``cu_seqlens`` tensor seen: a model whose every layer passes the
    same tensor builds them once per forward, not once per layer (the tensor's identity and version decide)."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._source: weakref.ref[Tensor] | None = None
        self._documents: PackedDocuments | None = None

    def get(self, position_ids: Tensor | None, cu_seqlens: Tensor | None, q: Tensor) -> PackedDocuments | None:
        source = position_ids if position_ids is not None else cu_seqlens
        key = (position_ids is not None, source._version, q.device, q.shape[-2])
        if self._source is not None and self._source() is source and self._key == key:
            return self._documents
        if position_ids is not None:
            documents = PackedDocuments.from_position_ids(position_ids.to(q.device))
        else:
            documents = PackedDocuments.from_cu_seqlens(cu_seqlens.to(q.device), q.shape[-2])
        if not torch.compiler.is_compiling():  # traced code keeps no Python-side cache
            self._key, self._source, self._documents = key, weakref.ref(source), documents
        return documents


_documents_cache = _DocumentsCache()


def resolve_backend(requested: str, q: Tensor, inputs: AttentionInputs) -> tuple[str, str]:
    """``(backend that will run, why)``; an explicit backend that cannot run raises with the reason."""
    if requested == "auto":
        return _auto(q, inputs)
    if requested not in BACKENDS:
        raise ValueError(f"unknown attention backend '{requested}': choose from {list(BACKEND_NAMES)}")
    reason = BACKENDS[requested].unavailable_reason(q, inputs)
    if reason is not None:
        raise AttentionBackendError(f"attention backend '{requested}' cannot run here: {reason}. Choose another "
                                    f"backend, or 'auto' to fall back in the order {' -> '.join(AUTO_ORDER)}")
    return requested, "requested"


def _auto(q: Tensor, inputs: AttentionInputs) -> tuple[str, str]:
    """The first backend of AUTO_ORDER that can run: decided once per kind of input (device, dtype, head size,
    mask, documents, dropout, kernels), not on every call (each decision probes the backends)."""
    if torch.compiler.is_compiling():  # traced: the decision is baked into the graph anyway
        return _decide_auto(q, inputs)
    mask = inputs.attn_mask
    key = (q.device.type, q.dtype, q.shape[-1], q.is_cuda and q.shape[-2] >= FLEX_PACKED_MIN_LEN,
           None if mask is None else mask.dtype, inputs.documents is not None, inputs.dropout_p > 0,
           inputs.sdpa_kernels, inputs.enable_gqa, torch.is_grad_enabled() and q.requires_grad)
    decision = _auto_decisions.get(key)
    if decision is None:
        decision = _auto_decisions[key] = _decide_auto(q, inputs)
    return decision


_auto_decisions: dict[tuple[Any, ...], tuple[str, str]] = {}


def _decide_auto(q: Tensor, inputs: AttentionInputs) -> tuple[str, str]:
    skipped = []
    for name in AUTO_ORDER:
        why_not = BACKENDS[name].unavailable_reason(q, inputs)
        if why_not is not None:
            skipped.append(f"not {name}: {why_not}")
            continue
        if name == "sdpa" and _prefer_flex(q, inputs):
            name, why = "flex", f"packed rows of {q.shape[-2]} tokens: flex skips cross-document blocks"
        else:
            why = {"flash_attn": "CUDA, fp16/bf16, head dim <= 256, flash-attn installed",
                   "sdpa": "torch's fused attention", "eager": "last resort"}[name]
        reason = "; ".join([why, *skipped])
        _log_once(name, reason)
        return name, reason
    raise AssertionError("eager attention always runs")


def _prefer_flex(q: Tensor, inputs: AttentionInputs) -> bool:
    return (inputs.documents is not None and q.is_cuda and q.shape[-2] >= FLEX_PACKED_MIN_LEN
            and not _uses_varlen(q, inputs) and BACKENDS["flex"].unavailable_reason(q, inputs) is None)


def _log_once(name: str, reason: str) -> None:
    if torch.compiler.is_compiling():  # a traced log call would break the graph; the eager call logs it
        return
    if (name, reason) not in _logged_choices:
        _logged_choices.add((name, reason))
        log.info("attention auto: %s (%s)", name, reason)


@contextmanager
def use_attention_backend(backend: str) -> Iterator[None]:
    """Default backend for ``vlmfast.attention`` calls that name none, inside the block (context-local)."""
    if backend not in BACKEND_NAMES:
        raise ValueError(f"unknown attention backend '{backend}': choose from {list(BACKEND_NAMES)}")
    global _compiled_default
    token, previous = _default_backend.set(backend), _compiled_default
    _compiled_default = backend
    try:
        yield
    finally:
        _default_backend.reset(token)
        _compiled_default = previous


@contextmanager
def record_attention_calls() -> Iterator[list[AttentionCall]]:
    """Collect an :class:`AttentionCall` for every ``vlmfast.attention`` call inside the block (which backend ran)."""
    calls: list[AttentionCall] = []
    _recorders.append(calls)
    try:
        yield calls
    finally:
        _recorders.remove(calls)


class ScaledDotProductAttention(nn.Module):
    """The attention op as a module, so ``set_attention_backend(model, ...)`` can find and switch it.

    Put one in each attention layer of your own model and call it instead of ``F.scaled_dot_product_attention``.
    Usage: ``self.attend = ScaledDotProductAttention()``; ``out = self.attend(q, k, v, causal=True)``
    """

    def __init__(self, backend: str | None = None, sdpa_kernels: Sequence[str] | None = None) -> None:
        super().__init__()
        self.backend = backend
        self.sdpa_kernels = tuple(sdpa_kernels) if sdpa_kernels else None

    def set_backend(self, backend: str | None, sdpa_kernels: Sequence[str] | None = None) -> None:
        if backend is not None and backend not in BACKEND_NAMES:
            raise ValueError(f"unknown attention backend '{backend}': choose from {list(BACKEND_NAMES)}")
        unknown = [k for k in sdpa_kernels or () if k not in SDPA_KERNELS]
        if unknown:
            raise ValueError(f"unknown SDPA kernel(s) {unknown}: choose from {list(SDPA_KERNELS)}")
        self.backend, self.sdpa_kernels = backend, tuple(sdpa_kernels) if sdpa_kernels else None

    def forward(self, q: Tensor, k: Tensor, v: Tensor, **kwargs) -> Tensor:
        kwargs.setdefault("backend", self.backend)
        kwargs.setdefault("sdpa_kernels", self.sdpa_kernels)
        return attention(q, k, v, **kwargs)

    def extra_repr(self) -> str:
        kernels = f", sdpa_kernels={list(self.sdpa_kernels)}" if self.sdpa_kernels else ""
        return f"backend={self.backend or 'default'}{kernels}"
