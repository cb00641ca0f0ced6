"""The cached unit of a VLM: which call computes image features, and how one call splits into images and back.

A *unit* is the call the cache stands in for: the vision tower's ``forward`` (when the projector after it trains),
or the model's ``get_image_features`` (tower + projector, when both are frozen: the Hugging Face VLMs and the tiny
VLM have it). An *adapter* knows the unit's layout: how to cut one call into images (each looked up alone), run the
tower on the images that missed only, and put per-image features back into the value the caller expects.

Layouts (all measured on the real models' code in transformers 5):

- :class:`RowsAdapter`: images ``[N, C, H, W]`` -> features ``[N, ...]`` (tiny VLM tower and
  ``get_image_features``; a custom tower that returns a tensor), or a ``BaseModelOutputWithPooling`` whose
  ``pooler_output`` lists one tensor per image (LLaVA's ``get_image_features``).
- :class:`Idefics3Adapter`: ``[B, K, C, H, W]`` + ``pixel_attention_mask``; all-zero images are padding and yield no
  features; ``pooler_output`` holds one tensor per row (its images' features, concatenated).
- :class:`Qwen2VLAdapter`: ``[patches, D]`` + ``image_grid_thw`` ``[N, 3]``: image i owns ``t*h*w`` patches, so
  images have different patch and token counts; ``pooler_output`` holds one tensor per image.

The tower and the projector are found by probing the model (:mod:`vlmfast.common.image_path`: the first module its
``get_image_features`` enters, and what it runs after), never by their attribute names.

Usage::

    unit = resolve_unit(model, scope="auto")          # raises ValueError with the reason when it cannot be cached
    unit.name, unit.adapter, unit.modules             # 'get_image_features', RowsAdapter, [vision_tower, projector]
"""

from __future__ import annotations

import dataclasses
import inspect
import json
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from vlmfast.common.image_path import ImageModules, find_image_modules

__all__ = ["CallImages", "HFTowerAdapter", "Idefics3Adapter", "LearnedAdapter", "Qwen2VLAdapter", "RowsAdapter",
           "Unit", "resolve_unit"]



@dataclass
class CallImages:
    """One unit call cut into images: per image the tensors that determine its features, and whether it is real."""

    inputs: list[tuple[Tensor | None, ...]]
    real: list[bool]
    args: set[str] = field(default_factory=set)  # the call's arguments that hold the images (not fingerprinted)
    state: dict[str, Any] = field(default_factory=dict)  # adapter-private facts of this call (row layout, ...)

    def __len__(self) -> int:
        return len(self.inputs)

    def signature(self, index: int) -> tuple[Any, ...]:
        """Shapes and dtypes of one image's unit inputs (what a resize or a cast changes)."""
        return tuple(None if t is None else (tuple(t.shape), str(t.dtype)) for t in self.inputs[index])


def _pooled(output: Any) -> list[Tensor]:
    """Per-image features of a unit output: a tensor's rows, or a ModelOutput's ``pooler_output`` list."""
    if isinstance(output, Tensor):
        return list(output.unbind(0))
    pooled = getattr(output, "pooler_output", None)
    if isinstance(pooled, Tensor):
        return list(pooled.unbind(0))
    if isinstance(pooled, (list, tuple)):
        return list(pooled)
    raise TypeError(f"the unit returned a {type(output).__name__} without a per-image tensor or pooler_output")


def _model_output(pooled: Sequence[Tensor] | Tensor, as_tuple: bool, output_type: type | None = None) -> Any:
    """A ``pooler_output`` in the call's own output class when it was seen (BLIP-2's carries ``qformer_outputs``,
    which its forward reads: None on a served call), else ``BaseModelOutputWithPooling``."""
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    if not isinstance(pooled, Tensor):
        pooled = tuple(pooled) if as_tuple else list(pooled)
    return (output_type or BaseModelOutputWithPooling)(pooler_output=pooled)


