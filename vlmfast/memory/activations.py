"""Activation measurement: what autograd saves for backward during a probe forward, the built-in probes, checkpointing.

Usage: ``m = measure_saved_activations(model, lambda: model(**batch).loss); m.full(), m.checkpointed({0, 1})``

Activations are the storages autograd saves for backward (each storage once; parameters and buffers left out),
measured during a probe forward at micro-batch 1 and 2 and extrapolated linearly (the part that does not grow with
the batch, such as autocast's 16-bit weight copies, stays fixed). Hugging Face models built on the meta device cost
nothing to probe: shapes and dtypes are all that is needed. With ``activation_checkpointing`` the same probe tells
what checkpointing keeps: every repeated block's inputs (``nn.ModuleList`` of one class, as
``vlmfast.strategies.activation_checkpointing`` selects them) plus everything saved outside the blocks, plus one block's
internals, recomputed during backward. Measured with hooks rather than by applying checkpointing, because
non-reentrant checkpointing holds the block inputs in its recomputation closure, out of sight of saved-tensor hooks,
and because an estimate should not rewrap the user's model.

Also here: the fused-attention implementation registered for models built on the meta device, where SDPA would
otherwise fall back to the math kernel and keep the L x L scores.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._pytree import tree_leaves

__all__ = ["BatchProbe", "ModelProbe", "default_activation_probe", "measure_saved_activations",
           "repeated_blocks"]

DEFAULT_HF_SEQ_LEN = 2048  # LLaVA-1.5's model_max_length: the longest sample the estimate must survive


class _Measurement(NamedTuple):
    """Storages saved during one probe forward, who saved them, and each repeated block's inputs."""

    sizes: dict[int, int]
    owners: dict[int, frozenset[int | None]]  # block index, None for outside any block
    inputs: dict[int, dict[int, int]]
    block_paths: tuple[str, ...]

    def full(self) -> int:
        return sum(self.sizes.values())

    def checkpointed(self, selected: set[int]) -> int:
        """Bytes kept when the selected blocks are checkpointed: their inputs, the rest, one block recomputed."""
        kept = {k: n for k, n in self.sizes.items() if not self.owners[k] <= selected}
        active = [i for i in selected if any(i in self.owners[k] for k in self.sizes)]
        for i in active:  # a block that saved nothing (frozen, no grad flowing) keeps no inputs either
            kept.update(self.inputs.get(i, {}))
        recompute = max((sum(n for k, n in self.sizes.items() if i in self.owners[k] and k not in kept)
                         for i in active), default=0)
        return sum(kept.values()) + recompute


def storage_key(tensor: torch.Tensor) -> tuple[int, int]:
    """(key, bytes) of a tensor's storage; the key also tells meta storages apart, whose data_ptr is 0."""
    try:
        storage = tensor.untyped_storage()
        return storage._cdata, storage.nbytes()
    except (RuntimeError, NotImplementedError, TypeError):  # tensor subclasses without a plain storage
        return id(tensor), tensor.numel() * tensor.element_size()


