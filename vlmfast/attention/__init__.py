"""Attention backends behind one call, switchable per model and per tower, with packed-row (document) masks.

``vlmfast.attention`` is both this package and a function: ``vlmfast.attention(q, k, v, causal=True)`` calls
:func:`attention` (the package module is made callable), so user models need no second import path.

Usage::

    import vlmfast.attention
    out = vlmfast.attention(q, k, v, causal=True, position_ids=pos)      # [B, H, T, D], packed rows respected

    from vlmfast.attention import set_attention_backend, trace_attention_kernels
    setting = set_attention_backend(hf_or_tiny_vlm, "sdpa", vision_backend="eager")
    with trace_attention_kernels() as trace:
        model(**batch).loss.backward()
    print(setting.describe(), trace.kernels)
"""

from __future__ import annotations

import sys
import types
from typing import Any

from vlmfast.attention.backends import BACKENDS, SDPA_KERNELS, sdpa_kernel_context
from vlmfast.attention.dispatch import (
    AUTO_ORDER,
    BACKEND_NAMES,
    AttentionBackendError,
    AttentionCall,
    ScaledDotProductAttention,
    attention,
    record_attention_calls,
    use_attention_backend,
)
from vlmfast.attention.documents import PackedDocuments, is_mrope_position_ids, text_position_ids
from vlmfast.attention.models import (
    HF_IMPLEMENTATIONS,
    AttentionSetting,
    hf_attention_implementations,
    set_attention_backend,
)
from vlmfast.attention.observe import KernelTrace, trace_attention_kernels

__all__ = [
    "AUTO_ORDER",
    "BACKENDS",
    "BACKEND_NAMES",
    "HF_IMPLEMENTATIONS",
    "SDPA_KERNELS",
    "AttentionBackendError",
    "AttentionCall",
    "AttentionSetting",
    "KernelTrace",
    "PackedDocuments",
    "ScaledDotProductAttention",
    "attention",
    "hf_attention_implementations",
    "is_mrope_position_ids",
    "record_attention_calls",
    "sdpa_kernel_context",
    "set_attention_backend",
    "text_position_ids",
    "trace_attention_kernels",
    "use_attention_backend",
]


class _CallableModule(types.ModuleType):
    """Lets ``vlmfast.attention(q, k, v)`` work although ``vlmfast.attention`` is this package."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return attention(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