def _output_type(output: Any) -> type | None:
    """The class of a ModelOutput with a ``pooler_output`` field (to answer in kind), else None."""
    fields = getattr(type(output), "__dataclass_fields__", {})
    return type(output) if isinstance(output, dict) and "pooler_output" in fields else None


class RowsAdapter:
    """One image per row of the image tensor (argument `image_arg`); every other tensor argument with as many rows
    (a patch mask) belongs to its row's image. The output is a tensor of rows, a ``pooler_output`` list of per-image
    tensors, or a ``pooler_output`` tensor of rows (`output`: "tensor", "pooled" or "pooled_tensor")."""

    def __init__(self, image_arg: str, output: str = "tensor") -> None:
        self.image_arg, self.output = image_arg, output
        self.output_type: type | None = None  # the call's own ModelOutput class, once a run showed it

    @property
    def layout(self) -> str:
        """The layout in words (for the reasons the cache gives)."""
        return f"one image per row of {self.image_arg} ({self.output.replace('_', ' ')} output)"

    def split(self, arguments: dict[str, Any]) -> CallImages | None:
        pixels = arguments.get(self.image_arg)
        if not isinstance(pixels, Tensor) or pixels.dim() < 2:
            return None
        n = pixels.shape[0]
        names = [name for name, value in arguments.items()
                 if isinstance(value, Tensor) and value.dim() >= 1 and value.shape[0] == n]
        inputs = [tuple(arguments[name][i] for name in names) for i in range(n)]
        return CallImages(inputs, [True] * n, args=set(names))

    def run(self, fn: Callable[..., Any], arguments: dict[str, Any], images: CallImages,
            indices: list[int]) -> tuple[list[Tensor], Any]:
        """Features of the images at `indices` (all of them: the unchanged call), and the raw output."""
        if len(indices) == len(images):
            output = fn(**arguments)
            return self.per_image(output, arguments), output
        index = torch.tensor(indices, device=arguments[self.image_arg].device)
        sub = {name: arguments[name][index.to(arguments[name].device)] for name in images.args}
        return self.per_image(fn(**{**arguments, **sub}), arguments), None

    def per_image(self, output: Any, arguments: dict[str, Any]) -> list[Tensor]:
        self.output_type = _output_type(output) or self.output_type
        return _pooled(output)

    def assemble(self, features: list[Tensor], images: CallImages, arguments: dict[str, Any]) -> Any:
        if self.output == "tensor":
            return torch.stack(features)
        if self.output == "pooled_tensor":  # pooler_output [images, tokens, dim] (Gemma 3, PaliGemma, InternVL)
            return _model_output(torch.stack(features), as_tuple=False, output_type=self.output_type)
        return _model_output(features, as_tuple=False, output_type=self.output_type)


class HFTowerAdapter(RowsAdapter):
    """A Hugging Face vision tower's own ``forward`` (CLIP, SigLIP, Idefics3's vision model), when the projector
    after it trains. Caches what the caller reads: the hidden states it asked for with ``output_hidden_states=<layer
    or layers>`` (transformers 5 captures only those; LLaVA reads ``hidden_states[vision_feature_layer]``), else
    ``last_hidden_state``. A call asking for every hidden state is not cached."""

    def __init__(self, image_arg: str, hidden_states: int) -> None:
        super().__init__(image_arg)
        self.hidden_states = hidden_states  # length of the tower's hidden_states tuple (layers + embeddings)

    @staticmethod
    def selection(arguments: dict[str, Any]) -> list[int] | None:
        asked = arguments.get("output_hidden_states")
        if isinstance(asked, bool) or asked is None:
            return None
        return [asked] if isinstance(asked, int) else list(asked)

    def split(self, arguments: dict[str, Any]) -> CallImages | None:
        if arguments.get("output_hidden_states") is True or arguments.get("output_attentions"):
            return None
        return super().split(arguments)

    def per_image(self, output: Any, arguments: dict[str, Any]) -> list[Tensor]:
        layers = self.selection(arguments)
        if layers is None:
            return list(output.last_hidden_state.unsqueeze(1).unbind(0))
        if output.hidden_states is not None:
            self.hidden_states = len(output.hidden_states)
        return list(torch.stack([output.hidden_states[i] for i in layers], dim=1).unbind(0))

    def assemble(self, features: list[Tensor], images: CallImages, arguments: dict[str, Any]) -> Any:
        from transformers.modeling_outputs import BaseModelOutputWithPooling

        stacked, layers = torch.stack(features), self.selection(arguments)
        if layers is None:
            return BaseModelOutputWithPooling(last_hidden_state=stacked[:, 0])
        hidden: list[Tensor | None] = [None] * self.hidden_states
        for j, layer in enumerate(layers):
            hidden[layer] = stacked[:, j]
        return BaseModelOutputWithPooling(hidden_states=tuple(hidden))