@contextlib.contextmanager
def tracking_blocks(blocks: Sequence[tuple[str, nn.Module]], resident: set[int], keep: list[torch.Tensor],
                    stack: list[int], inputs: list[dict[int, int]]) -> Iterator[None]:
    """While active, ``stack[-1]`` is the index of the block running (``stack`` is empty outside every block) and
    ``inputs[i]`` collects the non-resident storages block i receives, each held in ``keep`` (so a freed address is
    not reused by a later storage and counted once for two)."""
    def enter(index: int) -> Callable[..., None]:
        def hook(_module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            stack.append(index)
            for leaf in tree_leaves((args, kwargs)):
                if isinstance(leaf, torch.Tensor) and (key_bytes := storage_key(leaf))[0] not in resident:
                    keep.append(leaf)
                    inputs[index][key_bytes[0]] = key_bytes[1]
        return hook

    def leave(*_: Any) -> None:
        if stack:
            stack.pop()

    handles = []
    try:
        for i, (_, block) in enumerate(blocks):
            handles.append(block.register_forward_pre_hook(enter(i), with_kwargs=True))
            handles.append(block.register_forward_hook(leave, always_call=True))
        yield
    finally:
        for handle in handles:
            handle.remove()


def repeated_blocks(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """The blocks activation checkpointing wraps: members of outermost ModuleLists of one module class.

    Usage: ``[name for name, _ in repeated_blocks(model)]`` -> ``['vision_tower.blocks.0', ...]``
    """
    from vlmfast.common.module_tree import find_repeated_blocks  # the strategy's own choice: they agree

    return [(f"{path}.{i}", block) for path, mlist in find_repeated_blocks(model).items()
            for i, block in enumerate(mlist)]


def measure_saved_activations(
    model: nn.Module, run: Callable[[], Any], blocks: Sequence[tuple[str, nn.Module]] | None = None
) -> _Measurement:
    """Record the storages autograd saves while ``run()`` does a forward pass, and which block saved them.

    Usage: ``m = measure_saved_activations(model, lambda: model(**batch).loss); m.full(), m.checkpointed({0, 1})``

    Parameters and buffers are left out (they are resident anyway). Every saved tensor is held until the end, so a
    freed storage's address cannot be reused by a later one and be counted once for two.
    """
    blocks = repeated_blocks(model) if blocks is None else list(blocks)
    resident = {storage_key(t)[0] for t in (*model.parameters(), *model.buffers())}
    sizes: dict[int, int] = {}
    owners: dict[int, set[int | None]] = {}
    inputs: list[dict[int, int]] = [{} for _ in blocks]
    stack: list[int] = []
    keep: list[torch.Tensor] = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        key, nbytes = storage_key(tensor)
        if key not in resident:
            keep.append(tensor)
            sizes[key] = nbytes
            owners.setdefault(key, set()).add(stack[-1] if stack else None)
        return tensor

    with (tracking_blocks(blocks, resident, keep, stack, inputs), torch.enable_grad(),
          torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor)):
        result = run()
    del result
    keep.clear()
    return _Measurement(sizes, {k: frozenset(v) for k, v in owners.items()}, dict(enumerate(inputs)),
                        tuple(p for p, _ in blocks))


@dataclass
class ModelProbe:
    """A forward pass of the model at a micro-batch size and sequence length (image + text tokens).

    Usage: ``probe = default_activation_probe(model); loss = probe(2, seq_len=512)``
    """

    run: Callable[..., Any]  # (micro_batch_size, seq_len, chunked_loss) -> loss
    default_seq_len: int
    max_seq_len: int | None = None
    includes_images: bool = True  # False: a VLM probed with text only (its images' activations are not in it)

    def __call__(self, micro_batch_size: int, seq_len: int | None = None, chunked_loss: bool = False) -> Any:
        """The probe's loss; ``chunked_loss``: the head and loss by ``linear_cross_entropy`` (no full logits)."""
        seq_len = seq_len or self.default_seq_len
        if self.max_seq_len is not None and seq_len > self.max_seq_len:
            raise ValueError(f"seq_len {seq_len} exceeds the model's {self.max_seq_len} positions")
        return self.run(micro_batch_size, seq_len, chunked_loss)


def _first_param(model: nn.Module) -> torch.Tensor:
    return next((p for p in model.parameters() if p.is_floating_point()), torch.empty(0))


def _lm_loss(logits: torch.Tensor) -> torch.Tensor:
    # float32 like Hugging Face's loss: the upcast logits are part of what training keeps.
    flat = logits[:, :-1].float().reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, torch.zeros(flat.shape[0], dtype=torch.long, device=flat.device))


