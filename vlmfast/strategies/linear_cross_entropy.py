"""Chunked linear cross-entropy: the language head and the loss, chunk by chunk, never the full ``[tokens, vocab]``.

Usage in a hand-written loop::

    hidden = model.model(input_ids=ids).last_hidden_state                 # [B, T, H]: the base model, no head
    targets = shift_targets(labels)                                       # labels[t + 1] at t, -100 at the end
    loss_sum = linear_cross_entropy(hidden, model.lm_head.weight, targets, reduction="sum")
    (loss_sum / n_items).backward()

    model = ChunkedLossModel.wrap(model)   # or the whole model: its forward returns the same loss, without logits

Why: in VLM fine-tuning the largest activation is often the logits. At 4,096 tokens and Qwen2's 151,936-token
vocabulary the fp32 logits take 2.5 GB, and a standard loss keeps a log-softmax of that size for backward (plus the
upcast logits under bf16), while the hidden states they come from take 15 MB (vocab / hidden = 170x less).

How: one autograd function. Forward computes, for a chunk of tokens at a time, the chunk's logits (``h @ W.T``,
upcast to fp32 as Hugging Face's loss does), their log-sum-exp and the loss, then drops the chunk. It keeps for
backward only what it was given (hidden states, head weight: alive anyway) plus one fp32 log-sum-exp per token.
Backward recomputes each chunk's logits, turns them into the gradient of the loss in place (softmax minus one-hot)
and accumulates the gradients of the hidden states and of the head weight chunk by chunk. The price is one more
matmul of the head (recomputing the logits); the standard path's full-size softmax, its gradient and their page
faults are gone, which on CPU pays for it (benchmarks/linear_cross_entropy.py). Tokens whose target is
``ignore_index`` (padding, prompts) are skipped entirely. Soft-capping (Gemma 2/3), a logit scale (Cohere, Granite),
an additive bias after the head (BART's ``final_logits_bias``), a vocabulary mask (Chameleon's image tokens), z-loss
and label smoothing are exact in both directions. Which of them a model applies is learned by probing its forward on
the first batch (vlmfast/common/logit_head.py), never read from its config.

On CUDA, an installed Liger kernel (``liger_kernel``) or Apple's Cut Cross-Entropy (``cut_cross_entropy``) can do the
same work fused (``impl: auto | liger | cce``); ``describe()`` says which ran.

The trainer uses it through :class:`LinearCrossEntropy` (the ``linear_cross_entropy`` spec section): the model's
forward is replaced on the instance (parameters, names and ``state_dict`` unchanged) by one that runs the base model
for the hidden states and this loss on the head's weight, with the model's own label shift and its own
``num_items_in_batch`` division, so gradient accumulation weights it exactly like the model's own loss. Supported:
Hugging Face causal LMs and VLMs whose loss is ``ForCausalLMLoss`` (what the forward does after the head probed
once, on the first batch, and the head checked against the model's own; a VLM with no base model to run, such as
InstructBLIP whose logits come from its language model's head, runs its own forward while a pre-hook on the head
takes the head's input), vlmfast's tiny VLM, and any model exposing ``hidden_states_for_loss(**batch)`` and
``get_output_embeddings()``. Anything else is refused with what to do instead.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import math
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from vlmfast.common.logit_head import HeadTransform, probe_logit_head, tolerance_of
from vlmfast.common.sections import Field, Section
from vlmfast.common.utils import unwrap_model
from vlmfast.strategies.base import Strategy

__all__ = [
    "ChunkedLossModel",
    "HeadTransform",
    "LinearCrossEntropy",
    "LinearCrossEntropySpec",
    "linear_cross_entropy",
    "resolve_impl",
    "shift_targets",
]

log = logging.getLogger(__name__)

IGNORE_INDEX = -100
Impl = Literal["auto", "torch", "liger", "cce"]
DEFAULT_CHUNK_BYTES = 256 * 2**20  # fp32 logits per chunk: few passes over the head weight, small next to the rest


class LinearCrossEntropySpec(Section):
    """Chunked linear cross-entropy: the head and the loss chunk by chunk, never the full logits."""

    enabled: bool = Field(False, description="compute the language head and the loss in chunks of tokens (the model's "
                          "forward then returns the loss without logits); gradients equal the standard loss")
    chunk_tokens: int | None = Field(
        None, ge=1, description="tokens per chunk; default: as many as keep a chunk's fp32 logits under 256 MiB")
    impl: Impl = Field("auto", description="torch: pure PyTorch, any device; liger / cce: the fused CUDA kernels of "
                       "liger_kernel / cut_cross_entropy (must be installed); auto: cce, then liger on CUDA when "
                       "installed, else torch")
    label_smoothing: float = Field(0.0, ge=0, lt=1, description="label smoothing (as F.cross_entropy's); the "
                                   "model's own loss has none, so leave 0 to train the same objective")
    z_loss: float = Field(0.0, ge=0, description="z-loss weight: adds z_loss * logsumexp(logits)^2 per token (PaLM)")
    recompute: bool = Field(
        True, description="recompute each chunk's logits in backward: nothing of vocabulary size kept (4 head "
        "matmuls); false: gradients computed in forward and kept until backward, the head weight's [vocab, hidden] "
        "fp32 included (3 matmuls, as the standard head; Liger's way)")
    verify: bool = Field(True, description="on the first batch, probe what the model's forward does between its head "
                         "and its logits (a scale, a soft cap, an additive bias, a vocabulary mask: applied in the "
                         "chunks; anything else refused) and check the head on a few positions; false: the head's "
                         "raw output is taken as the logits, unchecked")


# ----------------------------------------------------------------------------------------------------------------
# the plain function


@dataclass(frozen=True)
class _Options:
    ignore_index: int
    chunk_tokens: int
    transform: HeadTransform
    label_smoothing: float
    z_loss: float
    matmul_dtype: torch.dtype  # the head's matmuls: autocast's dtype when on, else the weight's
    recompute: bool = True  # False: the gradients in forward, kept until backward (Liger's way)


def _matmul_dtype(weight: Tensor) -> torch.dtype:
    """The dtype the model's head would run its matmul in: autocast's 16-bit dtype when on, else the weight's."""
    device = weight.device.type
    if device in ("cuda", "cpu", "xpu", "mps") and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return weight.dtype


