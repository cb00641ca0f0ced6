"""The attention backends: one function each, same arguments, same ``[B, H, T, D]`` layout in and out.

Each backend also says, before it runs, why it cannot run on given inputs (``unavailable_reason``), so the
dispatcher can fall back in a fixed order with a logged reason, or refuse an explicit request with a clear error.

- ``eager``: matmul + softmax in float32, the reference every other backend is tested against.
- ``sdpa``: ``F.scaled_dot_product_attention``; packed rows run one call per document on CPU (cost sum(l_i^2)),
  torch's own ``varlen_attn`` on CUDA in fp16/bf16 where torch has it, else a block-diagonal mask.
- ``flex``: ``flex_attention`` with a ``BlockMask`` that skips cross-document blocks (compiled on CUDA; torch has
  no CPU backward for it).
- ``flash_attn``: the flash-attn package (CUDA, fp16/bf16, head dim <= 256); packed rows use its varlen kernel.

Usage::

    out = BACKENDS["sdpa"].run(q, k, v, AttentionInputs(causal=True))
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vlmfast.attention.documents import PackedDocuments, block_mask_for

__all__ = ["BACKENDS", "SDPA_KERNELS", "AttentionInputs", "Backend"]

# Spec names of torch's SDPA kernels.
SDPA_KERNELS = ("flash", "efficient", "cudnn", "math")
_LOW_PRECISION = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class AttentionInputs:
    """Everything besides q, k, v that decides what attention computes."""

    causal: bool = False
    attn_mask: Tensor | None = None  # bool (True = attend) or additive float, broadcastable to [B, H, Tq, Tk]
    documents: PackedDocuments | None = None
    dropout_p: float = 0.0
    scale: float | None = None
    enable_gqa: bool = False
    sdpa_kernels: tuple[str, ...] | None = None


@dataclass(frozen=True)
class Backend:
    """A named attention implementation and the check that says when it cannot run."""

    name: str
    run: Callable[[Tensor, Tensor, Tensor, AttentionInputs], Tensor]
    unavailable_reason: Callable[[Tensor, AttentionInputs], str | None]


# ---------------------------------------------------------------------------------------------------- masks


def combined_mask(inputs: AttentionInputs, q_len: int, k_len: int, device: torch.device) -> Tensor | None:
    """One mask for causal + documents + the user's mask (bool, or float when the user's is additive)."""
    mask = inputs.documents.dense_mask(inputs.causal) if inputs.documents is not None else None
    if mask is None and inputs.causal and inputs.attn_mask is not None:
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril()  # SDPA's top-left causal
    user = inputs.attn_mask
    if user is None:
        return mask
    if mask is None:
        return user
    if user.dtype == torch.bool:
        return mask & user
    return torch.where(mask, user, torch.full((), float("-inf"), dtype=user.dtype, device=user.device))


def _repeat_kv(k: Tensor, v: Tensor, q_heads: int) -> tuple[Tensor, Tensor]:
    groups = q_heads // k.shape[1]
    return k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)


# ---------------------------------------------------------------------------------------------------- eager


def eager_attention(q: Tensor, k: Tensor, v: Tensor, inputs: AttentionInputs) -> Tensor:
    """Reference attention: ``softmax(q k^T * scale + mask) v`` with the softmax in float32."""
    if inputs.enable_gqa and k.shape[1] != q.shape[1]:
        k, v = _repeat_kv(k, v, q.shape[1])
    scale = inputs.scale if inputs.scale is not None else 1.0 / math.sqrt(q.shape[-1])
    scores = torch.matmul(q, k.transpose(-2, -1)) * scale
    mask = combined_mask(inputs, q.shape[-2], k.shape[-2], q.device)
    if mask is None and inputs.causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    if inputs.dropout_p > 0:
        probs = F.dropout(probs, p=inputs.dropout_p)
    return torch.matmul(probs, v)


def _always(q: Tensor, inputs: AttentionInputs) -> str | None:
    return None


# ---------------------------------------------------------------------------------------------------- sdpa


def _varlen_attn() -> Callable[..., Tensor] | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _uses_varlen(q: Tensor, inputs: AttentionInputs) -> bool:
    """torch's varlen kernel for packed rows: CUDA, fp16/bf16, no other mask, no dropout, flash allowed."""
    return (inputs.documents is not None and q.is_cuda and q.dtype in _LOW_PRECISION and inputs.attn_mask is None
            and inputs.dropout_p == 0 and inputs.sdpa_kernels in (None, ("flash",)) and _varlen_attn() is not None)