class Idefics3Adapter:
    """Idefics3 / SmolVLM ``get_image_features(pixel_values [B, K, C, H, W], pixel_attention_mask [B, K, H, W])``."""

    layout = "image slots per row, all-zero images as padding"

    def split(self, arguments: dict[str, Any]) -> CallImages | None:
        pixels, mask = arguments.get("pixel_values"), arguments.get("pixel_attention_mask")
        if not isinstance(pixels, Tensor) or pixels.dim() != 5:
            return None
        rows, per_row = pixels.shape[:2]
        flat = pixels.reshape(rows * per_row, *pixels.shape[2:])
        masks = None if mask is None else mask.reshape(rows * per_row, *mask.shape[2:])
        real = (flat != 0).flatten(1).any(dim=1).tolist()  # the model's rule: an all-zero image is padding
        if not any(real):
            return None  # the model keeps one empty image then (SmolVLM): not worth caching
        inputs = [(flat[i], None if masks is None else masks[i]) for i in range(flat.shape[0])]
        return CallImages(inputs, real, {"pixel_values", "pixel_attention_mask"},
                          {"rows": rows, "per_row": per_row, "flat": flat, "masks": masks})

    def run(self, fn: Callable[..., Any], arguments: dict[str, Any], images: CallImages,
            indices: list[int]) -> tuple[list[Tensor], Any]:
        if len(indices) == sum(images.real):
            output = fn(**arguments)
            return self._per_image(_pooled(output), images), output
        index = torch.tensor(indices, device=images.state["flat"].device)
        sub = {"pixel_values": images.state["flat"][index].unsqueeze(1)}  # one image per row
        if images.state["masks"] is not None:
            sub["pixel_attention_mask"] = images.state["masks"][index].unsqueeze(1)
        return _pooled(fn(**{**arguments, **sub})), None

    @staticmethod
    def _per_image(rows: list[Tensor], images: CallImages) -> list[Tensor]:
        """A row's tensor is its images' features concatenated (equal token counts): cut it back into images."""
        per_row, out = images.state["per_row"], []
        for r, features in enumerate(rows):
            count = sum(images.real[r * per_row:(r + 1) * per_row])
            out.extend(features.chunk(count) if count else [])
        return out

    def assemble(self, features: list[Tensor], images: CallImages, arguments: dict[str, Any]) -> Any:
        per_row, rows, width = images.state["per_row"], [], features[0].shape[-1]
        feature_iter = iter(features)
        for r in range(images.state["rows"]):
            mine = [next(feature_iter) for real in images.real[r * per_row:(r + 1) * per_row] if real]
            rows.append(torch.cat(mine) if mine else features[0].new_zeros(0, width))
        return _model_output(rows, as_tuple=False)