def shift_targets(labels: Tensor, ignore_index: int = IGNORE_INDEX) -> Tensor:
    """Targets of a causal LM: ``labels[..., t + 1]`` at position t, ``ignore_index`` at the last position.

    Usage: ``targets = shift_targets(batch["labels"])`` (Hugging Face's ForCausalLMLoss shift)
    """
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def auto_chunk_tokens(vocab: int, budget_bytes: int = DEFAULT_CHUNK_BYTES) -> int:
    """Tokens per chunk so that one chunk's fp32 logits take at most ``budget_bytes`` (at least 16 tokens)."""
    return max(16, budget_bytes // (4 * vocab))


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    reduction: Literal["sum", "mean"] = "sum",
    chunk_tokens: int | None = None,
    softcap: float | None = None,
    logit_scale: float = 1.0,
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    impl: Impl = "torch",
    recompute: bool = True,
    transform: HeadTransform | None = None,
) -> Tensor:
    """Cross-entropy of ``hidden @ weight.T (+ bias)`` against ``targets``, computed chunk by chunk.

    Usage: ``loss = linear_cross_entropy(hidden, lm_head.weight, shift_targets(labels), reduction="mean")``

    ``hidden`` [..., H] and ``targets`` [...] (already shifted for a causal LM: :func:`shift_targets`); ``weight``
    [V, H]. Returns the fp32 loss summed over the tokens whose target is not ``ignore_index`` (``reduction="sum"``)
    or their mean. The logits are ``logit_scale * (hidden @ weight.T + bias)``, soft-capped as
    ``softcap * tanh(logits / softcap)`` when ``softcap`` is set, in fp32 (fp64 inputs stay fp64). Never holds more
    than ``chunk_tokens`` rows of logits; keeps one fp32 log-sum-exp per token for backward and recomputes each
    chunk's logits there (four matmuls of the head in all). ``recompute=False`` computes the gradients during forward
    instead (three matmuls, as the standard head) and keeps them, the head weight's included ([V, H] fp32), until
    backward. ``impl`` 'liger' or 'cce' runs those libraries' fused CUDA kernels instead ('auto' picks one, see
    :func:`resolve_impl`). ``transform`` (what a probe of the model found, :func:`probe_logit_head`) replaces
    ``logit_scale`` and ``softcap`` and may add a bias after them and a vocabulary mask (torch only).
    """
    if reduction not in ("sum", "mean"):
        raise ValueError(f"reduction must be 'sum' or 'mean', got {reduction!r}")
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree: hidden is "
                         "[..., H] and targets [...] with the same leading shape (shift the labels first)")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight {tuple(weight.shape)} must be [vocab, {hidden.shape[-1]}]")
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).to(hidden.device)
    chosen = resolve_impl(impl, hidden.device)
    transform = transform or HeadTransform(logit_scale, softcap)
    if chosen != "torch" and not transform.plain:
        raise ValueError(f"linear_cross_entropy: the model's logits have {transform}; the fused kernels reproduce a "
                         "scale and a soft cap only: use impl: torch")
    if chosen == "torch":
        chunk = chunk_tokens or auto_chunk_tokens(weight.shape[0])
        options = _Options(ignore_index, chunk, transform, label_smoothing, z_loss, _matmul_dtype(weight), recompute)
        # The function casts itself (options.matmul_dtype); meta tensors (memory estimates) have no autocast.
        no_autocast = (torch.autocast(hidden.device.type, enabled=False)
                       if torch.amp.is_autocast_available(hidden.device.type) else contextlib.nullcontext())
        with no_autocast:
            total = _ChunkedLinearCrossEntropy.apply(flat_hidden, weight, bias, flat_targets, options)
    else:
        total = _fused_kernel(chosen, flat_hidden, weight, bias, flat_targets, ignore_index, transform.softcap,
                              transform.scale, label_smoothing, z_loss)
    if reduction == "mean":
        return total / (flat_targets != ignore_index).sum().clamp(min=1)
    return total


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class _ChunkLogits:
    """One reused ``[chunk, vocab]`` buffer for the logits of every chunk.

    Reused, not reallocated: a fresh buffer of this size is a fresh mmap on CPU (a page fault per 4 KiB, every chunk)
    and a fresh block for the CUDA caching allocator to find.
    """

    def __init__(self, weight: Tensor, bias: Tensor | None, transform: HeadTransform, dtype: torch.dtype,
                 rows: int, matmul_dtype: torch.dtype | None = None) -> None:
        self.transform, self.dtype = transform, dtype
        self.matmul_dtype = matmul_dtype or weight.dtype
        # Cast once per pass (autocast keeps one 16-bit copy of the weight per forward the same way).
        self.weight = weight.to(self.matmul_dtype)
        self.bias = None if bias is None else bias.to(self.matmul_dtype)
        self.buffer = torch.empty(rows, weight.shape[0], dtype=dtype, device=weight.device)
        # what the model adds / overwrites after its head (probed), on the logits' device in the compute dtype
        self.after_bias = None if transform.bias is None else transform.bias.to(weight.device, dtype)
        self.masked = None if transform.masked is None else transform.masked.to(weight.device)
        self.mask_values = None if transform.mask_values is None else transform.mask_values.to(weight.device, dtype)

    def raw(self, hidden: Tensor) -> Tensor:
        """``hidden @ W.T (+ b)``, times the model's logit scale, in the compute dtype: the matmul in the head's
        dtype (or autocast's) as the model's head runs it, then upcast as Hugging Face's loss upcasts."""
        out = self.buffer[: hidden.shape[0]]
        if hidden.dtype == self.dtype and self.matmul_dtype == self.dtype:
            if self.bias is None:
                torch.mm(hidden, self.weight.t(), out=out)
            else:
                torch.addmm(self.bias, hidden, self.weight.t(), out=out)
        else:
            out.copy_(F.linear(hidden.to(self.matmul_dtype), self.weight, self.bias))
        if self.transform.scale != 1.0:
            out.mul_(self.transform.scale)
        return out

    def capped(self, hidden: Tensor) -> tuple[Tensor, Tensor | None]:
        """(the logits the loss sees, tanh(raw / softcap) or None); the first is the buffer unless soft-capped."""
        out = self.raw(hidden)
        cap = self.transform.softcap
        tanh = None
        if cap is not None:
            tanh = out.div_(cap).tanh_()
            out = tanh * cap
        if self.after_bias is not None:
            out.add_(self.after_bias)
        if self.masked is not None:
            out[:, self.masked] = self.mask_values
        return out, tanh

    def zero_masked(self, grad: Tensor) -> Tensor:
        """No gradient reaches a logit the model overwrites (its mask)."""
        if self.masked is not None:
            grad[:, self.masked] = 0
        return grad


