"""Switch a whole model's attention: Hugging Face models per sub-model, and every vlmfast attention module.

Hugging Face models get ``attn_implementation`` through ``model.set_attn_implementation({...})`` (transformers 5),
keyed by sub-config, so a VLM's vision tower and language model may differ; the result is read back from each
config's ``_attn_implementation``, never assumed. Modules that call :class:`ScaledDotProductAttention` (the built-in
tiny VLM, or your own) get the backend set on each instance; those under a path containing ``vision`` take the
vision backend.

Usage::

    setting = set_attention_backend(model, "sdpa", vision_backend="eager", sdpa_kernels=["flash", "math"])
    print(setting.describe())                      # attention: language_model=sdpa, vision=eager ...
    with setting.context():                        # the SDPA kernel restriction, around forward passes
        loss = model(**batch).loss
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vlmfast.attention.backends import SDPA_KERNELS, flash_attn_installed, sdpa_kernel_context
from vlmfast.attention.dispatch import BACKEND_NAMES, AttentionBackendError, ScaledDotProductAttention

__all__ = ["HF_IMPLEMENTATIONS", "AttentionSetting", "hf_attention_implementations", "set_attention_backend"]

log = logging.getLogger(__name__)

# vlmfast backend -> Hugging Face attn_implementation (and back).
HF_IMPLEMENTATIONS = {"eager": "eager", "sdpa": "sdpa", "flex": "flex_attention", "flash_attn": "flash_attention_2"}
_FROM_HF = {hf: ours for ours, hf in HF_IMPLEMENTATIONS.items()}


@dataclass
class AttentionSetting:
    """What :func:`set_attention_backend` did: the backend per tower/sub-model and why."""

    backends: dict[str, str] = field(default_factory=dict)  # "vision_config" / "language_model" / ... -> backend
    reasons: dict[str, str] = field(default_factory=dict)
    sdpa_kernels: tuple[str, ...] | None = None
    switched_modules: int = 0

    def context(self) -> AbstractContextManager[Any]:
        """The SDPA kernel restriction (for code that calls SDPA directly, e.g. Hugging Face models)."""
        return sdpa_kernel_context(self.sdpa_kernels) if self.sdpa_kernels else nullcontext()

    def describe(self) -> str:
        parts = [f"{tower}={backend}" for tower, backend in self.backends.items()]
        kernels = f", SDPA kernels {list(self.sdpa_kernels)}" if self.sdpa_kernels else ""
        why = "; ".join(f"{t}: {r}" for t, r in self.reasons.items() if r != "requested")
        return f"attention: {', '.join(parts) or 'unchanged'}{kernels}" + (f" ({why})" if why else "")


def set_attention_backend(
    model: nn.Module,
    backend: str,
    vision_backend: str | None = None,
    sdpa_kernels: Sequence[str] | None = None,
    *,
    dtype: torch.dtype | None = None,
) -> AttentionSetting:
    """Set the attention backend of ``model`` (vision towers may take ``vision_backend``); returns what was set.

    ``auto`` is resolved per call for vlmfast modules, and here, once, for Hugging Face sub-models (which need a
    fixed implementation); ``dtype`` is the compute dtype when it differs from the weights' (autocast).
    """
    vision_backend = vision_backend or backend
    _check_names(backend, vision_backend, sdpa_kernels)
    device = _device_of(model)
    for name in {backend, vision_backend}:
        _check_static(name, device)
    setting = AttentionSetting(sdpa_kernels=tuple(sdpa_kernels) if sdpa_kernels else None)
    if _is_hf(model):
        _set_hf(model, backend, vision_backend, dtype, setting)
    for path, module in model.named_modules():
        if isinstance(module, ScaledDotProductAttention):
            chosen = vision_backend if "vision" in path else backend
            module.set_backend(chosen, setting.sdpa_kernels if chosen in ("sdpa", "auto") else None)
            setting.backends.setdefault("vision" if "vision" in path else "language_model", chosen)
            setting.switched_modules += 1
    if not setting.backends:
        if backend == vision_backend == "sdpa":  # the kernel restriction still applies through the context
            log.warning("no switchable attention found in %s: only the SDPA kernel restriction applies",
                        type(model).__name__)
        else:
            raise ValueError(
                f"{type(model).__name__} has no attention vlmfast can switch: use a Hugging Face model "
                "(attn_implementation), or call vlmfast.attention.ScaledDotProductAttention in your attention layers"
            )
    return setting


def hf_attention_implementations(model: nn.Module) -> dict[str, str]:
    """``{"": top-level, "<sub_config>": ...}`` as Hugging Face's configs really hold them (vlmfast names)."""
    config = model.config
    found = {"": config._attn_implementation}
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if sub is not None:
            found[key] = sub._attn_implementation
    return {key: _FROM_HF.get(value, value) for key, value in found.items()}


