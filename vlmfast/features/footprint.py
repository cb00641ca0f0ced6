"""What a vision cache will hold: bytes per image and for a dataset, measured on the meta device (nothing allocated).

Usage::

    model = build_estimate_model("llava-1.5-7b")                  # meta device
    fp = cache_footprint(model, images=558_000, dtype_bytes=2)
    print(fp.to_text())     # 576 tokens x 4096 x 2 B = 4.5 MiB per image -> 2.4 TiB for 558,000 images ...
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from vlmfast.common.image_path import find_image_modules
from vlmfast.common.module_tree import matches
from vlmfast.features.units import _owner_of

__all__ = ["CacheFootprint", "cache_footprint"]


@dataclass
class CacheFootprint:
    """Per-image feature shape and the bytes a cache of `images` images needs."""

    scope: str  # "tower_and_projector" or "tower"
    feature_shape: tuple[int, ...]
    dtype_bytes: int
    images: int
    weights_bytes: int  # the cached modules' weights (they stay in memory: the cache skips their forward only)

    @property
    def bytes_per_image(self) -> int:
        return math.prod(self.feature_shape) * self.dtype_bytes

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_image * self.images

    def to_text(self, max_gb: float | None = None) -> str:
        shape = " x ".join(map(str, self.feature_shape))
        what = {"tower_and_projector": "tower + projector"}.get(self.scope, self.scope)
        line = (f"vision cache ({what}): {shape} x {self.dtype_bytes} B = "
                f"{_size(self.bytes_per_image)} per image -> {_size(self.total_bytes)} on disk for {self.images:,} "
                f"images; on a hit their forward is skipped, their weights ({_size(self.weights_bytes)}) stay loaded")
        if max_gb is not None and self.total_bytes > max_gb * 2**30:
            line += (f"; with vision_cache.max_gb {max_gb:g} about {max_gb * 2**30 / self.total_bytes:.0%} of the "
                     "images are cached (the rest run the tower)")
        return line


def cache_footprint(model: nn.Module, *, images: int, dtype_bytes: int = 2, scope: str = "auto",
                    frozen: tuple[str, ...] = (), image_size: int | None = None,
                    tower: str | None = None) -> CacheFootprint:
    """Run the image path once on a meta-device image to learn the cached feature shape (one image).

    `scope` "auto": tower and projector when the projector is frozen (in `frozen`, or ``requires_grad`` off), else
    the tower. `tower`: the tower's path, when the model's ``get_image_features`` does not show it (the stand-in call
    of :func:`~vlmfast.common.image_path.find_image_modules`). Usage:
    ``cache_footprint(build_estimate_model("tiny-vlm"), images=4096).to_text()``
    """
    try:
        found = find_image_modules(model, tower=tower)
    except ValueError as exc:
        raise ValueError(f"cache_footprint: {exc}: pass tower=<the tower's module path>") from exc
    tower_path = found.tower
    tower_module = model.get_submodule(tower_path)
    _, owner = _owner_of(model, tower_path)
    projectors = [(path, model.get_submodule(path)) for path in found.projectors]
    projector_frozen = bool(projectors) and all(
        any(pattern == "projector" or matches(path, pattern) for pattern in frozen)
        or not any(p.requires_grad for p in module.parameters()) for path, module in projectors)
    whole = scope == "tower_and_projector" or (scope == "auto" and projector_frozen)
    size = image_size or _image_size(model)
    device = next(tower_module.parameters()).device  # meta for Hugging Face configs; the tiny VLM fits the CPU
    pixels = torch.zeros(1, 3, size, size, device=device)
    with torch.no_grad():
        if whole and hasattr(owner, "get_image_features"):
            out = owner.get_image_features(pixel_values=pixels)
            modules = [tower_module, *(module for _, module in projectors)]
        else:
            out = tower_module(pixels)
            modules, whole = [tower_module], False
    if isinstance(out, torch.Tensor):
        features = out
    elif whole:  # get_image_features: per-image features in pooler_output
        pooled = out.pooler_output
        features = pooled[0].unsqueeze(0) if isinstance(pooled, (list, tuple)) else pooled
    else:  # a Hugging Face tower: the cache keeps hidden states of its width and length, not the pooled vector
        features = out.last_hidden_state
    weights = sum(p.numel() * dtype_bytes for m in modules for p in m.parameters())
    return CacheFootprint("tower_and_projector" if whole else "tower", tuple(features.shape[1:]), dtype_bytes, images,
                          weights)


def _image_size(model: nn.Module) -> int:
    config = getattr(model, "config", None)
    vision = getattr(config, "vision_config", None)
    for source in (vision, config):
        size = getattr(source, "image_size", None)
        if isinstance(size, int):
            return size
    raise ValueError("cache_footprint: the model's config names no image_size: pass image_size")


def _size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"