def _to_gradient(probs: Tensor, chunk_lse: Tensor, target: Tensor, tanh: Tensor | None, opts: _Options,
                 vocab: int) -> Tensor:
    """Softmax of a chunk (in place) -> d loss / d raw logits: softmax * (1 + 2 z lse) - (1 - eps) onehot - eps / V,
    through the soft-cap (times 1 - tanh^2) and the logit scale. The upstream gradient is applied later, once."""
    eps = opts.label_smoothing
    if opts.z_loss:
        probs.mul_((1 + 2 * opts.z_loss * chunk_lse)[:, None])
    if eps:
        probs.sub_(eps / vocab)
    probs[torch.arange(target.numel(), device=probs.device), target] -= 1 - eps
    if tanh is not None:
        probs.mul_(tanh.square_().neg_().add_(1))
    if opts.transform.scale != 1.0:
        probs.mul_(opts.transform.scale)
    return probs


class _Gradients:
    """The gradients of the hidden states, the head weight and bias, accumulated chunk by chunk."""

    def __init__(self, hidden: Tensor, weight: Tensor, bias: Tensor | None, needs: tuple[bool, ...],
                 dtype: torch.dtype, chunks: _ChunkLogits) -> None:
        self.chunks, self.dtype, self.hidden_dtype = chunks, dtype, hidden.dtype
        self.hidden = torch.zeros_like(hidden) if needs[0] else None
        # fp32 accumulation over chunks (the standard path reduces over all tokens in one fp32-accumulating matmul)
        self.weight = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if needs[1] else None
        self.bias = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if needs[2] and bias is not None else None

    def add(self, grad: Tensor, rows: Tensor, chunk_hidden: Tensor) -> None:
        md = self.chunks.matmul_dtype
        if self.hidden is not None:  # in the head's matmul dtype, as the standard backward runs it
            self.hidden[rows] = (grad.to(md) @ self.chunks.weight).to(self.hidden_dtype)
        if self.weight is not None and md != self.dtype:  # 16-bit matmuls, accumulated in fp32
            self.weight += (grad.t().to(md) @ chunk_hidden.to(md)).to(self.dtype)
        elif self.weight is not None:
            self.weight.addmm_(grad.t(), chunk_hidden)
        if self.bias is not None:
            self.bias += grad.sum(0)

    def tensors(self) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        return self.hidden, self.weight, self.bias