def sdpa_attention(q: Tensor, k: Tensor, v: Tensor, inputs: AttentionInputs) -> Tensor:
    """``F.scaled_dot_product_attention``, restricted to ``inputs.sdpa_kernels`` when given."""
    if _uses_varlen(q, inputs):
        return _torch_varlen(q, k, v, inputs)
    if inputs.documents is not None and not q.is_cuda and inputs.attn_mask is None:
        return _sdpa_per_document(q, k, v, inputs)
    mask = combined_mask(inputs, q.shape[-2], k.shape[-2], q.device)
    call = functools.partial(F.scaled_dot_product_attention, q, k, v, attn_mask=mask, dropout_p=inputs.dropout_p,
                             is_causal=inputs.causal and mask is None, scale=inputs.scale)
    gqa = {"enable_gqa": True} if inputs.enable_gqa else {}
    if inputs.sdpa_kernels is None:
        return call(**gqa)
    with sdpa_kernel_context(inputs.sdpa_kernels):
        return call(**gqa)


def _sdpa_per_document(q: Tensor, k: Tensor, v: Tensor, inputs: AttentionInputs) -> Tensor:
    """Varlen attention off the GPU: one SDPA call per document, so cost is sum(l_i^2), not rows x T^2."""
    b, h, t, _ = q.shape
    flat = [x.transpose(0, 1).reshape(x.shape[1], b * t, x.shape[-1]) for x in (q, k, v)]  # [H, B*T, D]
    gqa = {"enable_gqa": True} if inputs.enable_gqa else {}
    with sdpa_kernel_context(inputs.sdpa_kernels) if inputs.sdpa_kernels else contextlib.nullcontext():
        pieces = [F.scaled_dot_product_attention(*(x[None, :, start:end] for x in flat), dropout_p=inputs.dropout_p,
                                                 is_causal=inputs.causal, scale=inputs.scale, **gqa)[0]
                  for start, end in inputs.documents.spans()]
    return torch.cat(pieces, dim=1).reshape(h, b, t, v.shape[-1]).transpose(0, 1)