def _check_names(backend: str, vision_backend: str, sdpa_kernels: Sequence[str] | None) -> None:
    for name in (backend, vision_backend):
        if name not in BACKEND_NAMES:
            raise ValueError(f"unknown attention backend '{name}': choose from {list(BACKEND_NAMES)}")
    unknown = [k for k in sdpa_kernels or () if k not in SDPA_KERNELS]
    if unknown:
        raise ValueError(f"unknown SDPA kernel(s) {unknown}: choose from {list(SDPA_KERNELS)}")
    if sdpa_kernels and "sdpa" not in (backend, vision_backend):
        raise ValueError("sdpa_kernels restricts SDPA's kernels: it needs backend (or vision_backend) 'sdpa'")


def _check_static(backend: str, device: torch.device) -> None:
    """Refuse an explicit backend that cannot run on this device at all (dtype/shape are checked per call)."""
    if backend == "flash_attn" and device.type != "cuda":
        raise AttentionBackendError(f"attention backend 'flash_attn' runs on CUDA only (model is on {device}): "
                                    "use 'sdpa', or 'auto' to pick the best available")
    if backend == "flash_attn" and not flash_attn_installed():
        raise AttentionBackendError("attention backend 'flash_attn' needs the flash-attn package "
                                    "(pip install flash-attn): use 'sdpa', or 'auto' to pick the best available")


def _device_of(model: nn.Module) -> torch.device:
    tensor = next(model.parameters(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


def _is_hf(model: nn.Module) -> bool:
    return hasattr(model, "set_attn_implementation") and hasattr(model, "config")


def _set_hf(model: nn.Module, backend: str, vision_backend: str, dtype: torch.dtype | None,
            setting: AttentionSetting) -> None:
    config = model.config
    wanted: dict[str, Any] = {"": _hf_choice(model, config, backend, dtype, setting, "")}
    for key in getattr(config, "sub_configs", {}):
        sub = getattr(config, key, None)
        if sub is not None:
            chosen = vision_backend if "vision" in key else backend
            wanted[key] = _hf_choice(model, sub, chosen, dtype, setting, key)
    try:
        model.set_attn_implementation(wanted)
    except (ValueError, ImportError) as exc:
        raise AttentionBackendError(f"{type(model).__name__} refused attention {wanted}: {exc}") from exc
    for key, value in hf_attention_implementations(model).items():
        setting.backends[key or "model"] = value


def _hf_choice(model: nn.Module, config: Any, backend: str, dtype: torch.dtype | None, setting: AttentionSetting,
               key: str) -> str:
    """The HF implementation for one (sub-)config; ``auto`` decided here from device, dtype and head dim."""
    if backend != "auto":
        setting.reasons[key or "model"] = "requested"
        return HF_IMPLEMENTATIONS[backend]
    device = _device_of(model)
    dtype = dtype or next(model.parameters()).dtype
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)
    skipped = []
    if device.type != "cuda":
        skipped.append("not flash_attn: CUDA only")
    elif not flash_attn_installed():
        skipped.append("not flash_attn: not installed")
    elif dtype not in (torch.float16, torch.bfloat16):
        skipped.append(f"not flash_attn: {str(dtype).removeprefix('torch.')} compute")
    elif head_dim > 256:
        skipped.append(f"not flash_attn: head dim {head_dim} > 256")
    elif getattr(model, "_supports_flash_attn", False):
        setting.reasons[key or "model"] = "CUDA, fp16/bf16, head dim <= 256, flash-attn installed"
        return HF_IMPLEMENTATIONS["flash_attn"]
    chosen = "sdpa" if getattr(model, "_supports_sdpa", True) else "eager"
    setting.reasons[key or "model"] = "; ".join([f"{chosen} (auto)", *skipped])
    log.info("attention auto for %s: %s", key or "model", setting.reasons[key or "model"])
    return HF_IMPLEMENTATIONS[chosen]