def _scaled(grads: tuple[Tensor | None, ...], scale: Tensor) -> list[Tensor | None]:
    return [None if g is None else g.mul_(scale.to(g.dtype)) for g in grads]


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """Summed token loss of ``hidden @ weight.T``: recompute mode saves the inputs and one log-sum-exp per kept token;
    precompute mode (``opts.recompute`` False) computes the gradients in forward and saves them instead."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                opts: _Options) -> Tensor:
        dtype = _compute_dtype(hidden.dtype)
        if targets.device.type == "meta":  # shapes only (memory estimates): every token counts
            keep = torch.arange(targets.numel(), device=targets.device)
        else:
            keep = (targets != opts.ignore_index).nonzero().squeeze(1)  # one host read: the count of kept tokens
        kept_targets = targets[keep]
        lse = torch.empty(keep.numel(), dtype=dtype, device=hidden.device)
        total = torch.zeros((), dtype=dtype, device=hidden.device)
        chunks = _ChunkLogits(weight, bias, opts.transform, dtype, min(opts.chunk_tokens, max(keep.numel(), 1)),
                              opts.matmul_dtype)
        needs = tuple(ctx.needs_input_grad[:3])
        sink = _Gradients(hidden, weight, bias, needs, dtype, chunks) if not opts.recompute and any(needs) else None
        eps = opts.label_smoothing
        for start in range(0, keep.numel(), opts.chunk_tokens):
            rows = keep[start:start + opts.chunk_tokens]
            chunk_hidden = hidden[rows]
            logits, tanh = chunks.capped(chunk_hidden)
            target = kept_targets[start:start + rows.numel()]
            loss = -logits.gather(1, target[:, None]).squeeze(1)
            if eps:
                loss = (1 - eps) * loss - eps * logits.mean(dim=1)
            # log-sum-exp in place: max, exp(logits - max), sum (no chunk-sized temporaries)
            top = logits.amax(dim=1)
            chunk_lse = top + logits.sub_(top[:, None]).exp_().sum(dim=1).log_()
            lse[start:start + rows.numel()] = chunk_lse
            loss += chunk_lse
            if opts.z_loss:
                loss += opts.z_loss * chunk_lse.square()
            total += loss.sum()
            if sink is not None:  # the chunk's softmax is at hand: its gradients now, no recomputation later
                probs = logits.mul_(torch.exp(top - chunk_lse)[:, None])
                sink.add(chunks.zero_masked(_to_gradient(probs, chunk_lse, target, tanh, opts, weight.shape[0])),
                         rows, chunk_hidden)
        ctx.opts = opts
        ctx.precomputed = sink is not None
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        if sink is not None:  # saved (not kept on ctx) so saved-tensor hooks see, and measure, what this keeps
            ctx.save_for_backward(*sink.tensors())
        else:
            ctx.save_for_backward(hidden, weight, bias, keep, kept_targets, lse)
        return total.float() if dtype != torch.float64 else total

    @staticmethod
    def backward(ctx: Any, grad_total: Tensor) -> tuple[Tensor | None, ...]:
        if ctx.precomputed:
            grad_hidden, grad_weight, grad_bias = _scaled(ctx.saved_tensors, grad_total)
            weight_dtype, bias_dtype = ctx.dtypes
            return (grad_hidden, None if grad_weight is None else grad_weight.to(weight_dtype),
                    None if grad_bias is None else grad_bias.to(bias_dtype), None, None)
        hidden, weight, bias, keep, kept_targets, lse = ctx.saved_tensors
        opts: _Options = ctx.opts
        dtype = lse.dtype
        chunks = _ChunkLogits(weight, bias, opts.transform, dtype, min(opts.chunk_tokens, max(keep.numel(), 1)),
                              opts.matmul_dtype)
        sink = _Gradients(hidden, weight, bias, tuple(ctx.needs_input_grad[:3]), dtype, chunks)
        for start in range(0, keep.numel(), opts.chunk_tokens):
            rows = keep[start:start + opts.chunk_tokens]
            chunk_hidden = hidden[rows]
            chunk_lse = lse[start:start + rows.numel()]
            logits, tanh = chunks.capped(chunk_hidden)
            probs = logits.sub_(chunk_lse[:, None]).exp_()
            target = kept_targets[start:start + rows.numel()]
            sink.add(chunks.zero_masked(_to_gradient(probs, chunk_lse, target, tanh, opts, weight.shape[0])),
                     rows, chunk_hidden)
            del logits, probs
        grad_hidden, grad_weight, grad_bias = _scaled(sink.tensors(), grad_total.to(dtype))
        return (grad_hidden, _cast(grad_weight, weight), _cast(grad_bias, bias), None, None)


def _cast(grad: Tensor | None, like: Tensor | None) -> Tensor | None:
    return None if grad is None or like is None else grad.to(like.dtype)


# ----------------------------------------------------------------------------------------------------------------
# fused CUDA kernels (Liger, Cut Cross-Entropy)


def _installed(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def resolve_impl(impl: str, device: torch.device) -> str:
    """The implementation that runs: 'torch', 'liger' or 'cce'.

    Usage: ``resolve_impl("auto", torch.device("cuda"))`` -> 'cce' when cut_cross_entropy is installed

    'auto' takes Cut Cross-Entropy, then Liger, on CUDA when installed, else the pure-PyTorch path. Asking for
    'liger' or 'cce' where it cannot run is an error that says why.
    """
    if impl not in ("auto", "torch", "liger", "cce"):
        raise ValueError(f"linear_cross_entropy.impl must be auto, torch, liger or cce, got {impl!r}")
    packages = {"liger": "liger_kernel", "cce": "cut_cross_entropy"}
    if impl == "auto":
        if device.type == "cuda":
            for name in ("cce", "liger"):
                if _installed(packages[name]):
                    return name
        return "torch"
    if impl == "torch":
        return impl
    if device.type != "cuda":
        raise ValueError(f"linear_cross_entropy.impl '{impl}' runs Triton kernels on CUDA only; this runs on "
                         f"{device.type}: use impl: torch (or auto)")
    if not _installed(packages[impl]):
        raise ValueError(f"linear_cross_entropy.impl '{impl}' needs the {packages[impl]} package: pip install "
                         f"{packages[impl].replace('_', '-')}, or use impl: torch (or auto)")
    return impl


def _fused_kernel(impl: str, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor, ignore_index: int,
                  softcap: float | None, logit_scale: float, label_smoothing: float, z_loss: float) -> Tensor:
    """Summed loss by Liger's or CCE's kernel (their signatures: liger_kernel/transformers/functional.py
    `liger_fused_linear_cross_entropy`; cut_cross_entropy/linear_cross_entropy.py `linear_cross_entropy`)."""
    if logit_scale != 1.0:
        # Scaling the hidden states scales the logits the same way (bias aside), so both kernels can take it.
        if bias is not None:
            raise ValueError("linear_cross_entropy: a logit scale with a head bias needs impl: torch")
        hidden = hidden * logit_scale
    if impl == "liger":
        from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

        return liger_fused_linear_cross_entropy(hidden, weight, targets, bias=bias, ignore_index=ignore_index,
                                                lse_square_scale=z_loss, label_smoothing=label_smoothing,
                                                reduction="sum", softcap=softcap)
    if label_smoothing or z_loss:
        raise ValueError("linear_cross_entropy: Cut Cross-Entropy has no label smoothing or z-loss; use impl: liger "
                         "or torch")
    from cut_cross_entropy import linear_cross_entropy as cce_linear_cross_entropy

    return cce_linear_cross_entropy(hidden, weight, targets, bias=bias, ignore_index=ignore_index, softcap=softcap,
                                    reduction="sum", impl="cce")


# ----------------------------------------------------------------------------------------------------------------
# a whole model: its forward returns the chunked loss


@dataclass
class ChunkedLossOutput:
    """What a wrapped model returns when given labels: the loss, and no logits (they were never materialised)."""

    loss: Tensor
    logits: None = None


@dataclass
class _Source:
    """How to get a model's hidden states and head, and what its loss does with them."""

    kind: str  # "hugging face", "hugging face, head input captured" or "hidden_states_for_loss"
    hidden: Callable[[dict[str, Any]], Tensor]
    head: nn.Module
    transform: HeadTransform  # Hugging Face: learned by probing the forward on the first batch
    shift: bool
    make_output: Callable[[Tensor], Any]
    base: nn.Module | None = None  # HF: the base model (its output is the head's input)
    captured: bool = False  # the head's input is captured in the model's own forward (no base model to run)


