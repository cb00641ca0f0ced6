"""What a model does between its language head and its logits, learned by probing its own forward.

Usage::

    transform = probe_logit_head(model.forward, model.get_output_embeddings(), batch)   # batch without labels
    transform.scale, transform.softcap, transform.bias, transform.masked                  # what the probe saw

Why: a chunked loss recomputes the logits from the head's weight, so it must apply whatever the model applies after
its head, exactly. Configs do not say it reliably (Aya Vision's text config carries Cohere's ``logit_scale`` that its
forward never applies; Chameleon masks its image tokens' logits in the forward; Gemma soft-caps): the forward is
the only source of truth, so it is asked.

How: one forward of the model under ``no_grad`` in which a forward hook on the head replaces the head's output with a
designed tensor: a row of zeros (what the model adds to a zero logit: an additive bias, masked entries), then rows of
one wave over the vocabulary at growing magnitudes (1e-2 .. 1e6: the slope near zero is the scale, the saturation
is the soft cap). What the model returns as logits is then fitted, in float64, by ``cap * tanh(scale * z / cap) +
bias`` with entries it overwrites by a constant (a vocabulary mask), or by ``scale * z + bias``; the fit must give
every designed row back within the logits' precision, else the probe refuses naming what it saw. The head itself
runs on the last few positions only (a pre-hook trims its input), so no full logits are made.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["HeadTransform", "LogitHeadProbe", "probe_logit_head"]

PROBE_POSITIONS = 8  # positions per row the head runs on during the probe
_MAGNITUDES = (0.0, 1e-2, 1.0, 10.0, 100.0, 1e6)  # the designed rows: 0 shows the additive part, 1e6 saturates a cap


@dataclass(frozen=True)
class HeadTransform:
    """What a model does to ``h @ W.T (+ b)`` before its loss: multiply by ``scale``, soft-cap (Gemma 2/3), add a
    per-entry ``bias`` ([vocab]), and overwrite the ``masked`` entries ([vocab] bool) with ``mask_values``.

    Usage: ``HeadTransform(scale=1.0, softcap=30.0)``
    """

    scale: float = 1.0
    softcap: float | None = None
    bias: Tensor | None = None
    masked: Tensor | None = None  # indices of the vocabulary entries the model overwrites
    mask_values: Tensor | None = None  # what it writes there (finfo.min, -inf, ...)

    @property
    def plain(self) -> bool:
        """Only a scale and a soft cap: what the fused kernels (Liger, CCE) can reproduce."""
        return self.bias is None and self.masked is None

    def __str__(self) -> str:
        parts = [f"scale {self.scale:g}"]
        parts += [f"soft cap {self.softcap:g}"] if self.softcap else []
        parts += [f"an additive bias (max |b| {float(self.bias.abs().max()):.3g})"] if self.bias is not None else []
        parts += [f"{self.masked.numel()} vocabulary entries masked"] if self.masked is not None else []
        return ", ".join(parts)


@dataclass
class LogitHeadProbe:
    """The outcome of :func:`probe_logit_head`: the transform, the head's input (trimmed) and the head's own output."""

    transform: HeadTransform
    head_input: Tensor
    head_output: Tensor


def _design(vocab: int) -> Tensor:
    """[rows, vocab] float64: zeros, then an alternating wave of magnitude 1..2 times each of ``_MAGNITUDES``."""
    j = torch.arange(vocab, dtype=torch.float64)
    wave = (1 + j / vocab) * (1 - 2 * (j % 2))
    return torch.stack([m * wave for m in _MAGNITUDES])


def tolerance_of(*tensors: Tensor) -> float:
    """Relative agreement to expect: tight when everything is 32/64-bit, bf16's rounding otherwise."""
    return 1e-4 if all(t.dtype in (torch.float32, torch.float64) for t in tensors) else 3e-2


def _no_autocast(device: torch.device) -> contextlib.AbstractContextManager[Any]:
    """The probe runs at the weights' precision: a transform is the same at any precision, and fp32 shows it exactly."""
    if torch.amp.is_autocast_available(device.type):
        return torch.autocast(device.type, enabled=False)
    return contextlib.nullcontext()


def _logits_of(output: Any) -> Tensor:
    logits = output.logits if hasattr(output, "logits") else output[0] if isinstance(output, (tuple, list)) else output
    if not isinstance(logits, Tensor):
        raise ValueError("linear_cross_entropy: the model's forward returned no logits tensor to probe its head with; "
                         "set linear_cross_entropy.enabled: false")
    return logits