class Qwen2VLAdapter:
    """``get_image_features(pixel_values [patches, D], image_grid_thw [N, 3])`` (Qwen2-VL, Qwen2.5-VL, Qwen3-VL).
    Besides ``pooler_output``, per-layer ``deepstack_features`` (Qwen3-VL's, one tuple of per-image tensors per
    layer) are kept per image: an image's entry is its features stacked ``[1 + layers, tokens, dim]``."""

    layout = "flat patches with a grid per image"

    def __init__(self) -> None:
        self.output_type: type | None = None  # the call's own output class (it carries deepstack_features)
        self.layers = 0

    def split(self, arguments: dict[str, Any]) -> CallImages | None:
        pixels, grid = arguments.get("pixel_values"), arguments.get("image_grid_thw")
        if not isinstance(pixels, Tensor) or not isinstance(grid, Tensor) or pixels.dim() != 2:
            return None
        counts = grid.prod(-1).tolist()
        if sum(counts) != pixels.shape[0]:
            return None
        chunks = pixels.split(counts)
        return CallImages(list(zip(chunks, grid.unbind(0), strict=True)), [True] * len(counts),
                          {"pixel_values", "image_grid_thw"})

    def run(self, fn: Callable[..., Any], arguments: dict[str, Any], images: CallImages,
            indices: list[int]) -> tuple[list[Tensor], Any]:
        if len(indices) == len(images):
            output = fn(**arguments)
            return self._per_image(output), output
        pixels = torch.cat([images.inputs[i][0] for i in indices])
        grid = torch.stack([images.inputs[i][1] for i in indices])
        return self._per_image(fn(**{**arguments, "pixel_values": pixels, "image_grid_thw": grid})), None

    def _per_image(self, output: Any) -> list[Tensor]:
        pooled = _pooled(output)
        deep = getattr(output, "deepstack_features", None)
        if not deep:
            return pooled
        self.output_type, self.layers = type(output), len(deep)
        return [torch.stack([p, *(layer[i] for layer in deep)]) for i, p in enumerate(pooled)]

    def assemble(self, features: list[Tensor], images: CallImages, arguments: dict[str, Any]) -> Any:
        if not self.layers:
            return _model_output(features, as_tuple=True)
        deep = [tuple(f[1 + layer] for f in features) for layer in range(self.layers)]
        return self.output_type(pooler_output=tuple(f[0] for f in features), deepstack_features=deep)


class LearnedAdapter:
    """The layout of a call, learned from the model itself rather than listed per model type.

    The candidates (patches with a grid, per-row image slots, one image per row with a pooled or a tensor output)
    are tried end to end by the cache (:meth:`FeatureCache.learn_layout`) on the first forward whose images number
    two or more: the model's own outputs with the call answered from per-image features (each image's features as
    in the whole call, the last image also run alone) must equal its outputs with the real call. The first candidate
    that holds is kept; when none does, the cache turns off naming why. Usage: ``LearnedAdapter("pixel_values")``
    """

    def __init__(self, image_arg: str = "pixel_values", candidates: Sequence[Any] | None = None) -> None:
        self.candidates = list(candidates) if candidates is not None else [
            Qwen2VLAdapter(), Idefics3Adapter(),
            *(RowsAdapter(image_arg, output=kind) for kind in ("pooled", "pooled_tensor", "tensor"))]
        self.chosen: Any = None
        self.failed: str | None = None

    @property
    def learning(self) -> bool:
        return self.chosen is None and self.failed is None

    def images_in(self, arguments: dict[str, Any]) -> int:
        """The most real images any candidate cuts from `arguments`; else the rows of the largest image-like
        tensor in them (a model forward whose images reach the unit under another name, reshaped: Phi-4's
        ``image_pixel_values`` [images, crops, C, H, W] become its tower's ``pixel_values``); 0 when none."""
        counts = [sum(images.real) for c in self.candidates if (images := c.split(arguments)) is not None]
        rows = [v.shape[0] for v in arguments.values()
                if isinstance(v, Tensor) and v.is_floating_point() and v.dim() >= 4]
        return max(counts, default=0) or max(rows, default=0)

    def split(self, arguments: dict[str, Any]) -> CallImages | None:
        return self.chosen.split(arguments) if self.chosen is not None else None

    def run(self, fn: Callable[..., Any], arguments: dict[str, Any], images: CallImages,
            indices: list[int]) -> tuple[list[Tensor], Any]:
        return self.chosen.run(fn, arguments, images, indices)

    def assemble(self, features: list[Tensor], images: CallImages, arguments: dict[str, Any]) -> Any:
        return self.chosen.assemble(features, images, arguments)


