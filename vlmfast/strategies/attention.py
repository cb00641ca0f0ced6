"""Attention backend swap for the trainer: the ``attention`` spec section applied to the model.

The work is :func:`vlmfast.attention.set_attention_backend` (usable alone); this strategy runs it once at setup,
enters the SDPA kernel restriction around every forward pass, and reports what was chosen and why.

Usage in a hand-written loop::

    from vlmfast.attention import set_attention_backend
    setting = set_attention_backend(model, "auto", vision_backend="sdpa", sdpa_kernels=None)
    with setting.context():
        loss = model(**batch).loss
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from typing import Any

from torch import nn

from vlmfast.attention import AttentionBackendError, AttentionSetting, set_attention_backend
from vlmfast.common.utils import PRECISION_DTYPES
from vlmfast.spec import AttentionSpec
from vlmfast.strategies.base import Strategy

__all__ = ["AttentionBackend"]



class AttentionBackend(Strategy):
    """Sets the model's attention backend(s) from the spec; a backend that cannot run fails at setup."""

    name = "attention"

    def __init__(self, spec: AttentionSpec, precision: str = "fp32") -> None:
        self.spec = spec
        # autocast computes attention in this dtype
        self.dtype = PRECISION_DTYPES[precision] if precision != "fp32" else None
        self.setting: AttentionSetting | None = None

    def apply(self, model: nn.Module) -> nn.Module:
        if self.spec.backend is None:
            return model
        self._refuse_cpu_flex(model)
        try:
            self.setting = set_attention_backend(model, self.spec.backend, self.spec.vision_backend,
                                                 self.spec.sdpa_kernels, dtype=self.dtype)
        except AttentionBackendError as exc:  # name the spec field the user set, not only the backend
            named = [f"attention.{field} '{value}'" for field in ("backend", "vision_backend")
                     if (value := getattr(self.spec, field)) and f"'{value}'" in str(exc)]
            raise AttentionBackendError(f"{' and '.join(named) or 'attention.backend'}: {exc}") from exc
        return model

    def _refuse_cpu_flex(self, model: nn.Module) -> None:
        parameter = next(model.parameters(), None)
        on_cpu = parameter is None or parameter.device.type == "cpu"
        if on_cpu and "flex" in (self.spec.backend, self.spec.vision_backend):
            raise AttentionBackendError("attention backend 'flex' cannot train on CPU: torch's flex_attention has no "
                                        "CPU backward. Use attention.backend: sdpa (or eager) on CPU")

    def forward_context(self) -> AbstractContextManager[Any]:
        return self.setting.context() if self.setting is not None else nullcontext()

    def describe(self) -> str:
        return self.setting.describe() if self.setting is not None else "attention: unchanged"