def _refuse(model: nn.Module, why: str) -> ValueError:
    return ValueError(
        f"linear_cross_entropy: {type(model).__name__} {why}. Supported: Hugging Face causal LMs and VLMs with the "
        "standard ForCausalLM loss, vlmfast's tiny VLM, and models with hidden_states_for_loss(**batch) and "
        "get_output_embeddings(). Otherwise set linear_cross_entropy.enabled: false, or call "
        "vlmfast.hooks.linear_cross_entropy(hidden, head.weight, targets) in your own loss_fn")


def _head_of(model: nn.Module) -> nn.Module:
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    weight = getattr(head, "weight", None)
    if not isinstance(weight, Tensor) or weight.dim() != 2:
        raise _refuse(model, "has no output embeddings (get_output_embeddings() with a [vocab, hidden] weight)")
    return head


def _hf_source(model: nn.Module, original: Callable[..., Any]) -> _Source:
    from transformers.loss.loss_utils import LOSS_MAPPING, ForCausalLMLoss
    from transformers.modeling_outputs import CausalLMOutputWithPast

    if getattr(model, "_loss_function", None) is not None:
        raise _refuse(model, "has its own loss_function set")
    loss_type = getattr(model, "loss_type", None)
    if LOSS_MAPPING.get(loss_type) is not ForCausalLMLoss:
        raise _refuse(model, f"has loss_type {loss_type!r}, not the causal-LM loss")
    base = getattr(model, getattr(model, "base_model_prefix", ""), None)
    if not isinstance(base, nn.Module) or base is model:
        return _captured_source(model, original)
    accepts = inspect.signature(base.forward).parameters

    def hidden(inputs: dict[str, Any]) -> Tensor:
        if "use_cache" in accepts and "use_cache" not in inputs:
            inputs = {**inputs, "use_cache": False}  # no KV cache: nothing will be generated
        out = base(**inputs)
        return out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]

    return _Source("hugging face", hidden, _head_of(model), HeadTransform(), True,
                   lambda loss: CausalLMOutputWithPast(loss=loss, logits=None), base)


