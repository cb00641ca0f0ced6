"""Frozen-tower feature cache: a frozen vision tower's output for an image is computed once and read from disk after.

Most VLM recipes freeze the vision encoder (LLaVA stage 2, many Qwen2-VL / SmolVLM fine-tunes), train 2-3 epochs and
apply no random augmentation: the tower then gives the same features for the same image every epoch, yet runs every
step. With ``vision_cache.enabled`` the tower's features (and the projector's, when it is frozen too) are stored per
image in a memory-mapped store (:mod:`vlmfast.features`), keyed by a hash of the preprocessed pixels in a folder
named by a fingerprint of the tower's weights, the dtype and the preprocessing; on a hit the tower does not run.
Losses and gradients are those of the uncached run (fp32: the same bits).

Refused, with the reason: a tower that trains (at setup, an error naming the field); a sharded tower (FSDP, ZeRO-3:
ranks that hit would skip the weight all-gathers the others wait in); a random layer in the tower (checked on the
first images: two runs must agree); a random image transform (:func:`vlmfast.features.check_deterministic`, run by
:meth:`VisionCache.wrap_data`).

Usage in a hand-written loop::

    cache = cache_vision_features(model, "/data/vlm-cache", max_gb=50)   # after freezing the tower
    loader = DataLoader(dataset, batch_size=16, collate_fn=KeyedCollate(collate), num_workers=4)   # keys off-thread
    for batch in loader:
        model(**batch).loss.backward(); ...
    print(cache.describe())          # hit rate, entries, bytes on disk, tower time saved
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal

from torch import nn

from vlmfast.common.sections import Field, Section
from vlmfast.features.cache import CacheStats, FeatureCache
from vlmfast.features.keys import KeyedCollate, check_deterministic
from vlmfast.strategies.base import Step, Strategy

__all__ = ["VisionCache", "VisionCacheSpec", "cache_vision_features", "default_cache_dir"]


class VisionCacheSpec(Section):
    """Cache the frozen vision tower's features on disk (docs/vision_cache.md)."""

    enabled: bool = Field(False, description="store each image's tower features on disk and skip the tower when an "
                          "image comes back (needs a frozen tower and deterministic images)")
    dir: str | None = Field(None, description="cache folder (default: $VLMFAST_CACHE_DIR/vision or "
                            "~/.cache/vlmfast/vision); content-addressed and fingerprinted, so runs and ranks share it")
    max_gb: float = Field(20.0, gt=0, description="bound on the cached features' bytes; a full cache keeps its "
                          "entries and admits no more (an epoch's order defeats LRU)")
    dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="storage dtype: auto keeps the tower's own (exact); bf16/fp16 halve fp32 features' bytes "
        "(rounded the same way on hits and misses)")
    scope: Literal["auto", "tower", "tower_and_projector"] = Field(
        "auto", description="what the cache stands in for: auto takes the projector too when it is frozen")
    module: str | None = Field(None, description="the vision tower's module path, when probing cannot find it (the "
                               "first module the model's get_image_features enters, else the one the first training "
                               "samples' images flow into)")
    read_only: bool = Field(False, description="use a cache filled earlier without adding to it (one store shared by "
                            "every rank or run)")


def default_cache_dir() -> Path:
    """``$VLMFAST_CACHE_DIR/vision``, else ``~/.cache/vlmfast/vision``."""
    root = os.environ.get("VLMFAST_CACHE_DIR")
    return Path(root) / "vision" if root else Path.home() / ".cache" / "vlmfast" / "vision"


def cache_vision_features(model: nn.Module, dir: str | Path | None = None, *, max_gb: float = 20.0,
                          dtype: str = "auto", scope: str = "auto", module: str | None = None,
                          read_only: bool = False, preprocessing: dict[str, Any] | None = None,
                          probe_batches: Iterable[Any] | None = None) -> FeatureCache:
    """Cache `model`'s frozen image path (call after freezing, before DDP / compile); returns the cache.
    `probe_batches`: a few training batches, only read when the model's own image call does not show which module
    is its tower (a model without ``get_image_features``); else `module` names it.

    Usage: ``cache = cache_vision_features(model, "/data/cache"); ...; cache.describe(); cache.remove()``
    """
    return FeatureCache(model, dir if dir is not None else default_cache_dir(), max_gb=max_gb, dtype=dtype,
                        scope=scope, module=module, read_only=read_only, preprocessing=preprocessing,
                        probe_batches=probe_batches)


class VisionCache(Strategy):
    """The strategy: builds the cache on the plain model and reports it per step and at the end."""

    name = "vision_cache"

    def __init__(self, spec: VisionCacheSpec, preprocessing: dict[str, Any] | None = None,
                 probe_batches: Callable[[], Iterable[Any]] | None = None) -> None:
        self.spec = spec
        self.preprocessing = preprocessing
        self.probe_batches = probe_batches
        self.cache: FeatureCache | None = None
        self._last = CacheStats()

    def apply(self, model: nn.Module) -> nn.Module:
        s = self.spec
        self.cache = cache_vision_features(model, s.dir, max_gb=s.max_gb, dtype=s.dtype, scope=s.scope,
                                           module=s.module, read_only=s.read_only, preprocessing=self.preprocessing,
                                           probe_batches=self.probe_batches() if self.probe_batches else None)
        return model

    def wrap_data(self, dataset: Any, collate_fn: Any) -> tuple[Any, Any]:
        """Refuse a random image transform (read a few samples twice), and hash images in the loader workers.

        Not yet called by the training loop (a protocol point proposed with this strategy: once, after the packing
        collator is built, so keys follow packed rows); a hand-written loop can call it, and the cache hashes the
        tower's inputs itself until then."""
        # With data.device_image_size the batch holds raw images (resized on the device later): key those.
        field = (self.preprocessing or {}).get("image_key", "pixel_values")
        reason = check_deterministic(dataset, collate_fn, image_field=field)
        if reason is not None:
            raise ValueError(f"vision_cache: {reason}")
        return dataset, KeyedCollate(collate_fn, image_field=field)

    def after_step(self, step: Step) -> None:
        if self.cache is None:
            return
        now = self.cache.stats
        step.metrics["vision_cache/hits"] = now.hits - self._last.hits
        step.metrics["vision_cache/misses"] = now.misses - self._last.misses
        step.metrics["vision_cache/corrupt"] = now.corrupt - self._last.corrupt
        step.metrics["vision_cache/bypassed"] = now.bypassed_calls - self._last.bypassed_calls
        step.metrics["vision_cache/off"] = int(self.cache.disabled is not None)
        self._last = CacheStats(**vars(now))

    def state_dict(self) -> dict[str, Any]:
        return self.cache.state_dict() if self.cache is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if self.cache is not None and state:
            self.cache.load_state_dict(state)
            self._last = CacheStats(**vars(self.cache.stats))

    def describe(self) -> str:
        if self.cache is None:
            return "vision_cache: not applied"
        self.cache.resolve_timings()
        return self.cache.describe()