def _torch_varlen(q: Tensor, k: Tensor, v: Tensor, inputs: AttentionInputs) -> Tensor:
    cu, max_len = inputs.documents.cu_seqlens()
    b, h, t, d = q.shape
    varlen_attn = _varlen_attn()
    takes = _keywords(varlen_attn)  # torch/nn/attention/varlen.py: 2.10 is_causal; 2.11 scale, window_size; later
    if inputs.scale is not None and "scale" not in takes:  # enable_gqa. 2.10 fixes the scale at 1/sqrt(d)
        q = q * (inputs.scale * d**0.5)
    flat = [x.transpose(1, 2).reshape(b * t, x.shape[1], x.shape[-1]) for x in (q, k, v)]  # [B*T, H, D]
    options: dict[str, Any] = {"scale": inputs.scale} if "scale" in takes else {}
    if "window_size" in takes:  # torch >= 2.11: causal is the window (-1, 0)
        options["window_size"] = (-1, 0) if inputs.causal else (-1, -1)
    else:
        options["is_causal"] = inputs.causal
    if k.shape[1] != h:  # grouped-query attention
        if "enable_gqa" in takes:
            options["enable_gqa"] = True
        else:  # no enable_gqa (torch <= 2.11): repeat each K/V head for its query heads (HF's repeat_kv order)
            flat[1:] = [x.repeat_interleave(h // x.shape[1], dim=1) for x in flat[1:]]
    out = varlen_attn(*flat, cu, cu, max_len, max_len, **options)
    return out.reshape(b, t, h, v.shape[-1]).transpose(1, 2)


@functools.cache
def _keywords(function: Callable[..., Tensor]) -> frozenset[str]:
    """The parameter names of `function` (this torch's varlen_attn), read once."""
    return frozenset(inspect.signature(function).parameters)


def sdpa_kernel_context(kernels: tuple[str, ...] | list[str]) -> Any:
    """``torch.nn.attention.sdpa_kernel`` from spec names (flash / efficient / cudnn / math)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    names = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION,
             "cudnn": SDPBackend.CUDNN_ATTENTION, "math": SDPBackend.MATH}
    unknown = [k for k in kernels if k not in names]
    if unknown:
        raise ValueError(f"unknown SDPA kernel(s) {unknown}: choose from {list(SDPA_KERNELS)}")
    return sdpa_kernel([names[k] for k in kernels])


def _sdpa_reason(q: Tensor, inputs: AttentionInputs) -> str | None:
    kernels = inputs.sdpa_kernels
    if not kernels:
        return None
    if not q.is_cuda:
        if set(kernels) <= {"efficient", "cudnn"}:
            return f"SDPA kernels {list(kernels)} exist only on CUDA; on CPU allow 'flash' or 'math'"
        return None
    refusals = {k: _cuda_kernel_refusal(k, q, inputs) for k in kernels}
    if all(refusals.values()):  # torch would only say "No available kernel. Aborting execution."
        why = "; ".join(f"{k}: {reason}" for k, reason in refusals.items())
        return (f"attention.sdpa_kernels {list(kernels)}: no allowed kernel can run these inputs ({why}). Allow "
                "'efficient' or 'math' as well, or use precision bf16/fp16 (and no dense mask) for 'flash'/'cudnn'")
    return None


def _cuda_kernel_refusal(kernel: str, q: Tensor, inputs: AttentionInputs) -> str | None:
    """Why torch's CUDA SDPA would refuse `kernel` for these inputs (the checks in aten/src/ATen/native/transformers/
    cuda/sdp_utils.cpp: can_use_flash_attention = check_for_attn_mask + check_head_dim_size_flash +
    check_dtypes_low_precision; can_use_cudnn_attention = check_dtypes_low_precision + shapes; efficient takes fp32
    and masks). Only what is certain from the inputs; hardware and layout checks are left to torch."""
    dense_mask = inputs.attn_mask is not None or (inputs.documents is not None and not _uses_varlen(q, inputs))
    low = q.dtype in _LOW_PRECISION
    dtype = str(q.dtype).removeprefix("torch.")
    if kernel == "flash":
        if not low:
            return f"needs fp16/bf16 inputs, got {dtype}"
        if dense_mask:
            return "takes no dense attention mask" + (" (packed documents need one here)" if inputs.attn_mask is None
                                                      else "")
        if q.shape[-1] > 256:
            return f"head dim {q.shape[-1]} > 256"
    if kernel == "cudnn" and not low:
        return f"needs fp16/bf16 inputs, got {dtype}"
    if kernel == "efficient" and q.dtype not in (*_LOW_PRECISION, torch.float32):
        return f"needs fp16/bf16/fp32 inputs, got {dtype}"
    return None


# ---------------------------------------------------------------------------------------------------- flex


@functools.cache
def _compiled_flex() -> Callable[..., Tensor]:
    """flex_attention compiled once for all shapes. ``dynamic=False`` compiled a graph per sequence length and, past
    dynamo's recompile limit, silently ran the unfused path that materialises the scores; ``dynamic=None`` (automatic
    dynamic) recompiles once when a size changes, with that size symbolic from then on."""
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=None)


def flex_attention(q: Tensor, k: Tensor, v: Tensor, inputs: AttentionInputs) -> Tensor:
    """``flex_attention`` with a ``BlockMask`` for causal / documents / a boolean user mask."""
    from torch.nn.attention.flex_attention import flex_attention as eager_flex

    b, _, t, _ = q.shape
    if inputs.attn_mask is not None:  # rare path: fold the user's boolean mask into a fresh BlockMask
        user = inputs.attn_mask.expand(b, 1, t, k.shape[-2])
        docs = inputs.documents

        def mask_mod(bi: Tensor, h: Tensor, qi: Tensor, ki: Tensor) -> Tensor:
            allowed = user[bi, 0, qi, ki]
            if docs is not None:
                allowed = allowed & (docs.ids[bi, qi] == docs.ids[bi, ki])
            return allowed & (qi >= ki) if inputs.causal else allowed

        block_mask = block_mask_for(mask_mod, b, t, k.shape[-2], q.device)
    elif inputs.documents is not None:
        block_mask = inputs.documents.block_mask(inputs.causal)
    elif inputs.causal:
        block_mask = _causal_block_mask(t, k.shape[-2], str(q.device))
    else:
        block_mask = None
    run = _compiled_flex() if q.is_cuda else eager_flex  # uncompiled flex materialises scores: fine off the GPU
    if not q.is_cuda and not torch.is_grad_enabled():  # torch refuses CPU inputs that require grad, even here
        q, k, v = q.detach(), k.detach(), v.detach()
    return run(q, k, v, block_mask=block_mask, scale=inputs.scale, enable_gqa=inputs.enable_gqa)


@functools.lru_cache(maxsize=16)
def _causal_block_mask(q_len: int, k_len: int, device: str) -> Any:
    return block_mask_for(lambda b, h, q, kv: q >= kv, None, q_len, k_len, device)


def _flex_reason(q: Tensor, inputs: AttentionInputs) -> str | None:
    try:
        import torch.nn.attention.flex_attention
    except ImportError:
        return f"torch {torch.__version__} has no flex_attention"
    if not q.is_cuda and torch.is_grad_enabled() and q.requires_grad:
        return "torch's flex_attention has no backward on CPU (forward-only there)"
    if inputs.dropout_p > 0:
        return "flex_attention has no dropout"
    if inputs.attn_mask is not None and inputs.attn_mask.dtype != torch.bool:
        return "flex here takes boolean masks only (got an additive float mask)"
    return None


# ---------------------------------------------------------------------------------------------------- flash-attn


@functools.cache
def flash_attn_installed() -> bool:
    """Whether the flash-attn package can be imported (looked up once: ~0.1 ms a call was paid per attention call)."""
    return importlib.util.find_spec("flash_attn") is not None


def flash_attn_attention(q: Tensor, k: Tensor, v: Tensor, inputs: AttentionInputs) -> Tensor:
    """The flash-attn package: ``flash_attn_func``, or ``flash_attn_varlen_func`` for packed rows."""
    import flash_attn

    b, h, t, d = q.shape
    q_, k_, v_ = (x.transpose(1, 2) for x in (q, k, v))  # flash-attn wants [B, T, H, D]
    dropout = inputs.dropout_p
    if inputs.documents is None:
        out = flash_attn.flash_attn_func(q_, k_, v_, dropout, softmax_scale=inputs.scale, causal=inputs.causal)
        return out.transpose(1, 2)
    cu, max_len = inputs.documents.cu_seqlens()
    flat = [x.reshape(b * t, x.shape[2], d) for x in (q_, k_, v_)]
    out = flash_attn.flash_attn_varlen_func(*flat, cu, cu, max_len, max_len, dropout, softmax_scale=inputs.scale,
                                            causal=inputs.causal)
    return out.reshape(b, t, h, d).transpose(1, 2)


def _flash_attn_reason(q: Tensor, inputs: AttentionInputs) -> str | None:
    if not q.is_cuda:
        return "flash-attn runs on CUDA only"
    if not flash_attn_installed():
        return "the flash-attn package is not installed (pip install flash-attn)"
    if q.dtype not in _LOW_PRECISION:
        return f"flash-attn needs fp16/bf16 inputs, got {str(q.dtype).removeprefix('torch.')}"
    if q.shape[-1] > 256:
        return f"flash-attn supports head dim <= 256, got {q.shape[-1]}"
    if inputs.attn_mask is not None:
        return "flash-attn takes no arbitrary attention mask (only causal and packed documents)"
    return None


BACKENDS: dict[str, Backend] = {
    "eager": Backend("eager", eager_attention, _always),
    "sdpa": Backend("sdpa", sdpa_attention, _sdpa_reason),
    "flex": Backend("flex", flex_attention, _flex_reason),
    "flash_attn": Backend("flash_attn", flash_attn_attention, _flash_attn_reason),
}
