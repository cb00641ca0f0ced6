"""FLOP formulas for flash-attn's kernels, so torch's FlopCounterMode (and vlmfast's MFU) counts them.

flash-attn (>= 2.6, ``flash_attn/flash_attn_interface.py``) wraps its CUDA kernels in ``torch.library.custom_op``s:
``flashattn::_flash_attn_forward``, ``_flash_attn_varlen_forward``, ``_flash_attn_backward`` and
``_flash_attn_varlen_backward``. FlopCounterMode only counts ops in its registry and cannot decompose an opaque custom
op, so a model on flash-attn reported no attention FLOPs at all (MFU under-reported). Here each op gets the formula
torch uses for its own SDPA flash kernel (``torch.utils.flop_counter.sdpa_flop_count`` /
``sdpa_backward_flop_count``: causal masking not discounted, as torch does), with flash-attn's layouts: q/k/v are
``[B, T, H, D]``, varlen ones ``[total_tokens, H, D]`` with ``cu_seqlens`` (the documents are counted one by one,
so packing counts sum(l_i^2), not T^2).

Usage: ``register_flash_attn_flops()`` once flash_attn is imported (FlopsMeter does it), then FlopCounterMode counts.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch.utils.flop_counter import flop_registry, register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

__all__ = ["FLASH_ATTN_OPS", "register_flash_attn_flops"]


def _bhtd(shape: torch.Size) -> tuple[int, int, int, int]:
    """flash-attn's [B, T, H, D] as torch's SDPA [B, H, T, D]."""
    b, t, h, d = shape
    return b, h, t, d


def _documents(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
               grad_out: torch.Tensor | None = None) -> list[tuple[tuple[int, ...], ...]]:
    """Per-document SDPA shapes of a varlen call (q [total, H, D]); reads cu_seqlens once (FLOP counting only)."""
    lengths_q = [b - a for a, b in itertools.pairwise(cu_q.tolist())]
    lengths_k = [b - a for a, b in itertools.pairwise(cu_k.tolist())]
    shapes = []
    for lq, lk in zip(lengths_q, lengths_k, strict=True):
        query = (1, q.shape[1], lq, q.shape[2])
        grad = (1, grad_out.shape[1], lq, grad_out.shape[2]) if grad_out is not None else query
        shapes.append((query, (1, k.shape[1], lk, k.shape[2]), (1, v.shape[1], lk, v.shape[2]), grad))
    return shapes


def flash_forward_flop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any, out_val: Any = None,
                       **kwargs: Any) -> int:
    return sdpa_flop_count(_bhtd(q.shape), _bhtd(k.shape), _bhtd(v.shape))


def flash_varlen_forward_flop(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                              cu_seqlens_k: torch.Tensor, *args: Any, out_val: Any = None, **kwargs: Any) -> int:
    return sum(sdpa_flop_count(qs, ks, vs) for qs, ks, vs, _ in _documents(q, k, v, cu_seqlens_q, cu_seqlens_k))


def flash_backward_flop(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *args: Any,
                        out_val: Any = None, **kwargs: Any) -> int:
    return sdpa_backward_flop_count(_bhtd(dout.shape), _bhtd(q.shape), _bhtd(k.shape), _bhtd(v.shape))


def flash_varlen_backward_flop(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               out: torch.Tensor, softmax_lse: torch.Tensor, dq: Any, dk: Any, dv: Any,
                               cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, *args: Any,
                               out_val: Any = None, **kwargs: Any) -> int:
    return sum(sdpa_backward_flop_count(gs, qs, ks, vs)
               for qs, ks, vs, gs in _documents(q, k, v, cu_seqlens_q, cu_seqlens_k, dout))


FLASH_ATTN_OPS = {
    "_flash_attn_forward": flash_forward_flop,
    "_flash_attn_varlen_forward": flash_varlen_forward_flop,
    "_flash_attn_backward": flash_backward_flop,
    "_flash_attn_varlen_backward": flash_varlen_backward_flop,
}


def register_flash_attn_flops(namespace: Any = None) -> list[str]:
    """Register the formulas for the flash-attn ops that exist (idempotent); returns the op names now counted.

    `namespace` defaults to ``torch.ops.flashattn`` (filled when flash_attn is imported); tests pass their own.
    Older flash-attn (plain autograd Functions, no custom ops) has nothing to register: its FLOPs stay uncounted.
    """
    namespace = namespace if namespace is not None else torch.ops.flashattn
    counted = []
    for name, formula in FLASH_ATTN_OPS.items():
        try:
            packet = getattr(namespace, name)
        except (AttributeError, RuntimeError):
            continue
        if packet not in flop_registry:
            register_flop_formula(packet, get_raw=True)(formula)
        counted.append(name)
    return counted
