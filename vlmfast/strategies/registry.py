"""Which strategies a spec turns on, built in the order the loop calls them.

Adding a strategy: a new file (its spec section, a plain function, a thin class with a `from_spec`), its section in
:class:`vlmfast.spec.TrainSpec`, and one line in :data:`OPTIONAL_STRATEGIES`. The loop is not touched.

Usage::

    strategies = build_strategies(spec, BuildContext(device=device, world_size=1))
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from vlmfast.common.utils import unwrap_model
from vlmfast.data.batch_layout import BatchLayout
from vlmfast.engines import engine_traits
from vlmfast.strategies import oom
from vlmfast.strategies.activation_checkpointing import ActivationCheckpointing
from vlmfast.strategies.attention import AttentionBackend
from vlmfast.strategies.base import Strategy
from vlmfast.strategies.clipping import GradientClipping
from vlmfast.strategies.compile import TorchCompile
from vlmfast.strategies.ema import EMA
from vlmfast.strategies.linear_cross_entropy import LinearCrossEntropy
from vlmfast.strategies.nonfinite import NonFiniteGuard
from vlmfast.strategies.token_budget import TokenBudgetSizer, image_token_cost
from vlmfast.strategies.vision_cache import VisionCache


@dataclass
class BuildContext:
    """What strategies may need besides the spec."""

    device: torch.device
    world_size: int = 1
    # A few training batches (collated samples, on the device), for strategies that learn from a forward
    probe_batches: Callable[[], Iterable[Any]] | None = None
    # The first few training samples collated together (padded), on the device; None when none can be spared
    probe_batch: Callable[[], Any] | None = None


def _lora(spec: Any, ctx: BuildContext) -> Strategy | None:
    if not spec.lora.enabled:
        return None
    from vlmfast.strategies.lora import LoRA

    return LoRA(spec.lora, ctx.probe_batches)


def _attention(spec: Any, ctx: BuildContext) -> Strategy | None:
    return AttentionBackend(spec.attention, precision=spec.precision) if spec.attention.backend is not None else None


def _vision_cache(spec: Any, ctx: BuildContext) -> Strategy | None:
    if not spec.vision_cache.enabled:
        return None
    if engine_traits(spec, max(ctx.world_size, 2)).shards_parameters:
        # A sharded tower all-gathers its weights in forward: a rank whose images all hit would skip collectives
        # that the other ranks wait in.
        raise ValueError("vision_cache.enabled does not work with an engine that shards the weights (engine: fsdp, "
                         "or deepspeed.zero_stage: 3): ranks that hit the cache would skip the tower's all-gathers; "
                         "use engine: ddp, or deepspeed.zero_stage <= 2")
    data = spec.data
    preprocessing = {"device_image_size": data.device_image_size, "image_key": data.image_key,
                     "image_mean": data.image_mean, "image_std": data.image_std} if data.device_image_size else {}
    return VisionCache(spec.vision_cache, preprocessing, ctx.probe_batches)


def _embedding_packing(spec: Any, ctx: BuildContext) -> Strategy | None:
    if not spec.packing.packs_embeddings:
        return None
    from vlmfast.strategies.embedding_packing import PackEmbeddings

    return PackEmbeddings(spec.packing, ctx.probe_batch)


def _modality_sync(spec: Any, ctx: BuildContext) -> Strategy | None:
    # Several ranks whose backward reduces (not DDP under the OOM fallback, which averages by hand after the ranks
    # agree): a rank whose micro-batch has no image still runs the image path (weight 0) when another's has.
    # DDP with find_unused_parameters already reduces zeros for a skipped tower.
    traits = engine_traits(spec, ctx.world_size)
    if not traits.reduces_in_backward or traits.reduces_unused_parameters:
        return None
    from vlmfast.strategies.modality_sync import ModalitySync

    return ModalitySync(ctx.probe_batches, every_forward=traits.shards_parameters,
                        always=traits.needs_every_parameter)


def _activation_checkpointing(spec: Any, ctx: BuildContext) -> Strategy | None:
    # After the optimizer's freezing (the loop applies it first): frozen towers keep no graph.
    if not spec.activation_checkpointing.enabled:
        return None
    return ActivationCheckpointing(spec.activation_checkpointing, micro_batch_size=spec.resolved_micro_batch_size,
                                   micro_batch_tokens=spec.micro_batch_tokens, precision=spec.precision,
                                   chunked_loss=spec.linear_cross_entropy.enabled)


def _linear_cross_entropy(spec: Any, ctx: BuildContext) -> Strategy | None:
    # Before compile (it traces the replaced forward); after checkpointing (independent of it).
    return LinearCrossEntropy(spec.linear_cross_entropy) if spec.linear_cross_entropy.enabled else None


def _clipping(spec: Any, ctx: BuildContext) -> Strategy | None:
    return GradientClipping(spec.grad_clip) if spec.grad_clip else None


def _nonfinite(spec: Any, ctx: BuildContext) -> Strategy | None:
    return NonFiniteGuard(spec.loss)


def _compile(spec: Any, ctx: BuildContext) -> Strategy | None:
    # Last to apply: it traces the checkpointed blocks; the engine (DDP) wraps the compiled model.
    return TorchCompile(spec.compile) if spec.compile.enabled else None


def _ema(spec: Any, ctx: BuildContext) -> Strategy | None:
    return EMA(spec.ema) if spec.ema.enabled else None


# In order: `apply` runs top to bottom, and so does every step point (clipping after the loss corrections).
OPTIONAL_STRATEGIES: list[Callable[[Any, BuildContext], Strategy | None]] = [
    _lora,  # first: every other strategy sees the adapted model (frozen base, trainable adapters)
    _attention,
    _modality_sync,  # before the cache, checkpointing and compile: it learns the plain model's image path
    _vision_cache,  # before checkpointing and compile: they wrap the tower the cache stands in for
    _embedding_packing,  # after the cache (whose probes run unpacked), before checkpointing, the chunked loss, compile
    _activation_checkpointing,
    _linear_cross_entropy,
    _clipping,
    _nonfinite,
    _compile,
    _ema,
]


def build_strategies(spec: Any, ctx: BuildContext) -> list[Strategy]:
    """The optional strategies `spec` turns on, in the order of :data:`OPTIONAL_STRATEGIES`."""
    return [s for build in OPTIONAL_STRATEGIES if (s := build(spec, ctx)) is not None]


def build_micro_batching(spec: Any, model: Any = None, *, describe_memory: Callable[[], str] | None = None,
                         on_oom: Callable[[], None] | None = None) -> Strategy:
    """The loop's micro-batch sizer for a whole spec: by tokens when ``micro_batch_tokens`` is set, else the
    micro-batch-size sizer of ``vlmfast.strategies.oom``.

    Usage (the loop): ``self.micro_batching = build_micro_batching(spec, model, describe_memory=..., on_oom=...)``

    Images are charged :func:`image_token_cost` (vision-tower) tokens each; a model that prepends image tokens to
    its padded rows (``prepended_image_tokens``) has them added to the rows' lengths.
    """
    if spec.micro_batch_tokens is None:
        return oom.build_micro_batching(spec.oom, spec.resolved_micro_batch_size, describe_memory=describe_memory,
                                        on_oom=on_oom)
    image_tokens = image_token_cost(model) if model is not None else 0
    # Packed rows hold an image's language-model tokens as placeholders; padded rows of a model that prepends them
    # itself (the tiny VLM) do not, so they are added to the rows' lengths.
    prepended = 0 if spec.packing.packs_ids or model is None else int(
        getattr(unwrap_model(model), "prepended_image_tokens", 0) or 0)
    return TokenBudgetSizer(spec.micro_batch_tokens, max_rows=spec.micro_batch_size, image_tokens=image_tokens,
                            prepended_tokens=prepended, layout=BatchLayout.from_model(model), oom=spec.oom,
                            describe_memory=describe_memory, on_oom=on_oom)