def _chunked_lm_loss(hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
    """The loss ``linear_cross_entropy`` computes from the hidden states: what it keeps instead of the logits."""
    from vlmfast.strategies.linear_cross_entropy import linear_cross_entropy

    targets = torch.zeros(hidden.shape[:-1], dtype=torch.long, device=hidden.device)
    targets[:, -1] = -100  # the shift: the last position predicts nothing
    return linear_cross_entropy(hidden, head.weight, targets, bias=getattr(head, "bias", None), reduction="mean")


def _tiny_vlm_probe(model: nn.Module) -> ModelProbe:
    cfg = model.config

    def run(mbs: int, seq_len: int, chunked_loss: bool = False) -> Any:
        device = _first_param(model).device
        text_len = seq_len - cfg.num_image_tokens
        if text_len < 2:
            raise ValueError(f"seq_len {seq_len} leaves no text after {cfg.num_image_tokens} image tokens")
        # Zeros: what is saved depends on shapes only, and the caller's random stream stays untouched.
        pixels = torch.zeros(mbs, 3, cfg.image_size, cfg.image_size, device=device)
        ids = torch.zeros(mbs, text_len, dtype=torch.long, device=device)
        if chunked_loss:
            return _chunked_lm_loss(model.hidden_states_for_loss(pixels, ids), model.get_output_embeddings())
        return model(pixels, ids, labels=ids).loss

    return ModelProbe(run, cfg.max_positions, cfg.max_positions)


def _submodule(model: nn.Module, *paths: str) -> nn.Module | None:
    for path in paths:
        with contextlib.suppress(AttributeError):
            return model.get_submodule(path)
    return None


def _llava_probe(model: nn.Module, vision: nn.Module, projector: nn.Module, lm: nn.Module) -> ModelProbe:
    cfg = model.config
    layer = cfg.vision_feature_layer
    head = getattr(model, "lm_head", None)

    def run(mbs: int, seq_len: int, chunked_loss: bool = False) -> Any:
        param = _first_param(model)
        size = cfg.vision_config.image_size
        pixels = torch.zeros(mbs, 3, size, size, device=param.device, dtype=param.dtype)
        states = vision(pixels, output_hidden_states=True).hidden_states
        feats = torch.cat([states[i] for i in layer], -1) if isinstance(layer, (list, tuple)) else states[layer]
        if getattr(cfg, "vision_feature_select_strategy", "default") == "default":
            feats = feats[:, 1:]  # drop CLS, as LLaVA does
        image = projector(feats)
        text_len = seq_len - image.shape[1]
        if text_len < 2:
            raise ValueError(f"seq_len {seq_len} leaves no text after {image.shape[1]} image tokens")
        ids = torch.zeros(mbs, text_len, dtype=torch.long, device=param.device)
        text = lm.get_input_embeddings()(ids)
        out = lm(inputs_embeds=torch.cat([image.to(text.dtype), text], 1))
        if chunked_loss and not hasattr(out, "logits"):
            return _chunked_lm_loss(out[0], head)
        logits = out.logits if hasattr(out, "logits") else head(out[0])
        return _lm_loss(logits)

    return ModelProbe(run, DEFAULT_HF_SEQ_LEN, _max_positions(cfg.text_config))


def _max_positions(cfg: Any) -> int | None:
    return getattr(cfg, "max_position_embeddings", None)


def _causal_lm_probe(model: nn.Module) -> ModelProbe:
    limit = _max_positions(model.config)

    def run(mbs: int, seq_len: int, chunked_loss: bool = False) -> Any:
        ids = torch.zeros(mbs, seq_len, dtype=torch.long, device=_first_param(model).device)
        base = getattr(model, getattr(model, "base_model_prefix", ""), None)
        if chunked_loss and isinstance(base, nn.Module) and base is not model:
            return _chunked_lm_loss(base(input_ids=ids)[0], model.get_output_embeddings())
        return _lm_loss(model(input_ids=ids).logits)

    return ModelProbe(run, min(limit or DEFAULT_HF_SEQ_LEN, DEFAULT_HF_SEQ_LEN), limit)


def default_activation_probe(model: nn.Module) -> ModelProbe | None:
    """A probe for the models vlmfast knows: its tiny VLM, LLaVA-style and causal-LM Hugging Face models.

    Usage: ``probe = default_activation_probe(model)`` (None for other models: pass ``activation_probe``)
    """
    from vlmfast.models.tiny_vlm import TinyVLM

    if isinstance(model, TinyVLM):
        return _tiny_vlm_probe(model)
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(model, "get_input_embeddings"):
        return None
    if hasattr(cfg, "vision_config") and hasattr(cfg, "vision_feature_layer"):
        vision = _submodule(model, "model.vision_tower", "vision_tower")
        projector = _submodule(model, "model.multi_modal_projector", "multi_modal_projector")
        lm = _submodule(model, "model.language_model", "language_model")
        if vision is not None and projector is not None and lm is not None:
            return _llava_probe(model, vision, projector, lm)
        return None
    if not hasattr(model, "lm_head"):
        return None
    probe = _causal_lm_probe(model)
    probe.includes_images = not hasattr(cfg, "vision_config")  # a VLM run as text: images not measured
    return probe


class BatchProbe:
    """A probe from one real batch, images included: its first ``k`` samples as a micro-batch, split by sample
    (``vlmfast.data.micro_batches``: images stay with their samples), on the model's device.

    It is measured at half the batch and at the whole batch (``probe_sizes``), so the per-sample slope is the
    batch's average rather than one sample's (samples differ: text-only, two images...).
    Usage: ``estimate_memory(model, activation_probe=collate(samples))`` (a collated batch or a SampleBatch)
    """

    def __init__(self, model: nn.Module, batch: Any) -> None:
        from vlmfast.data.batch import batch_size_of
        from vlmfast.data.batch_layout import BatchLayout

        self.model, self.batch = model, batch
        self.layout = BatchLayout.from_model(model)
        try:
            self.samples = batch_size_of(batch)
        except TypeError:
            raise ValueError("activation_probe: a batch needs at least one tensor with a batch dimension") from None
        self.probe_sizes = (max(1, self.samples // 2), self.samples) if self.samples > 1 else (1,)
        self.includes_images = True  # whatever the batch holds is what the model trains on

    def micro_batch(self, samples: int) -> Any:
        """The batch's first ``samples`` samples (at most the batch), as the model takes them."""
        from vlmfast.data.batch_layout import split_collated
        from vlmfast.data.micro_batches import SampleBatch

        samples = min(samples, self.samples)
        if isinstance(self.batch, SampleBatch):  # collated here: the batch's own micro-batches stay as they are
            return self.batch.first(samples)
        return split_collated(self.batch, samples, self.layout)[0]

    def __call__(self, micro_batch_size: int) -> Any:
        from accelerate.utils import send_to_device

        from vlmfast.models.outputs import call_model

        part = send_to_device(self.micro_batch(micro_batch_size), _first_param(self.model).device)
        return call_model(self.model, part)


def _batch_probe(model: nn.Module, batch: Any) -> BatchProbe:
    return BatchProbe(model, batch)


def _accepts_seq_len(probe: Callable[..., Any]) -> bool:
    if isinstance(probe, ModelProbe):
        return True
    try:
        return "seq_len" in inspect.signature(probe).parameters
    except (TypeError, ValueError):
        return False


# ----------------------------------------------------------------------------------------------------------------
# fused attention for meta-device probes

_PROBE_ATTENTION = "vlmfast_fused_probe"


def _fused_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                     is_causal: bool | None = None, **_: Any) -> tuple[torch.Tensor, None]:
    """Attention that saves what CUDA's flash / memory-efficient SDPA kernels save (q, k, v, out, logsumexp).

    On the meta device SDPA falls back to the math kernel, which keeps the L x L scores: an estimate built on it
    would charge a GPU run for memory its fused kernels never use.
    """
    if key.shape[1] != query.shape[1]:  # grouped-query attention, expanded as Hugging Face's SDPA path does
        repeat = query.shape[1] // key.shape[1]
        key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
    causal = bool(getattr(module, "is_causal", False)) if is_causal is None else is_causal
    out = torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout, causal, False, scale=scaling)
    return out[0].transpose(1, 2).contiguous(), None


def _register_probe_attention() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(_PROBE_ATTENTION, _fused_attention)
    return _PROBE_ATTENTION