def model_results(output: Any) -> list[Tensor]:
    """What training uses of a model's output: its loss and logits when it has them (a model may also echo internal
    values, such as the image call's own output), else every tensor it holds."""
    if isinstance(output, dict) and ("loss" in output or "logits" in output):
        return [t for key in ("loss", "logits") for t in output_tensors(output.get(key))]
    return output_tensors(output)


def output_tensors(output: Any) -> list[Tensor]:
    """Every tensor an output holds, in order (a ModelOutput's fields, lists and tuples flattened)."""
    if isinstance(output, Tensor):
        return [output]
    if isinstance(output, dict):  # ModelOutput is a dict of its set fields
        return [t for value in output.values() for t in output_tensors(value)]
    if isinstance(output, (list, tuple)):
        return [t for value in output for t in output_tensors(value)]
    return []


def tensors_close(a: Tensor, b: Tensor) -> bool:
    """Equal up to the last bits that another batch size changes (relative to the larger tensor's scale)."""
    if a.shape != b.shape:
        return False
    a, b = a.detach().float(), b.detach().float()
    finite = torch.isfinite(b)
    if not torch.equal(finite, torch.isfinite(a)):  # a loss over no labels is NaN on both sides (the label probe)
        return False
    a, b = a[finite], b[finite]
    scale = float(b.abs().max()) if b.numel() else 0.0
    tolerance = 1e-4 if b.dtype in (torch.float32, torch.float64) else 2e-2  # another batch size: last bits differ
    return float((a - b).abs().max() if a.numel() else 0.0) <= tolerance * max(scale, 1e-6)


@dataclass
class Unit:
    """The call the cache stands in for: `owner`'s attribute `attribute` ("forward" or "get_image_features")."""

    owner: nn.Module
    attribute: str
    adapter: Any
    modules: dict[str, nn.Module]  # the modules whose weights decide the features (fingerprinted, must be frozen)
    config: str  # the model configuration the features depend on, as JSON (part of the fingerprint)

    @property
    def name(self) -> str:
        return self.attribute if self.attribute != "forward" else f"{'+'.join(self.modules)}.forward"

    def parameters(self) -> list[nn.Parameter]:
        return [p for module in self.modules.values() for p in module.parameters()]


