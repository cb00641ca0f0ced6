"""TF32 switches that never mix torch's two TF32 APIs.

torch >= 2.9 has a new per-backend API (``torch.backends.fp32_precision``,
``torch.backends.cuda.matmul.fp32_precision``, ``torch.backends.cudnn.conv.fp32_precision``, ...) next to the
legacy one (``torch.backends.cuda.matmul.allow_tf32``, ``torch.backends.cudnn.allow_tf32``). Once anything in the
process has used the new API, *reading* a legacy flag raises, and so does ``torch.get_float32_matmul_precision()``
whenever the new matmul setting disagrees with the legacy precision ("you have used mix of the legacy and new APIs";
aten/src/ATen/Context.cpp, float32MatmulPrecision). transformers (``utils/import_utils.py: enable_tf32``) sets the
generic ``torch.backends.fp32_precision`` on torch >= 2.9, and Lightning Fabric's CUDA accelerator calls
``torch.get_float32_matmul_precision()`` when it starts (``lightning_fabric/accelerators/cuda.py:
_check_cuda_matmul_precision``): a benchmark that set or read the legacy flags after an HF Trainer run made Fabric
raise.

So vlmfast turns TF32 on with ``torch.set_float32_matmul_precision("high")``, which sets the legacy precision *and*
the new cuda/mkldnn matmul settings together (the one call both readers agree on), plus the cuDNN convolution and
RNN settings through the new API; it never touches ``allow_tf32``. :func:`tf32_state` / :func:`restore_tf32_state` save
and restore every switch through the new API only, so a run cannot leave TF32 settings behind for the next.

Usage::

    set_tf32(True)
    saved = tf32_state(); ...; restore_tf32_state(saved)
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["restore_tf32_state", "set_tf32", "tf32_state"]

# (backend, op) pairs of the new API, most general first: restoring in this order lets a specific setting win.
_NEW_API = (("generic", "all"), ("cuda", "all"), ("cuda", "matmul"), ("cuda", "conv"), ("cuda", "rnn"),
            ("mkldnn", "all"), ("mkldnn", "matmul"), ("mkldnn", "conv"), ("mkldnn", "rnn"))


def has_new_api() -> bool:
    """Whether this torch has the per-backend fp32_precision API (torch >= 2.9)."""
    return hasattr(torch._C, "_get_fp32_precision_getter")


def set_tf32(enabled: bool = True) -> None:
    """TF32 for CUDA matmuls and cuDNN convolutions on (fp32 range, ~10-bit mantissa) or off."""
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    if has_new_api():
        # cuDNN convolutions and RNNs together, as the legacy cudnn.allow_tf32 did. (After this, as after any use of
        # the new API, torch refuses to *read* the legacy cudnn.allow_tf32: read cudnn.conv.fp32_precision instead.)
        for op in ("conv", "rnn"):
            torch._C._set_fp32_precision_setter("cuda", op, "tf32" if enabled else "ieee")
    else:  # torch < 2.9: the legacy flags are the only API
        torch.backends.cudnn.allow_tf32 = enabled


def tf32_state() -> dict[str, Any]:
    """Every TF32-related switch, read without touching the legacy flags (which raise once the new API was used)."""
    state: dict[str, Any] = {"matmul_precision": _legacy_precision()}
    if has_new_api():
        for backend, op in _NEW_API:
            try:
                state[f"{backend}.{op}"] = torch._C._get_fp32_precision_getter(backend, op)
            except RuntimeError:  # a backend this build does not know
                continue
    else:
        state["cudnn.allow_tf32"] = torch.backends.cudnn.allow_tf32
    return state


def restore_tf32_state(state: dict[str, Any]) -> None:
    """Put back what :func:`tf32_state` returned (e.g. torch's defaults saved at start-up), consistently."""
    # The legacy precision first: setting it also writes the matmul settings, which the loop below then restores.
    torch.set_float32_matmul_precision(state["matmul_precision"])
    for key, value in state.items():
        if key == "cudnn.allow_tf32":
            torch.backends.cudnn.allow_tf32 = value
        elif key != "matmul_precision":
            backend, op = key.split(".")
            torch._C._set_fp32_precision_setter(backend, op, value)


def _legacy_precision() -> str:
    try:
        return torch.get_float32_matmul_precision()
    except RuntimeError:  # the APIs disagree (e.g. after transformers' enable_tf32): infer it from the new API
        matmul = torch._C._get_fp32_precision_getter("cuda", "matmul")
        return "high" if matmul == "tf32" else "highest"
