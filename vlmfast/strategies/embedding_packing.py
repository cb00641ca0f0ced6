"""Packing by embeddings: pack what the language model receives, whatever made it.

Id-level packing (:mod:`vlmfast.data.packing`) packs ``input_ids`` in the loader, so it must know each family's
image convention (placeholders, query tokens, patch layouts, per-sample keys). This strategy packs one step later,
where every family agrees: at the entry of the language model, the module that receives ``inputs_embeds`` from the
model's own embedding and image-merge code (found by probing a forward, never by name; a model that merges its
images inside the module that embeds the ids has that module packed, its images following the runs of its image
tokens). For each call with a padded batch, a forward pre-hook unpads the rows (the 2-D ``attention_mask``), packs
them into rows of at most ``packing.max_tokens`` (:class:`vlmfast.data.packed_rows.RowLayout`) with per-document
positions (multi-axis mRoPE positions: each token's own, plus restarting text positions in channel 0) and attention
kept inside each document (positions that restart; a 4-D mask the model built, gathered per document; or, for a
model whose mask ignores positions, an explicit document mask, chosen by measurement); a forward hook scatters the
outputs back to the padded layout, so the head, the loss, the chunked cross-entropy and everything after see what
they see without packing. Gradients flow through the same gather and scatter, exactly.

Where it runs: inside the step, on the device, for each micro-batch. The loader, micro-batches, the token budget and
the OOM re-split work on padded samples as without packing (the micro-batch is what gets packed); the vision cache
stands in for the tower before the merge, untouched. The saving is the language model's: its layers run on
``sum(lengths)`` tokens in ``rows x width`` instead of ``batch x longest``; the price is one host read of the
lengths per micro-batch (the plan is host work) and the gather/scatter.

Usage::

    packing = EmbeddingPacking(max_tokens=2048)
    packing.install(model, probe_batch)      # finds the language model; check(model, batch) measures exactness
    loss = model(**padded_batch).loss         # its language model ran on packed rows
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from vlmfast.common.utils import unwrap_model
from vlmfast.data.batch_layout import BatchLayout
from vlmfast.data.packed_rows import RowLayout
from vlmfast.data.packing import Algorithm, PackingError, disable_kv_cache
from vlmfast.strategies.base import Strategy

if TYPE_CHECKING:
    from vlmfast.spec import PackingSpec

log = logging.getLogger(__name__)

__all__ = ["EmbeddingPacking", "PackEmbeddings", "find_language_model"]

_CACHES = ("cache", "past_key_values")  # a cache means generation: nothing to pack
_DROPPED = ("cache_position",)  # positions of the padded rows; the packed call makes its own
_HALF = -2  # a row budget for the check: half the call's tokens (two rows of several documents each)


def _refuse(what: str) -> PackingError:
    return PackingError(f"packing.level: embeddings: {what}; use packing.level: ids (where exact) or set "
                        "packing.enabled: false")


def find_language_model(model: nn.Module, batch: Mapping[str, Any]) -> nn.Module:
    """The language model behind the model's own embedding and image merge, learned from a forward of ``batch``:
    the outermost module that receives ``inputs_embeds`` made from the batch's token embeddings and produces what
    the output head reads (it is running when the head runs, or its output is the head's input). Found by
    autograd, not by name: during the probe only the outputs of the embeddings that read ``input_ids`` require
    grad, so a vision encoder's ``inputs_embeds`` (patches) do not qualify, and the head rule leaves out a merge
    module that takes and returns embeddings (Phi-4's ``embed_tokens_extend``). A text model's base model, which
    receives the ids themselves, qualifies too. Refused, naming why, when nothing does (Chameleon: its images
    become token ids inside the module that embeds them).

    Usage: ``lm = find_language_model(model, batch)``
    """
    root = unwrap_model(model)
    ids = batch.get("input_ids") if isinstance(batch, Mapping) else None
    if not isinstance(ids, Tensor):
        what = f"keys {sorted(batch)}" if isinstance(batch, Mapping) else f"a {type(batch).__name__}"
        raise _refuse(f"needs batches with token sequences (input_ids [B, T]); the collate_fn gives {what}")
    config = getattr(root, "config", None)
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    if any(getattr(c, "is_encoder_decoder", False) for c in (config, text)):
        raise _refuse(f"{type(root).__name__} is an encoder-decoder: its head reads the decoder, whose cross-attention "
                      "reaches the whole encoder row, so packed encoder documents would see each other")
    probe = _Probe(root, tuple(ids.shape))
    frozen = [p for p in root.parameters() if p.requires_grad]
    modes = {m: m.training for m in root.modules()}
    try:
        for p in frozen:
            p.requires_grad_(False)
        root.eval()  # no running statistics move, no dropout draws
        # Autograd only marks what comes from the token embeddings: nothing is saved for a backward that never runs
        with torch.enable_grad(), torch.random.fork_rng(devices=_cuda_devices(root)), \
                torch.autograd.graph.saved_tensors_hooks(lambda _t: None, lambda _t: None):
            root(**batch)
    finally:
        for p in frozen:
            p.requires_grad_(True)
        for m, training in modes.items():
            m.training = training
        probe.remove()
    found = probe.language_model()
    if found is None:
        raise _refuse(f"no module of {type(root).__name__} receives inputs_embeds made from its token embeddings and "
                      "produces what its head reads: its images reach the module that embeds the ids (they become "
                      "token ids, or cross-attention states, inside it), or it runs its decoder layers itself after "
                      "merging, so there is no language model call to pack")
    return found


class _Probe:
    """Hooks for :func:`find_language_model`: marks token embeddings, notes the candidates in call order, which
    of them run while the head runs, and their outputs."""

    def __init__(self, root: nn.Module, shape: tuple[int, ...]) -> None:
        self.shape = shape
        self.by_embeds: list[nn.Module] = []
        self.by_ids: list[nn.Module] = []
        self.running: list[nn.Module] = []
        self.outputs: dict[int, Tensor] = {}
        self.at_head: tuple[list[nn.Module], Tensor | None] | None = None
        head = root.get_output_embeddings() if callable(getattr(root, "get_output_embeddings", None)) else None
        self.head = head if isinstance(head, nn.Module) else None
        self.handles = [m.register_forward_hook(_mark_token_embeddings(shape))
                        for m in root.modules() if isinstance(m, nn.Embedding)]
        for m in root.modules():
            if m is not root and "inputs_embeds" in _parameters(m):
                self.handles += [m.register_forward_pre_hook(self._enter, with_kwargs=True),
                                 m.register_forward_hook(self._leave, always_call=True)]
        if self.head is not None:
            self.handles.append(self.head.register_forward_pre_hook(self._head))

    def _enter(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        named = _bound(module, args, kwargs)
        embeds, ids = named.get("inputs_embeds"), named.get("input_ids")
        if isinstance(embeds, Tensor) and embeds.dim() == 3 and embeds.requires_grad:
            self.by_embeds.append(module)
        elif isinstance(ids, Tensor) and tuple(ids.shape) == self.shape:
            self.by_ids.append(module)
        else:
            return
        self.running.append(module)

    def _leave(self, module: nn.Module, _args: tuple[Any, ...], output: Any) -> None:
        if self.running and self.running[-1] is module:
            self.running.pop()
            if output is not None:
                self.outputs[id(module)] = _first_tensor(output)

    def _head(self, _module: nn.Module, args: tuple[Any, ...]) -> None:
        if self.at_head is None:
            self.at_head = (list(self.running), args[0] if args and isinstance(args[0], Tensor) else None)

    def language_model(self) -> nn.Module | None:
        """The outermost module fed merged embeddings that feeds the head; else the outermost fed the ids."""
        for candidates in (self.by_embeds, self.by_ids):
            found = next((m for m in candidates if self._feeds_head(m)), None)
            if found is not None:
                return found
        return None

    def _feeds_head(self, module: nn.Module) -> bool:
        if self.head is None or self.at_head is None:
            return True  # no head to tell by: the outermost candidate
        running, head_input = self.at_head
        output = self.outputs.get(id(module))
        return any(m is module for m in running) or (
            head_input is not None and output is not None
            and head_input.untyped_storage().data_ptr() == output.untyped_storage().data_ptr())

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _cuda_devices(model: nn.Module) -> list[torch.device]:
    """The CUDA devices the model's weights are on (their generators are forked around a probe)."""
    return sorted({p.device for p in model.parameters() if p.device.type == "cuda"}, key=str)


def _mark_token_embeddings(shape: tuple[int, ...]) -> Any:
    """Forward hook on an embedding: when it embeds token ids of the batch's shape, its output (a fresh leaf that
    requires grad) marks everything made from it."""
    def mark(_module: nn.Module, args: tuple[Any, ...], output: Tensor) -> Tensor | None:
        ids = args[0] if args else None
        if isinstance(ids, Tensor) and tuple(ids.shape) == shape and not ids.is_floating_point():
            return output.detach().requires_grad_().clone()  # not a leaf: the model may write into it
        return None
    return mark


def _parameters(module: nn.Module) -> Mapping[str, inspect.Parameter]:
    try:
        return inspect.signature(module.forward).parameters
    except (TypeError, ValueError):
        return {}


def _bound(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """The call's arguments by name (positional ones bound to the forward's signature, ``**kwargs`` flattened)."""
    if not args:
        return dict(kwargs)
    signature = inspect.signature(module.forward)
    named: dict[str, Any] = {}
    for name, value in signature.bind_partial(*args, **kwargs).arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            raise _refuse(f"{type(module).__name__}.forward takes *{name}")
        else:
            named[name] = value
    return named


@dataclass
class EmbeddingPacking:
    """Packs a language model's input rows (see the module docstring); ``install`` once, then every call packs.

    Counters (``rows``, ``packed_tokens``, ``padded_tokens``) say what the packing saved.
    """

    max_tokens: int
    algorithm: Algorithm = "best_fit_decreasing"
    active: bool = True
    # "positions": restarting positions keep documents apart (the attention kernel reads them, flash varlen
    # included); "document mask": a 4-D mask does, for a model that builds its mask from the padding alone (OPT)
    separation: str = "positions"
    language_model: nn.Module | None = None
    calls: int = 0
    rows: int = 0
    padded_rows: int = 0  # rows the same calls had padded
    packed_slots: int = 0  # rows x width of the packed calls
    padded_slots: int = 0  # batch x length the same calls had padded
    _layouts: list[RowLayout | None] = field(default_factory=list)
    _last: RowLayout | None = None
    image_token_ids: tuple[int, ...] = ()  # the model's (config), for images that follow their token runs
    _failures: dict[str, str] = field(default_factory=dict)
    _handles: list[Any] = field(default_factory=list)

    def install(self, model: nn.Module, batch: Mapping[str, Any]) -> nn.Module:
        """Find the language model by probing ``batch`` and hook it; returns the model (unchanged otherwise)."""
        self.remove()
        disable_kv_cache(model)  # a KV cache would be built for nothing, and would turn the packing off
        lm = find_language_model(model, batch)
        self.language_model = lm
        self.image_token_ids = BatchLayout.from_model(model).image_token_ids
        self._handles = [lm.register_forward_pre_hook(self._pack_inputs, with_kwargs=True),
                         lm.register_forward_hook(self._unpack_outputs, always_call=True)]
        return model

    def remove(self) -> None:
        """Unhook the language model (it runs on padded rows again)."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """The language model runs on the padded rows inside this block (the exactness check's reference)."""
        was, self.active = self.active, False
        try:
            yield
        finally:
            self.active = was

    # ---- the hooks --------------------------------------------------------------------------------------------

    def _pack_inputs(self, module: nn.Module, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        named = _bound(module, args, kwargs)
        rows = _token_rows(named)
        self._last = None
        if not self.active or rows is None or any(named.get(key) is not None for key in _CACHES) \
                or named.get("use_cache") is True:  # a cache being built: the model would ignore the documents
            self._layouts.append(None)
            return None
        mask = named.get("attention_mask")
        flat_mask = mask if isinstance(mask, Tensor) and mask.dim() == 2 else None
        layout = RowLayout.plan(flat_mask, self.max_tokens, shape=tuple(rows.shape[:2]), algorithm=self.algorithm,
                                halves=self.max_tokens == _HALF)
        packed = {key: self._pack_argument(key, value, named, layout) for key, value in named.items()}
        if "position_ids" not in packed:  # positions that restart per document are what keeps them apart
            packed["position_ids"] = layout.positions
        if "attention_mask" not in packed and self.separation == "document mask":
            packed["attention_mask"] = self._pack_argument("attention_mask", None, named, layout)
        if _flash_attention(self.language_model):  # Hugging Face's flash path reads positions on one row only
            cumulative, longest = layout.varlen_boundaries()
            packed.update(cu_seq_lens_q=cumulative, cu_seq_lens_k=cumulative, max_length_q=longest,
                          max_length_k=longest)
        self._layouts.append(layout)
        self._last = layout
        self.calls += 1
        self.rows += layout.rows
        self.padded_rows += layout.batch
        self.packed_slots += layout.rows * layout.width
        self.padded_slots += layout.batch * layout.length
        return (), packed

    def _pack_argument(self, key: str, value: Any, named: Mapping[str, Any], layout: RowLayout) -> Any:
        if key == "attention_mask":
            if self.separation == "document mask" and (value is None or (isinstance(value, Tensor)
                                                       and value.dim() == 2)):
                return layout.document_mask(_additive_dtype(self.language_model, _token_rows(named)))
            return _pack_attention_mask(value, layout)
        if key == "position_ids":
            return layout.pack_positions(value if isinstance(value, Tensor) else None)
        if key in _DROPPED:
            return None
        if layout.is_per_token(value):
            return layout.pack(value)
        if _is_plain(value):
            return value
        return _follow_selection(key, value, named, layout, self.image_token_ids)

    def _unpack_outputs(self, _module: nn.Module, _args: tuple[Any, ...], output: Any) -> Any:
        layout = self._layouts.pop() if self._layouts else None
        if layout is None or output is None:
            return None
        return _unpacked(output, layout)

    def check(self, model: nn.Module, batch: Mapping[str, Any]) -> float:
        """Measure, before training, that packed rows give the padded batch's outputs: ``batch`` (several samples
        of different lengths, padded) runs padded, then with every document in one row, then in two rows of
        several documents each (kernels that keep documents apart on one row only are caught), no gradient, eval
        mode, the RNG untouched; the language model's output at every real token, relative to that token's own,
        and the loss when the model returns one, must match. Restarting positions are tried first; a model that
        does not read them gets an explicit document mask (``separation``). Raises :class:`PackingError` naming
        the difference; returns it. The counters then start from zero."""
        from vlmfast.data.packing_check import HALF_TOLERANCE, TOLERANCE

        dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
        tolerance = TOLERANCE.get(dtype, HALF_TOLERANCE)
        errors: dict[str, float] = {}
        try:
            for separation in ("positions", "document mask"):
                self.separation = separation
                errors[separation] = self._difference(model, batch)
                if errors[separation] <= tolerance:
                    return errors[separation]
        finally:
            self.calls = self.rows = self.padded_rows = self.packed_slots = self.padded_slots = 0
        measured = ", ".join(f"{error:.1e} with {how}" if error != float("inf")
                             else f"failing with {how} ({self._failures.get(how)})" for how, error in errors.items())
        raise _refuse(f"not exact for {type(unwrap_model(model)).__name__}: with {_batch_rows(batch)} samples "
                      f"packed into rows its language model's outputs (or loss) differ from the padded batch's "
                      f"({measured} keeping the documents apart; tolerance {tolerance:.0e}, relative to each "
                      "token's own output): something in it is not kept per document")

    def _difference(self, model: nn.Module, batch: Mapping[str, Any]) -> float:
        """The largest per-token difference of the packed runs (one row; two rows) from the padded run."""
        lm = self.language_model
        if lm is None:
            raise RuntimeError("EmbeddingPacking.check before install")
        seen: list[Any] = []
        watch = lm.register_forward_hook(lambda _m, _a, out: seen.append((_first_tensor(out), self._last)))
        max_tokens, was_training = self.max_tokens, model.training
        model.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=_cuda_devices(model)):
                with self.paused():
                    outputs = [model(**batch)]  # the model's own failure is not packing's: it propagates
                for budget in (1 << 30, _HALF):
                    self.max_tokens = budget
                    try:
                        outputs.append(model(**batch))
                    except torch.OutOfMemoryError:
                        raise
                    except (RuntimeError, ValueError, TypeError, IndexError) as error:  # packing broke the forward
                        self._failures[self.separation] = f"{type(error).__name__}: {str(error)[:200]}"
                        return float("inf")
        finally:
            watch.remove()
            self.max_tokens = max_tokens
            model.train(was_training)
        if len(seen) != 3 or any(layout is None for _, layout in seen[1:]):
            raise _refuse(f"the language model ran {len(seen)} times for one padded and two packed forwards, or "
                          "was not packed")
        if seen[1][1].documents < 2:
            log.warning("packing.level: embeddings: not verified (the probe batch has fewer than 2 documents); "
                        "pass a Dataset with several samples")
        reference = seen[0][0]
        errors = [_token_difference(reference, ours, layout) for ours, layout in (seen[1], seen[2])]
        losses = [_loss_of(out) for out in outputs]
        if all(loss is not None for loss in losses):
            errors += [float((loss - losses[0]).abs() / losses[0].abs().clamp_min(1e-12)) for loss in losses[1:]]
        return max(errors)

    def describe(self) -> str:
        if self.language_model is None:
            return ""
        name = type(self.language_model).__name__
        if not self.calls:
            return f"packing by embeddings: {name} hooked, but no call was packed (none with token rows and no cache)"
        saved = 1 - self.packed_slots / self.padded_slots if self.padded_slots else 0.0
        return (f"packing by embeddings: {name} runs on packed rows of at most {self.max_tokens} tokens "
                f"({self.calls} calls, {self.padded_rows} padded rows as {self.rows}, {saved:.0%} of the padded "
                "positions saved)")


def _token_rows(named: Mapping[str, Any]) -> Tensor | None:
    """What the call's rows are: ``inputs_embeds`` [B, T, H], else (a text model's base) ``input_ids`` [B, T]."""
    embeds, ids = named.get("inputs_embeds"), named.get("input_ids")
    if isinstance(embeds, Tensor) and embeds.dim() == 3:
        return embeds
    return ids if isinstance(ids, Tensor) and ids.dim() == 2 and not ids.is_floating_point() else None


def _is_plain(value: Any) -> bool:
    """Arguments that do not depend on the rows: None, flags, numbers, strings, 0-d tensors."""
    if isinstance(value, Tensor):
        return value.dim() == 0
    return value is None or isinstance(value, (bool, int, float, str))


def _pack_attention_mask(mask: Any, layout: RowLayout) -> Any:
    """2-D padding mask: gone (restarting positions keep the documents apart); a 4-D mask the model built (a
    prefix-LM or sliding-window mask), or a dict of them per layer type: gathered per document."""
    if mask is None or (isinstance(mask, Tensor) and mask.dim() == 2):
        return None
    if isinstance(mask, Tensor) and mask.dim() == 4 and mask.shape[0] == layout.batch \
            and tuple(mask.shape[-2:]) == (layout.length, layout.length):
        return layout.pack_mask(mask)
    if isinstance(mask, Mapping):
        return {key: _pack_mask_entry(key, value, layout) for key, value in mask.items()}
    shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
    raise _refuse(f"the language model receives an attention_mask {shape} that has no per-document layout")


def _pack_mask_entry(key: str, value: Any, layout: RowLayout) -> Any:
    if value is None:
        raise _refuse(f"the language model receives attention_mask['{key}'] = None (a causal mask left to the "
                      "attention kernel), which cannot keep packed documents apart")
    return _pack_attention_mask(value, layout)


def _follow_selection(key: str, value: Any, named: Mapping[str, Any], layout: RowLayout,
                      image_token_ids: tuple[int, ...] = ()) -> Any:
    """Values listed in the order of a boolean per-token mask (Qwen3-VL's deepstack features under
    ``visual_pos_masks``), or one per run of image tokens in ``input_ids`` (images that become tokens inside the
    call: Chameleon's ``pixel_values``), follow their tokens; anything else cannot be laid out and is refused,
    naming it. (A count that does not match fails the forward, and the check refuses.)"""
    masks = [v for k, v in named.items() if k != "attention_mask" and layout.is_per_token(v) and v.dim() == 2
             and v.dtype == torch.bool]
    ids = named.get("input_ids")
    if not masks and image_token_ids and layout.is_per_token(ids):
        is_image = torch.isin(ids, torch.tensor(image_token_ids, device=ids.device))
        masks = [is_image & ~torch.nn.functional.pad(is_image[:, :-1], (1, 0))]  # where each image's run starts
    tensors = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(masks) == 1 and tensors and all(isinstance(t, Tensor) and t.dim() >= 1 for t in tensors):
        moved = [layout.pack_selected(masks[0], t) for t in tensors]
        return type(value)(moved) if isinstance(value, (list, tuple)) else moved[0]
    shape = tuple(value.shape) if isinstance(value, Tensor) else type(value).__name__
    raise _refuse(f"the language model's argument '{key}' {shape} is neither per token [B, T, ...] nor listed "
                  "under one boolean per-token mask, so it has no packed layout")


def _unpacked(output: Any, layout: RowLayout) -> Any:
    """The language model's output with every per-slot tensor [R, W, ...] back in the padded layout."""
    if isinstance(output, Tensor):
        return layout.unpack(output) if output.dim() >= 2 and tuple(output.shape[:2]) == (layout.rows, layout.width) \
            else output
    if isinstance(output, Mapping):  # ModelOutput: item assignment keeps its attributes in step
        for key in list(output.keys()):
            output[key] = _unpacked(output[key], layout)
        return output
    if isinstance(output, tuple):
        return type(output)(_unpacked(v, layout) for v in output) if not hasattr(output, "_fields") \
            else type(output)(*(_unpacked(v, layout) for v in output))
    return output


def _batch_rows(batch: Mapping[str, Any]) -> int:
    ids = batch.get("input_ids")
    return int(ids.shape[0]) if isinstance(ids, Tensor) else 0


def _flash_attention(module: nn.Module | None) -> bool:
    """Whether a Hugging Face module attends with a flash kernel (``flash_attention_2``/``_3``, a hub flash kernel):
    it keeps packed documents apart on several rows only when given the varlen boundaries."""
    implementation = getattr(getattr(module, "config", None), "_attn_implementation", None)
    return isinstance(implementation, str) and "flash" in implementation


def _additive_dtype(module: nn.Module | None, rows: Tensor | None) -> torch.dtype | None:
    """Eager attention adds its mask to the scores (a float mask); the kernels take a boolean one."""
    config = getattr(module, "config", None)
    eager = getattr(config, "_attn_implementation", None) == "eager"
    return (rows.dtype if rows is not None and rows.is_floating_point() else torch.float32) if eager else None


def _token_difference(reference: Tensor, ours: Tensor, layout: RowLayout) -> float:
    """The largest difference at a real token, relative to that token's own output (one large channel elsewhere
    cannot hide a document that saw another); an output of the last positions only is compared there."""
    real = (layout.target != layout.rows * layout.width).view(layout.batch, layout.length)
    kept = reference.shape[1] if reference.dim() >= 2 else 0
    real, ours = real[:, layout.length - kept:], ours[:, ours.shape[1] - kept:]
    expected, got = reference[real].float(), ours[real].float()
    if expected.dim() == 1:
        expected, got = expected[:, None], got[:, None]
    scale = expected.flatten(1).norm(dim=1).clamp_min(1e-6)
    return float(((got - expected).flatten(1).norm(dim=1) / scale).max()) if scale.numel() else 0.0


def _first_tensor(output: Any) -> Tensor:
    if isinstance(output, Tensor):
        return output
    values = output.values() if isinstance(output, Mapping) else output
    return next(v for v in values if isinstance(v, Tensor))


def _loss_of(output: Any) -> Tensor | None:
    value = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    return value.float() if isinstance(value, Tensor) else None


class PackEmbeddings(Strategy):
    """``packing: {enabled: true, level: embeddings}`` as a trainer strategy: found, hooked and checked on a few
    training samples collated together (``probe_batch``), before the engine wraps the model.

    Usage: ``model = PackEmbeddings(spec.packing, lambda: collate(samples)).apply(model)``
    """

    name = "packing"

    def __init__(self, spec: PackingSpec, probe_batch: Callable[[], Any] | None) -> None:
        self.packing = EmbeddingPacking(max_tokens=spec.max_tokens, algorithm=spec.algorithm)
        self.probe_batch = probe_batch
        self.measured: float | None = None

    def apply(self, model: nn.Module) -> nn.Module:
        batch = self.probe_batch() if self.probe_batch is not None else None
        if batch is None:
            raise _refuse("needs a few training samples before training, to find the language model and measure "
                          "that packing is exact; the training data gives none (a DataLoader or a one-shot "
                          "stream): pass a Dataset")
        self.packing.install(model, batch)
        self.measured = self.packing.check(model, batch)
        return model

    def describe(self) -> str:
        line = self.packing.describe()
        return f"{line}; checked against padding: {self.measured:.0e}" if line and self.measured is not None \
            else line