def _run_designed(forward: Callable[..., Any], head: nn.Module, inputs: dict[str, Any],
                  design: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Forwards with the head's output replaced by rows of ``design`` (as many forwards as rows need): (the head's
    input, its own output, the designed values given, the model's logits for them), rows flattened."""
    seen: dict[str, Any] = {"done": 0, "given": [], "returned": []}

    def take(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if not args or not isinstance(args[0], Tensor):
            raise ValueError("linear_cross_entropy: the model calls its head without a positional hidden-states "
                             "tensor; set linear_cross_entropy.enabled: false")
        positions = args[0].shape[-2]
        trimmed = args[0][..., positions - min(PROBE_POSITIONS, positions):, :]
        seen.setdefault("input", trimmed)
        return (trimmed, *args[1:])

    def replace(_module: nn.Module, _args: Any, output: Tensor) -> Tensor:
        seen.setdefault("output", output)
        rows = output.reshape(-1, output.shape[-1]).shape[0]
        values = design[(seen["done"] + torch.arange(rows)) % design.shape[0]]
        seen["given"].append(values)
        return values.to(device=output.device, dtype=output.dtype).reshape(output.shape)

    handles = [head.register_forward_pre_hook(take), head.register_forward_hook(replace)]
    try:
        while seen["done"] < design.shape[0]:
            logits = _logits_of(forward(**inputs))
            _check_one_head_call(seen, logits, design.shape[1])
            seen["done"] += seen["given"][-1].shape[0]
    finally:
        for handle in handles:
            handle.remove()
    dtype = seen["output"].dtype  # the designed values as the model saw them (rounded to its dtype)
    z = torch.cat(seen["given"]).to(dtype).to(torch.float64)
    return seen["input"], seen["output"], z, torch.cat(seen["returned"])


def _check_one_head_call(seen: dict[str, Any], logits: Tensor, vocab: int) -> None:
    """One head call per forward, and logits of the head output's shape; keeps the logits (float64, host)."""
    calls = len(seen["given"]) - len(seen["returned"])
    if calls != 1:
        raise ValueError(f"linear_cross_entropy: the model's forward ran its head {calls} times, not once; set "
                         "linear_cross_entropy.enabled: false")
    flat = logits.reshape(-1, logits.shape[-1]) if logits.shape[-1] == vocab else None
    if flat is None or flat.shape != seen["given"][-1].shape:
        raise ValueError(f"linear_cross_entropy: the model turns a head output of {tuple(seen['output'].shape)} into "
                         f"logits of {tuple(logits.shape)}; the chunked loss cannot reproduce that: set "
                         "linear_cross_entropy.enabled: false")
    seen["returned"].append(flat.detach().to(torch.float64).cpu())


def _fit(z: Tensor, logits: Tensor, tolerance: float) -> HeadTransform | None:
    """The transform that gives ``logits`` from ``z`` (both [rows, vocab] float64, row 0 of z zeros), or None."""
    constant = (logits == logits[:1]).all(dim=0) & (z != z[:1]).any(dim=0)
    free = ~constant
    bias = logits[0]
    y, x = (logits - bias)[:, free], z[:, free]
    magnitude = logits[:, free].abs().amax(dim=1)  # each row's logits: their precision sets the error allowed
    candidates = [_affine(x, y)]
    cap = float(y.abs().max())
    if 0 < cap < float("inf"):
        candidates.append(_capped(x, y, cap))
    for scale, softcap in candidates:
        for snapped in ((_snap(scale), None if softcap is None else _snap(softcap)), (scale, softcap)):
            if _error(x, y, magnitude, *snapped) <= tolerance:
                masked = constant.nonzero().squeeze(1) if constant.any() else None
                return HeadTransform(
                    scale=snapped[0], softcap=snapped[1],
                    bias=None if not bias[free].any() else bias.masked_fill(constant, 0.0),
                    masked=masked, mask_values=None if masked is None else logits[0, masked])
    return None


def _affine(x: Tensor, y: Tensor) -> tuple[float, None]:
    return float((x * y).sum() / (x * x).sum().clamp(min=1e-300)), None


def _capped(x: Tensor, y: Tensor, cap: float) -> tuple[float, float]:
    """``y = cap * tanh(scale * x / cap)``: the cap is the saturated value, the scale fitted on the unsaturated rows."""
    linear = (y.abs() < 0.9 * cap) & (x != 0)
    u = cap * torch.atanh((y[linear] / cap).clamp(-1, 1))
    return float((x[linear] * u).sum() / (x[linear] ** 2).sum().clamp(min=1e-300)), cap


def _error(x: Tensor, y: Tensor, magnitude: Tensor, scale: float, softcap: float | None) -> float:
    """The worst row's difference between the fitted transform and what the model returned, relative to the row's
    largest logit (a row of zero logits: absolute)."""
    predicted = scale * x if softcap is None else softcap * torch.tanh(scale * x / softcap)
    per_row = (predicted - y).abs().amax(dim=1) / torch.where(magnitude > 0, magnitude, 1.0)
    return float(per_row.max()) if torch.isfinite(per_row).all() else float("inf")


def _snap(value: float) -> float:
    """The value at 6 significant digits (0.0625 rather than 0.062500001): tried first, kept when exact."""
    return float(f"{value:.6g}")


def probe_logit_head(forward: Callable[..., Any], head: nn.Module, inputs: dict[str, Any]) -> LogitHeadProbe:
    """Learn what ``forward(**inputs)`` does to ``head``'s output before returning it as logits.

    Usage: ``probe = probe_logit_head(model.forward, model.lm_head, batch_without_labels); probe.transform``

    Refuses (a ``ValueError`` naming ``linear_cross_entropy`` and what was seen) when no scale, soft cap, additive
    bias and vocabulary mask together reproduce the model's logits within their precision.
    """
    weight = head.weight
    design = _design(weight.shape[0])
    with torch.no_grad(), _no_autocast(weight.device):
        head_input, head_output, z, logits = _run_designed(forward, head, inputs, design)
    transform = _fit(z, logits, tolerance_of(head_output))
    if transform is None:
        at_zero, at_one = logits[z[:, 0] == 0][0], logits[z[:, 0] == 1][0]
        raise ValueError(
            "linear_cross_entropy: what the model does between its head and its logits is not a scale, soft cap, "
            "additive bias and vocabulary mask that the chunked loss can reproduce exactly: a zero head output gave "
            f"logits {_show(at_zero)}, a head output of +-1..2 gave {_show(at_one)}. Set "
            "linear_cross_entropy.enabled: false, or compute the loss in your own loss_fn with "
            "vlmfast.hooks.linear_cross_entropy")
    return LogitHeadProbe(transform, head_input, head_output)


def _show(row: Tensor) -> str:
    return "[" + ", ".join(f"{float(v):.4g}" for v in row[:4]) + (", ...]" if row.numel() > 4 else "]")