def resolve_unit(model: nn.Module, scope: str = "auto", module: str | None = None,
                 batches: Iterable[Any] | None = None) -> Unit:
    """Find the unit to cache in `model` (the plain model, before DDP).

    `scope`: "auto" (tower and projector when both are frozen, else the tower), "tower", or "tower_and_projector".
    `module`: the tower's path, when the model cannot show it (:func:`~vlmfast.common.image_path.find_image_modules`:
    the first module its ``get_image_features`` enters, else what a probe forward of `batches` sends the images
    into). Raises ValueError naming the reason when nothing can be cached: no tower found, a tower that trains, a
    Hugging Face tower whose projector trains.
    """
    found = _find(model, module, batches)
    tower_path, tower = found.tower, model.get_submodule(found.tower)
    trainable = [n for n, p in tower.named_parameters() if p.requires_grad]
    if trainable:
        raise ValueError(
            f"vision_cache: the vision tower '{tower_path}' trains ({len(trainable)} trainable tensors, e.g. "
            f"'{trainable[0]}'), so its features change every step and a cache would serve stale ones: freeze it "
            f"(optimizer.freeze: ['{tower_path.rsplit('.', 1)[-1]}']) or set vision_cache.enabled: false")
    _, owner = _owner_of(model, tower_path)
    projectors = {path: model.get_submodule(path) for path in found.projectors}
    trains = [path for path, m in projectors.items() if any(p.requires_grad for p in m.parameters())]
    projector_frozen = bool(projectors) and not trains
    config = _config_json(owner)
    model_type = getattr(getattr(owner, "config", None), "model_type", None)
    # Nothing besides the tower in the image call (learned: no projector next to it; Qwen2-VL's merger is inside its
    # tower): the tower's features are the call's, so scope tower caches the call, whose layout is learned end to end
    # (the tower's own forward may take flattened patches with a grid, not one image per row). A trainable module the
    # call was not seen to run (Qwen2.5-Omni's audio tower, held next to its vision tower) may not be in it at all:
    # the whole call is tried, and autograd on its first run narrows the cache to the tower if its output needs a
    # gradient (FeatureCache._narrow_or_refuse).
    unsure = scope == "auto" and bool(trains) and not found.seen
    whole = scope == "tower_and_projector" or not projectors or (scope == "auto" and projector_frozen) or unsure
    if scope == "tower_and_projector" and not projector_frozen:
        reason = "has no projector next to the tower" if not projectors else f"'{trains[0]}' trains"
        raise ValueError(f"vision_cache.scope is tower_and_projector but the model {reason}: use scope: tower")
    if whole and hasattr(owner, "get_image_features"):
        modules = {tower_path: tower, **{path: m for path, m in projectors.items() if path not in trains}}
        if model_type is not None:  # a Hugging Face VLM: its layout learned on its first forward with two images
            return Unit(owner, "get_image_features", LearnedAdapter(_first_argument(owner.get_image_features)),
                        modules, config)
        return Unit(owner, "get_image_features", RowsAdapter(_first_argument(owner.get_image_features)), modules,
                    config)
    if _is_hf(tower):  # one image per row, checked end to end on the first forward with two images
        layers = getattr(getattr(tower, "config", None), "num_hidden_layers", 0) + 1
        adapter = LearnedAdapter(candidates=[HFTowerAdapter(_first_argument(tower.forward), layers)])
        return Unit(tower, "forward", adapter, {tower_path: tower}, config)
    return Unit(tower, "forward", RowsAdapter(_first_argument(tower.forward)), {tower_path: tower}, config)


def _find(model: nn.Module, path: str | None, batches: Iterable[Any] | None) -> ImageModules:
    try:
        return find_image_modules(model, batches, tower=path)
    except ValueError as exc:
        if path is not None:
            raise ValueError(f"vision_cache.module: {exc}") from exc
        raise ValueError(f"vision_cache: {exc}: set vision_cache.module to the tower's path, e.g. "
                         "'encoder.image_tower'") from exc


def _owner_of(model: nn.Module, tower_path: str) -> tuple[str, nn.Module]:
    """The deepest module above the tower (the model's forward path calls its own get_image_features)."""
    parts = tower_path.split(".")
    for depth in range(len(parts) - 1, -1, -1):
        path = ".".join(parts[:depth])
        module = model.get_submodule(path) if path else model
        if hasattr(module, "get_image_features"):
            return path, module
    parent = ".".join(parts[:-1])
    return parent, model.get_submodule(parent) if parent else model


def _first_argument(fn: Callable[..., Any]) -> str:
    params = [p for p in inspect.signature(fn).parameters.values()
              if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if not params:
        raise ValueError(f"vision_cache: {fn!r} takes no image argument")
    return params[0].name


def _is_hf(module: nn.Module) -> bool:
    return any(cls.__name__ == "PreTrainedModel" for cls in type(module).__mro__)


def _config_json(owner: nn.Module) -> str:
    config = getattr(owner, "config", None)
    if config is None:
        return "{}"
    if dataclasses.is_dataclass(config):
        data = dataclasses.asdict(config)
    elif hasattr(config, "to_dict"):
        data = config.to_dict()
        for volatile in ("_name_or_path", "transformers_version", "architectures", "_commit_hash"):
            data.pop(volatile, None)
    else:
        data = {"repr": repr(config)}
    return json.dumps(data, sort_keys=True, default=str)