def _captured_source(model: nn.Module, original: Callable[..., Any]) -> _Source:
    """A model with no base model to run for hidden states (InstructBLIP: vision tower, Q-Former, then a whole
    causal LM whose ``lm_head`` gives the logits): its own forward runs, without labels, and a pre-hook on the head
    (``get_output_embeddings()``) takes the head's input and hands the head no position, so the logits are never
    made; the loss computes them chunk by chunk from what the head would have received."""
    from transformers.modeling_outputs import CausalLMOutputWithPast

    head = _head_of(model)

    def hidden(inputs: dict[str, Any]) -> Tensor:
        return _head_input(head, original, inputs, keep=0)[0]

    return _Source("hugging face, head input captured", hidden, head, HeadTransform(), True,
                   lambda loss: CausalLMOutputWithPast(loss=loss, logits=None), captured=True)


def _head_input(head: nn.Module, forward: Callable[..., Any], inputs: dict[str, Any],
                keep: int) -> tuple[Tensor, Any]:
    """The tensor `head` receives when `forward(**inputs)` runs, and the forward's output; the head itself runs on its
    last `keep` positions only (0: none)."""
    captured: list[Tensor] = []

    def take(_module: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
        if not args or not isinstance(args[0], Tensor):
            raise ValueError("linear_cross_entropy: the model calls its head without a positional hidden-states "
                             "tensor; set linear_cross_entropy.enabled: false")
        captured.append(args[0])
        positions = args[0].shape[-2]
        return (args[0][..., positions - min(keep, positions):, :], *args[1:])

    handle = head.register_forward_pre_hook(take)
    try:
        output = forward(**inputs)
    finally:
        handle.remove()
    if len(captured) != 1:
        raise ValueError(f"linear_cross_entropy: the model's forward ran its head {len(captured)} times, not once; "
                         "set linear_cross_entropy.enabled: false")
    return captured[0], output


def _protocol_source(model: nn.Module) -> _Source:
    shift = getattr(model, "loss_shifts_labels", None)
    if shift is None:
        raise _refuse(model, "has hidden_states_for_loss but does not declare loss_shifts_labels (True or False)")
    transform = getattr(model, "loss_logit_transform", HeadTransform())
    return _Source("hidden_states_for_loss", lambda inputs: model.hidden_states_for_loss(**inputs), _head_of(model),
                   transform, bool(shift), lambda loss: ChunkedLossOutput(loss=loss))


def _decoder_inputs_from_labels(model: nn.Module) -> Callable[[Tensor], Tensor] | None:
    """How an encoder-decoder (``is_encoder_decoder`` in its config or its text config: a forward that merely takes
    ``decoder_input_ids``, such as InstructBLIP's for its T5 variants, may run a decoder-only LM) makes its decoder's
    inputs from the labels when it is given only labels: its own ``prepare_decoder_input_ids_from_labels``, else the
    labels shifted right after ``decoder_start_token_id``. None for a decoder-only model; refused when an
    encoder-decoder shows neither."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    if not any(getattr(c, "is_encoder_decoder", False) for c in (config, text)):
        return None
    prepare = getattr(model, "prepare_decoder_input_ids_from_labels", None)
    if callable(prepare):
        return lambda labels: prepare(labels=labels)
    start = getattr(config, "decoder_start_token_id", None)
    start = start if start is not None else getattr(text, "decoder_start_token_id", None)
    if start is None:
        raise _refuse(model, "is an encoder-decoder that shows no way to make its decoder_input_ids from the labels "
                             "(no prepare_decoder_input_ids_from_labels, no config.decoder_start_token_id), and the "
                             "chunked loss takes the labels away before the forward; pass decoder_input_ids in the "
                             "batch")
    pad = getattr(config, "pad_token_id", None)
    pad = pad if pad is not None else getattr(text, "pad_token_id", None)
    return lambda labels: _shift_right(labels, start, 0 if pad is None else pad)


def _shift_right(labels: Tensor, start: int, pad: int) -> Tensor:
    """Decoder inputs of a sequence-to-sequence model: ``start`` then ``labels[:-1]``, ignored positions as ``pad``."""
    shifted = labels.new_full(labels.shape, start)
    shifted[..., 1:] = labels[..., :-1]
    return shifted.masked_fill(shifted == IGNORE_INDEX, pad)


def _is_hf(model: nn.Module) -> bool:
    return any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__)


def _source(model: nn.Module, original: Callable[..., Any]) -> _Source:
    if hasattr(model, "hidden_states_for_loss"):
        return _protocol_source(model)
    if _is_hf(model):
        return _hf_source(model, original)
    raise _refuse(model, "is neither a Hugging Face model nor has hidden_states_for_loss(**batch)")


def loss_owner(model: nn.Module) -> nn.Module:
    """The module whose forward computes the loss: ``model`` itself, or, through wrappers that expose the model they
    wrap (PEFT's ``get_base_model()``: a LoRA model's forward calls the wrapped model's forward with the labels), the
    first wrapped model that is a Hugging Face model or has ``hidden_states_for_loss``. Usage: ``loss_owner(peft)``"""
    seen = model
    while not (hasattr(seen, "hidden_states_for_loss") or _is_hf(seen)):
        inner = seen.get_base_model() if callable(getattr(seen, "get_base_model", None)) else None
        if not isinstance(inner, nn.Module) or inner is seen:
            return model  # refused by _source, naming the model the user passed
        seen = inner
    return seen


_DROPPED = ("labels", "num_items_in_batch", "shift_labels", "logits_to_keep", "return_dict")


@dataclass
class ChunkedLossModel:
    """The state behind a model whose forward was replaced by :func:`apply_linear_cross_entropy`.

    Usage: ``state = apply_linear_cross_entropy(model); state.impl, state.verified`` (also ``model._vlmfast_lce``)
    """

    source: _Source
    original: Callable[..., Any]
    signature: inspect.Signature
    chunk_tokens: int
    impl: str
    label_smoothing: float
    z_loss: float
    verify: bool
    recompute: bool = True
    verified: str = "not yet"  # "yes", "not yet", or why it could not be checked
    calls: int = 0
    impl_auto: bool = False  # impl was 'auto': a probed bias or mask moves a fused kernel back to torch
    # an encoder-decoder's decoder_input_ids from its labels (the model's own shift): built before the labels go
    decoder_inputs: Callable[[Tensor], Tensor] | None = None

    @classmethod
    def wrap(cls, model: nn.Module, **options: Any) -> nn.Module:
        """``apply_linear_cross_entropy(model, **options)`` returning the model (for one-line use)."""
        apply_linear_cross_entropy(model, **options)
        return model

    def inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by name (positional ones bound to the original forward's signature)."""
        if not args:
            return dict(kwargs)
        bound = self.signature.bind_partial(*args, **kwargs)
        named: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            kind = self.signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_KEYWORD:
                named.update(value)
            elif kind is inspect.Parameter.VAR_POSITIONAL:
                raise ValueError("linear_cross_entropy: the model takes *args; call it with keyword arguments")
            else:
                named[name] = value
        return named

    def loss(self, inputs: dict[str, Any]) -> Any:
        labels = inputs.pop("labels")
        num_items = inputs.pop("num_items_in_batch", None)
        shifted = inputs.pop("shift_labels", None)
        for key in _DROPPED:
            inputs.pop(key, None)
        if self.decoder_inputs is not None and inputs.get("decoder_input_ids") is None \
                and inputs.get("decoder_inputs_embeds") is None:
            inputs["decoder_input_ids"] = self.decoder_inputs(labels)  # what the model does with its labels
        if self.verify and self.verified == "not yet":
            self.verified = self._check(inputs)
        self.calls += 1
        hidden = self.source.hidden(inputs)
        if shifted is None:  # an encoder-decoder's labels are aligned with its decoder's outputs: never shifted
            shifted = shift_targets(labels) if self.source.shift and self.decoder_inputs is None else labels
        targets = shifted
        head = self.source.head
        total = linear_cross_entropy(
            hidden, head.weight, targets.to(hidden.device), bias=getattr(head, "bias", None), reduction="sum",
            chunk_tokens=self.chunk_tokens, transform=self.source.transform, label_smoothing=self.label_smoothing,
            z_loss=self.z_loss, impl=self.impl, recompute=self.recompute)
        if num_items is not None:  # the model's own convention: sum / num_items_in_batch (HF's fixed_cross_entropy)
            divisor = num_items.to(total.device) if isinstance(num_items, Tensor) else num_items
        else:
            divisor = (targets != IGNORE_INDEX).sum().clamp(min=1).to(total.device)
        return self.source.make_output(total / divisor)

    def _check(self, inputs: dict[str, Any]) -> str:
        """Probe what the forward does after the head (the transform the chunks then apply: vlmfast/common/
        logit_head.py), and check on the probed positions that the head receives what this path computes (the base
        model's output) and that it is ``h @ W.T (+ b)``."""
        if self.source.base is None and not self.source.captured:
            return "not needed (the model declares hidden_states_for_loss)"
        head = self.source.head
        outputs: list[Tensor] = []
        watch = self.source.base.register_forward_hook(
            lambda _module, _args, out: outputs.append(_last_hidden(out))) if self.source.base is not None else None
        try:
            probe = probe_logit_head(self.original, head, inputs)
        finally:
            if watch is not None:
                watch.remove()
        received = probe.head_input
        if outputs:
            _agree(outputs[0][..., -received.shape[-2]:, :], received, "the base model's output is not what the head "
                   "receives: the model transforms its hidden states between them")
        with torch.no_grad():
            ours = F.linear(received, head.weight, getattr(head, "bias", None))
        _agree(ours, probe.head_output, f"{type(unwrap_model(head)).__name__} is not a plain linear head "
               "(h @ W.T + b) on what it receives")
        self.source.transform = probe.transform
        if self.impl != "torch" and not probe.transform.plain and self.impl_auto:
            self.impl = "torch"  # the fused kernels know no bias after the head nor a mask
        return "yes"

    def describe(self) -> str:
        t = self.source.transform
        extras = [f"after the head: {t}"] if self.verified == "yes" else []
        extras += [f"label smoothing {self.label_smoothing:g}"] if self.label_smoothing else []
        extras += [f"z-loss {self.z_loss:g}"] if self.z_loss else []
        how = "logits recomputed in backward" if self.recompute else "gradients computed in forward"
        chunks = f"chunks of {self.chunk_tokens} tokens, {how}" if self.impl == "torch" else "fused kernel"
        extra = f", {', '.join(extras)}" if extras else ""
        return (f"linear cross-entropy: {self.impl} ({chunks}{extra}), logits never materialised; "
                f"{self.source.kind} model; checked against its own logits: {self.verified}")


def _last_hidden(output: Any) -> Tensor:
    return output.last_hidden_state if hasattr(output, "last_hidden_state") else output[0]


def _agree(ours: Tensor, theirs: Tensor, what: str) -> None:
    """Refuse, naming ``what``, unless the two agree within their precision (bf16 autocast: 3e-2, else 1e-4)."""
    error = float((ours.to(theirs.dtype) - theirs).abs().max() / theirs.abs().max().clamp(min=1e-6))
    if not math.isfinite(error) or error > tolerance_of(ours, theirs):
        raise ValueError(f"linear_cross_entropy: {what} (relative difference {error:.2e}), so the chunked loss "
                         "would train another objective. Set linear_cross_entropy.enabled: false, or compute the loss "
                         "in your own loss_fn with vlmfast.hooks.linear_cross_entropy")


def _chunked_forward(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """Replacement ``forward``: the chunked loss when labels are given, the original forward otherwise."""
    state: ChunkedLossModel = self._vlmfast_lce
    inputs = state.inputs(args, kwargs)
    if inputs.get("labels") is None:
        return state.original(*args, **kwargs)
    return state.loss(inputs)


def apply_linear_cross_entropy(
    model: nn.Module,
    *,
    chunk_tokens: int | None = None,
    impl: Impl = "auto",
    label_smoothing: float = 0.0,
    z_loss: float = 0.0,
    verify: bool = True,
    recompute: bool = True,
) -> ChunkedLossModel:
    """Make ``model(**batch)`` with labels return the chunked loss (same value and gradients, no logits).

    Usage: ``state = apply_linear_cross_entropy(model); loss = model(**batch).loss; state.describe()``

    The forward is replaced on the instance (parameters, names and ``state_dict`` unchanged; calling it twice
    re-configures). Without labels the original forward runs (generation, logits). ``num_items_in_batch`` is
    honoured as the model's own loss honours it.
    """
    model = loss_owner(model)  # a PEFT model: its wrapped model, whose forward its own forward calls
    previous: ChunkedLossModel | None = getattr(model, "_vlmfast_lce", None)
    original = previous.original if previous is not None else model.forward
    source = _source(model, original)
    weight = source.head.weight
    state = ChunkedLossModel(
        source=source, original=original, signature=inspect.signature(original),
        chunk_tokens=chunk_tokens or auto_chunk_tokens(weight.shape[0]),
        impl=resolve_impl(impl, weight.device), label_smoothing=label_smoothing, z_loss=z_loss, verify=verify,
        recompute=recompute, decoder_inputs=_decoder_inputs_from_labels(model), impl_auto=impl == "auto")
    model._vlmfast_lce = state
    model.forward = types.MethodType(_chunked_forward, model)
    return state


# ----------------------------------------------------------------------------------------------------------------
# the trainer strategy


class LinearCrossEntropy(Strategy):
    """The ``linear_cross_entropy`` spec section as a trainer strategy.

    Usage: ``model = LinearCrossEntropy(spec.linear_cross_entropy).apply(model)``
    """

    name = "linear_cross_entropy"

    def __init__(self, spec: LinearCrossEntropySpec) -> None:
        self.spec = spec
        self.state: ChunkedLossModel | None = None

    def apply(self, model: nn.Module) -> nn.Module:
        if self.spec.enabled:
            s = self.spec
            self.state = apply_linear_cross_entropy(model, chunk_tokens=s.chunk_tokens, impl=s.impl,
                                                    label_smoothing=s.label_smoothing, z_loss=s.z_loss,
                                                    verify=s.verify, recompute=s.recompute)
        return model

    def describe(self) -> str:
        return self.state.describe() if self.state is not None else ""
