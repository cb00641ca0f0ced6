"""The cached call: look each image up, run the frozen tower only on the images that missed, store what it made.

:class:`FeatureCache` replaces the unit (see :mod:`vlmfast.features.units`) by an instance attribute of the same
name (as Accelerate's hooks and vlmfast's frozen-module wrapper do): parameter names, ``state_dict`` keys, DDP and
activation checkpointing see the model unchanged, and :meth:`FeatureCache.remove` puts the original back.

Per call:

1. Refuse (run the tower as usual, say why once) when the tower trains now, has batch-norm layers in training mode,
   or its inputs need a gradient; after the first run on images, when two runs on the same images differ (dropout).
2. Keys: the batch's keys when :class:`~vlmfast.features.keys.KeyedCollate` computed them in the loader workers
   (taken out of the model's keyword arguments by a forward pre-hook, order checked on the first call), else a hash
   of the tower's inputs on this thread. Each is combined with the image's input shapes and dtypes.
3. The store: one folder per *fingerprint* of everything else the features depend on: the unit's weights and
   buffers (hashed once, re-hashed when a tensor's version counter moves), the model config, the call's other
   arguments, autocast state, device type, torch version, storage dtype, and the data preprocessing. Changing any of
   them starts a new store; the old one is never read again.
4. Hits are read from the memory-mapped store and verified against their record's checksum; a feature that fails
   it is a miss (recomputed, its entry replaced, counted as ``vision_cache/corrupt``, said once), and a store with
   more than ``CORRUPT_LIMIT`` of them is dropped (the cache turns off for the run, naming ``vision_cache.dir``).
5. Misses run through the tower (all at once when nothing hit: exactly the uncached call), are stored, and are
   returned. Features stored in another dtype (``dtype: bf16``) are rounded on the miss path too, so a run gives
   the same features whether an image hit or missed. A disk without room for an entry turns the cache off with a
   warning naming ``vision_cache.dir``.

Usage::

    cache = FeatureCache(model, "/data/vlm-cache", max_gb=50)
    loss = model(**batch).loss           # first epoch: misses (stored); later epochs: hits, the tower does not run
    cache.stats.hit_rate, cache.describe(); cache.remove()
"""

from __future__ import annotations

import inspect
import json
import logging
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from vlmfast.features.keys import KEYS_FIELD, FlatKeys, hash_bytes, tensor_key
from vlmfast.features.store import CorruptEntryError, FeatureStore, UnverifiableEntryError
from vlmfast.features.units import (
    CallImages,
    LearnedAdapter,
    Unit,
    model_results,
    output_tensors,
    resolve_unit,
    tensors_close,
)

__all__ = ["CacheStats", "FeatureCache"]

log = logging.getLogger(__name__)

FORMAT = "vlmfast-vision-cache/2"  # 2: records carry a checksum (stores of format 1 live in other folders)
NOT_LEARNED_YET = "its image layout is learned on the first call with two or more images, and none came yet"
CORRUPT_LIMIT = 3  # corrupt entries a store may hold before it is dropped: more is a damaged disk, not a stray bit
TIMED_RUNS = 64  # tower runs whose (CUDA event) times are kept for the per-image tower time


@dataclass
class CacheStats:
    """Counters since the cache was built (or restored from a checkpoint)."""

    hits: int = 0  # images served from the store
    misses: int = 0  # images the tower computed
    stored: int = 0  # of the misses, images written to the store
    not_stored: int = 0  # misses the store had no room for (or read-only)
    bytes_read: int = 0
    bytes_written: int = 0
    calls: int = 0
    bypassed_calls: int = 0  # calls passed straight to the tower (refused, or a layout the adapter does not know)
    corrupt: int = 0  # cached features whose bytes failed their checksum (recomputed)
    hashed_images: int = 0  # images hashed on the training thread (the batch carried no keys)
    tower_seconds: float = 0.0  # tower time on the timed runs
    tower_images: int = 0  # images in the timed runs
    overhead_seconds: float = 0.0  # time in the cache itself: hashing, lookups, reads, writes

    @property
    def hit_rate(self) -> float:
        looked_up = self.hits + self.misses
        return self.hits / looked_up if looked_up else 0.0

    @property
    def tower_seconds_per_image(self) -> float:
        return self.tower_seconds / self.tower_images if self.tower_images else 0.0

    @property
    def seconds_saved(self) -> float:
        """Tower time the hits did not spend (per-image tower time measured on misses), minus the cache's own."""
        return self.hits * self.tower_seconds_per_image - self.overhead_seconds


class FeatureCache:
    """Caches the frozen image path of `model` (the plain model, before DDP); see the module docstring.

    `scope`: "auto" | "tower" | "tower_and_projector"; `module`: the tower's path when the model cannot show it;
    `probe_batches`: a few training batches, for a probe forward when the model's own image call does not show its
    tower (:func:`~vlmfast.common.image_path.find_image_modules`); `preprocessing`: anything the data pipeline does
    to images after the keys are computed (part of the fingerprint); `read_only`: use an existing store without
    adding to it.
    """

    def __init__(self, model: nn.Module, directory: str | Path, *, max_gb: float = 20.0, dtype: str = "auto",
                 scope: str = "auto", module: str | None = None, read_only: bool = False,
                 preprocessing: dict[str, Any] | None = None, probe_batches: Iterable[Any] | None = None) -> None:
        from vlmfast.common.utils import PRECISION_DTYPES

        self._model, self._scope = model, scope
        self.root = Path(directory).expanduser()
        self.max_bytes = int(max_gb * 2**30)
        self.storage_dtype = None if dtype == "auto" else PRECISION_DTYPES[dtype]
        self.read_only = read_only
        self.preprocessing = json.dumps(preprocessing or {}, sort_keys=True, default=str)
        self.stats = CacheStats()
        self.disabled: str | None = None  # why the cache stopped serving (the tower runs as without it)
        self.bypass_reason: str | None = None  # why the last call it could not serve was passed to the tower
        self._bypass_said = False
        self._model_showed_images = False  # a model forward's own inputs held images a candidate layout cuts
        self.stores: dict[bytes, FeatureStore] = {}
        self._pending: list[str] | None = None  # the keys of the current forward's images, from the batch
        self._trial: Any = None  # while learning the layout: "real" or the candidate adapter being tried
        self._trial_error: str | None = None
        self._trainable_inside: list[str] | bool = False  # the real call's output needed a gradient: of these
        self._runs = 0
        self._timed_runs = 0
        self._events: list[tuple[Any, Any, int]] = []  # CUDA (start, end, images) not yet read
        self._meta: dict[bytes, dict[str, Any]] = {}  # a new store's meta.json, until the store is opened
        self._corrupt_in: dict[Path, int] = {}  # store folder -> corrupt entries found in it
        self._install(resolve_unit(model, scope, module, probe_batches))
        self._hooks = [model.register_forward_pre_hook(torch.compiler.disable(self._take_keys), with_kwargs=True),
                       model.register_forward_hook(torch.compiler.disable(self._drop_keys), always_call=True)]

    def _install(self, unit: Unit) -> None:
        """Stand in for `unit`'s call (an instance attribute of the same name) and fingerprint its modules."""
        self.unit = unit
        self._params = [t for m in unit.modules.values() for t in (*m.parameters(), *m.buffers())]
        self._batchnorms = [m for mod in unit.modules.values() for m in mod.modules()
                            if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        self._weights: tuple[tuple[Any, ...], bytes] | None = None  # (version signature, weights hash)
        self._namespaces: dict[tuple[Any, ...], bytes] = {}
        self._keys_in_order: bool | None = None  # batch keys verified against the tower's inputs (None: not yet)
        self._probed = False
        self._grad_checked = isinstance(unit.adapter, LearnedAdapter)  # learn_layout checks a learned layout's call
        self._original = getattr(unit.owner, unit.attribute)
        self._signature = inspect.signature(self._original)
        # Lookups and disk I/O are Python: under torch.compile(model) they run eagerly (a graph break).
        self._wrapper = torch.compiler.disable(self._call)
        setattr(unit.owner, unit.attribute, self._wrapper)

    def _narrow_to_tower(self, reason: str) -> bool:
        """The image call uses trainable parameters outside its frozen modules (LLaVA-NeXT's ``image_newline``,
        found by autograd on the call): cache the outermost frozen module the images enter, the tower's own
        ``forward``, and let the rest of the call (the frozen projector, the trainable parts) run every step on its
        cached output. False when there is nothing narrower (the call already is the tower's, or the tower is all
        the call has) or `scope` asked for the whole call."""
        if self._scope != "auto" or self.unit.attribute == "forward":
            return False
        try:
            tower = resolve_unit(self._model, "tower", next(iter(self.unit.modules)))
        except ValueError:
            return False
        if tower.attribute != "forward":  # nothing besides the tower in the call: the call is the tower's output
            return False
        del self.unit.owner.__dict__[self.unit.attribute]  # the original call is back; the tower's is wrapped
        self._install(tower)
        log.warning("vision_cache: %s; caching the frozen %s instead (the rest of the call runs every step on its "
                    "cached output)", reason, tower.name)
        return True

    def _narrow_or_refuse(self, used: list[str] | bool) -> bool:
        """The call's output needs a gradient (of the trainable parameters `used`): cache the tower alone (True)
        or, when there is nothing narrower, turn the cache off naming them."""
        names = ", ".join(used) if isinstance(used, list) and used else "some"
        trains = (f"{self.unit.name} uses trainable parameters ({names}) besides the frozen "
                  f"{', '.join(self.unit.modules)} (its output requires a gradient)")
        if self._narrow_to_tower(trains):
            return True
        self._refuse(f"{trains}: freeze them too, or set vision_cache.enabled: false")
        return False

    def _first_call_with_grad(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Once per unit whose layout is not learned end to end (learn_layout checks there): the real call with
        gradients on; its output needing one means a trainable part inside the call (see :meth:`_narrow_or_refuse`).
        Returns the call's output (this call is then not cached), or None when the call is all frozen."""
        from vlmfast.common.utils import rng_state, set_rng_state

        self._grad_checked = True
        state = rng_state()
        with torch.enable_grad():
            output = self._original(*args, **kwargs)
            needing = [t for t in output_tensors(output) if t.requires_grad]
            if not needing:
                set_rng_state(state)  # the check's random numbers undone: the cached call draws them again
                return None
            self._narrow_or_refuse(self._trainable_used(needing) or True)
        self.stats.bypassed_calls += 1
        return output

    # ---- the model's side ---------------------------------------------------------------------------------------
    def _take_keys(self, module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        adapter = self.unit.adapter
        if getattr(adapter, "learning", False) and self._trial is None and self.disabled is None \
                and self._refusal(None) is None and (shown := adapter.images_in(kwargs)):
            self._model_showed_images = True
            if shown >= 2:
                self.learn_layout(module, args, {k: v for k, v in kwargs.items() if k != KEYS_FIELD})
        keys = kwargs.pop(KEYS_FIELD, None)
        if keys is None:
            return None
        self._pending = list(keys.keys) if isinstance(keys, FlatKeys) else [k for row in keys for k in row]
        return args, kwargs

    def _drop_keys(self, module: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        self._pending = None

    # ---- learning the layout (LearnedAdapter) -------------------------------------------------------------------
    def learn_layout(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Try each candidate layout end to end on this forward (no grad, eval mode, random state restored): the
        model's outputs with the call answered from per-image features must equal its outputs with the real call."""
        adapter = self.unit.adapter
        modes = [(m, m.training) for m in model.modules()]
        device = self._device()
        reasons = []
        narrowed = False
        model.eval()
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                self._trial, self._trainable_inside = "real", False
                reference = model_results(model.forward(*args, **kwargs))
                if self._trainable_inside:
                    narrowed = self._narrow_or_refuse(self._trainable_inside)
                    if not narrowed:
                        adapter.failed = self.disabled
                        return
                for candidate in () if narrowed else adapter.candidates:  # narrowed: the tower's, learned below
                    self._trial, self._trial_error = candidate, None
                    try:
                        got = model_results(model.forward(*args, **kwargs))
                    except Exception as exc:  # a layout that cannot run this call is not the model's
                        self._trial_error = self._trial_error or _short(f"the model then raised "
                                                                        f"{type(exc).__name__}: {exc}")
                        got = []
                    same = len(got) == len(reference) and all(map(tensors_close, got, reference))
                    if self._trial_error is None and same:
                        adapter.chosen = candidate
                        return
                    reasons.append(f"{_layout(candidate)}: {self._trial_error or 'the model gives other outputs'}")
        finally:
            self._trial = None
            for module, training in modes:
                module.training = training
        if narrowed:  # the tower's layout, learned on this same forward (a custom tower's first call checks it)
            if isinstance(self.unit.adapter, LearnedAdapter):
                self.learn_layout(model, args, kwargs)
            return
        adapter.failed = (f"no image layout gives the model's own outputs when the image features of "
                          f"{self.unit.name} are served per image ({'; '.join(reasons)})")
        self._refuse(adapter.failed)

    def _trial_call(self, arguments: dict[str, Any] | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        candidate = self._trial
        if candidate == "real":  # with gradients on: features of frozen weights alone must not require one
            with torch.enable_grad():
                output = self._original(*args, **kwargs)
                needing = [t for t in output_tensors(output) if t.requires_grad]
                if needing:
                    self._trainable_inside = self._trainable_used(needing) or True
            return output
        images = None if arguments is None else candidate.split(arguments)
        if images is None:
            self._trial_error = "cannot cut the call into images"
            return self._original(*args, **kwargs)
        other = [name for name, value in arguments.items() if isinstance(value, Tensor) and name not in images.args]
        if other:  # what _namespace refuses: features that depend on a per-call tensor have no safe key
            self._trial_error = f"the call also takes {', '.join(other)}, per-call tensors its features depend on"
        real = [i for i, is_real in enumerate(images.real) if is_real]
        features, _ = candidate.run(self._original, arguments, images, real)
        alone = candidate.run(self._original, arguments, images, real[-1:])[0]
        if not (alone and tensors_close(alone[0], features[-1])):
            self._trial_error = "an image run alone gives other features than in the whole call"
        return candidate.assemble(features, images, arguments)

    def _trainable_used(self, outputs: list[Tensor]) -> list[str]:
        """The trainable parameters of the call's owner that `outputs` depend on (found by autograd, not by name)."""
        named = [(name, p) for name, p in self.unit.owner.named_parameters() if p.requires_grad]
        if not named:
            return []
        total = sum(t.float().sum() for t in outputs)
        grads = torch.autograd.grad(total, [p for _, p in named], allow_unused=True)
        return [name for (name, _), grad in zip(named, grads, strict=True) if grad is not None][:5]

    def _call(self, *args: Any, **kwargs: Any) -> Any:
        pending, self._pending = self._pending, None
        if self.disabled is not None:
            return self._original(*args, **kwargs)
        start = time.perf_counter()
        arguments = self._arguments(args, kwargs)
        if self._trial is not None:  # learning the layout (learn_layout): answer from per-image features
            return self._trial_call(arguments, args, kwargs)
        images = None if arguments is None else self.unit.adapter.split(arguments)
        refusal = self._refusal(images)
        if refusal is not None:
            self._refuse(refusal)
        if images is not None and refusal is None and not self._grad_checked:
            output = self._first_call_with_grad(args, kwargs)
            if output is not None:
                return output
        namespace = None if images is None or refusal else self._namespace(arguments, images)
        if namespace is None:
            if refusal is None:
                self._bypass(self._why_not_cached(arguments, images))
            self.stats.bypassed_calls += 1
            return self._original(*args, **kwargs)
        store = self._store(namespace)
        if store is None:  # no room on the disk for the store's files: refused
            self.stats.bypassed_calls += 1
            return self._original(*args, **kwargs)
        self.stats.calls += 1
        keys = self._keys(images, pending)
        real = [i for i, is_real in enumerate(images.real) if is_real]
        entries = {i: store.get(keys[i]) for i in real}
        if any(entry is None for entry in entries.values()) and store.refresh():  # another rank may have stored them
            entries = {i: store.get(keys[i]) for i in real}
        hits, corrupt = self._read_hits(store, entries)
        missing = [i for i in real if i not in hits]
        self.stats.hits += len(hits)
        self.stats.misses += len(missing)
        computed: dict[int, Tensor] = {}
        raw = None
        tower_seconds = 0.0
        if missing:
            tower_start = time.perf_counter()
            features, raw = self._run(arguments, images, missing)
            tower_seconds = time.perf_counter() - tower_start
            computed = dict(zip(missing, self._store_features(store, keys, missing, features, corrupt), strict=True))
        if not hits and raw is not None and (self.disabled or self.storage_dtype is None):
            self.stats.overhead_seconds += time.perf_counter() - start - tower_seconds
            return raw  # nothing hit: exactly the uncached call's output
        output = self.unit.adapter.assemble(self._gather(hits, entries, computed, real), images, arguments)
        self.stats.overhead_seconds += time.perf_counter() - start - tower_seconds
        return output

    # ---- checks -------------------------------------------------------------------------------------------------
    def _arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any] | None:
        try:
            bound = self._signature.bind(*args, **kwargs)
        except TypeError:
            return None
        arguments: dict[str, Any] = {}
        for name, value in bound.arguments.items():
            kind = self._signature.parameters[name].kind
            if kind is inspect.Parameter.VAR_POSITIONAL:
                if value:
                    return None
            elif kind is inspect.Parameter.VAR_KEYWORD:
                arguments.update(value)
            else:
                arguments[name] = value
        return arguments

    def _refusal(self, images: CallImages | None) -> str | None:
        if any(p.requires_grad for p in self._params if isinstance(p, nn.Parameter)):
            return f"the tower ({', '.join(self.unit.modules)}) became trainable"
        if any(m.training for m in self._batchnorms):
            return ("the tower has batch-norm layers in training mode: its features depend on the batch; put them in "
                    "eval mode")
        if images is not None and any(t is not None and t.requires_grad for inputs in images.inputs for t in inputs):
            return "the tower's inputs require a gradient"
        return None

    def _refuse(self, reason: str) -> None:
        if self.disabled is None:
            self.disabled = reason
            log.warning("vision_cache off: %s; the tower runs as without the cache", reason)

    def _bypass(self, reason: str) -> None:
        """A call the cache cannot serve (the tower runs as without it): said once, with why (unless the layout is
        still to be learned: a later call may teach it); counted per step in ``vision_cache/bypassed`` and shown by
        :meth:`describe`."""
        if reason != NOT_LEARNED_YET and not self._bypass_said:
            self._bypass_said = True
            log.warning("vision_cache: a call of %s is not cached: %s; the tower runs as without the cache "
                        "(vision_cache/bypassed counts such calls)", self.unit.name, reason)
        self.bypass_reason = reason

    def _why_not_cached(self, arguments: dict[str, Any] | None, images: CallImages | None) -> str:
        if arguments is None:
            return "its arguments cannot be bound by name (extra positional arguments)"
        if images is not None:  # the split worked: an argument besides the images decides
            tensors = [name for name, value in arguments.items() if isinstance(value, Tensor)
                       and name not in images.args]
            return (f"the call also takes {', '.join(tensors)}, per-call tensors its features depend on (no safe "
                    "key per image)")
        shapes = ", ".join(f"{name} {tuple(value.shape)}" if isinstance(value, Tensor) else f"{name} "
                           f"{type(value).__name__}" for name, value in arguments.items() if value is not None)
        adapter = self.unit.adapter
        if getattr(adapter, "learning", False):
            known = "; ".join(_layout(c) for c in adapter.candidates)
            if adapter.images_in(arguments) == 0:
                return f"no known image layout ({known}) cuts its arguments ({shapes}) into images"
            if self._model_showed_images:
                return NOT_LEARNED_YET
            return (f"its layout was never learned: that takes a forward of the whole model whose own inputs hold two "
                    f"or more images in an argument a known layout cuts ({known}), and this model's inputs hold them "
                    f"in another form (its call gets {shapes})")
        return f"its arguments ({shapes}) do not fit the image layout ({_layout(adapter)})"

    # ---- keys and stores ----------------------------------------------------------------------------------------
    def _keys(self, images: CallImages, pending: list[str] | None) -> list[bytes]:
        source: list[bytes] | None = None
        if pending is not None and len(pending) == len(images) and self._keys_in_order is not False:
            source = [bytes.fromhex(k) for k in pending]
            if self._keys_in_order is None:
                self._keys_in_order = self._check_order(source, images)
                source = source if self._keys_in_order else None
        if source is None:
            source = [tensor_key(*inputs, tag=b"unit") for inputs in _on_host(images.inputs)]
            self.stats.hashed_images += len(images)
        return [hash_bytes(key, images.signature(i)) for i, key in enumerate(source)]

    def _check_order(self, keys: list[bytes], images: CallImages) -> bool:
        """The batch's keys belong to the tower's images in this order: where the tower sees the batch's pixels
        unchanged, their hashes must match position by position (a key found elsewhere means another order)."""
        own = [tensor_key(*inputs) for inputs in _on_host(images.inputs)]
        where = {key: i for i, key in enumerate(keys)}
        misplaced = [i for i, key in enumerate(own) if where.get(key, i) != i]
        if misplaced:
            log.warning("vision_cache: the batch's image keys are not in the order the tower receives the images "
                        "(image %d); hashing the tower's inputs instead", misplaced[0])
            return False
        return True

    def _weights_hash(self) -> bytes:
        signature = tuple((t._version, t.data_ptr(), t.dtype, t.device) for t in self._params)
        if self._weights is None or self._weights[0] != signature:
            if self._weights is not None:
                log.info("vision_cache: the tower's weights changed: features go to a new store")
            named = sorted((f"{prefix}.{name}", t) for prefix, module in self.unit.modules.items()
                           for name, t in (*module.named_parameters(), *module.named_buffers()))
            h = hash_bytes(*(f"{name}:{type(m).__qualname__}" for name, m in self.unit.modules.items()))
            self._weights = (signature, hash_bytes(h, *(part for name, t in named
                                                        for part in (name, tensor_key(t, tag=b"weight")))))
        return self._weights[1]

    def _namespace(self, arguments: dict[str, Any], images: CallImages) -> bytes | None:
        """The store's fingerprint for this call, or None when an argument makes it uncacheable."""
        others = {}
        for name, value in arguments.items():
            if name in images.args:
                continue
            if isinstance(value, Tensor):
                return None  # a per-call tensor the adapter does not know: no safe key
            others[name] = repr(value)
        device = next((t.device for inputs in images.inputs for t in inputs if t is not None), torch.device("cpu"))
        autocast = (torch.is_autocast_enabled(device.type), str(torch.get_autocast_dtype(device.type)))
        state = (self._weights_hash(), autocast, device.type, tuple(sorted(others.items())))
        namespace = self._namespaces.get(state)
        if namespace is None:
            namespace = self._namespaces[state] = hash_bytes(
                FORMAT, self.unit.name, type(self.unit.owner).__qualname__, self.unit.config, state[0], autocast,
                device.type, torch.__version__, str(self.storage_dtype), state[3], self.preprocessing)
            self._meta[namespace] = {
                "format": FORMAT, "unit": self.unit.name, "model": type(self.unit.owner).__qualname__,
                "weights": state[0].hex(), "autocast": list(autocast), "device": device.type,
                "torch": torch.__version__, "storage_dtype": str(self.storage_dtype or "as produced"),
                "arguments": dict(state[3]), "preprocessing": json.loads(self.preprocessing)}
        return namespace

    def _store(self, namespace: bytes) -> FeatureStore | None:
        store = self.stores.get(namespace)
        if store is None:
            try:
                store = FeatureStore(self.root / namespace.hex()[:20], self.max_bytes, read_only=self.read_only,
                                     meta=self._meta.pop(namespace, None))
            except OSError as exc:
                if isinstance(exc, PermissionError) and not self.read_only:
                    raise  # a folder the user cannot write: their setting to change, not a full disk
                self._refuse(f"cannot open a store under vision_cache.dir {self.root} ({exc})")
                return None
            self.stores[namespace] = store
        return store

    def _read_hits(self, store: FeatureStore, entries: dict[int, Any]) -> tuple[dict[int, Tensor], set[int]]:
        """The stored features of the images that have an entry, verified: (features by image, the images whose
        entry failed its checksum). After a store is dropped nothing is read from it."""
        hits: dict[int, Tensor] = {}
        corrupt: set[int] = set()
        for i, entry in entries.items():
            if entry is None or self.disabled:
                continue
            try:
                hits[i] = store.read(entry)
            except CorruptEntryError as exc:
                corrupt.add(i)  # recomputed and replaced
                if not isinstance(exc, UnverifiableEntryError):
                    self._count_corrupt(store, exc)
                continue
            self.stats.bytes_read += entry.nbytes
        if self.disabled:  # dropped during this call: the tower computes every image
            return {}, set()
        return hits, corrupt

    def _count_corrupt(self, store: FeatureStore, error: CorruptEntryError) -> None:
        self.stats.corrupt += 1
        found = self._corrupt_in[store.path] = self._corrupt_in.get(store.path, 0) + 1
        if found == 1:
            log.warning("vision_cache: a cached feature failed its checksum (%s): recomputed and its entry replaced; "
                        "vision_cache/corrupt counts such features", error)
        if found > CORRUPT_LIMIT:
            self._refuse(f"{found} cached features in {store.path} failed their checksums (a damaged disk, or files "
                         f"changed by hand): the store is dropped; delete that folder of vision_cache.dir "
                         f"({self.root}) to rebuild it")

    # ---- the tower ----------------------------------------------------------------------------------------------
    def _run(self, arguments: dict[str, Any], images: CallImages, indices: list[int]) -> tuple[list[Tensor], Any]:
        if not self._probed:
            self._probed = True
            if not self._deterministic(arguments, images, indices):
                self._refuse("two runs of the tower on the same images gave different features (dropout or another "
                             "random layer in training mode?)")
        timing = self._timer_start()
        features, raw = self.unit.adapter.run(self._original, arguments, images, indices)
        self._timer_stop(timing, len(indices))
        return features, raw

    def _deterministic(self, arguments: dict[str, Any], images: CallImages, indices: list[int]) -> bool:
        """Run the tower twice on (at most two of) the images; every RNG is restored so the run is unchanged."""
        probe = indices[:2]
        device = next((t.device for inputs in images.inputs for t in inputs if t is not None), torch.device("cpu"))
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
            first = self.unit.adapter.run(self._original, arguments, images, probe)[0]
            second = self.unit.adapter.run(self._original, arguments, images, probe)[0]
        for a, b in zip(first, second, strict=True):
            scale = float(a.detach().float().abs().max()) if a.numel() else 0.0
            if not torch.allclose(a.float(), b.float(), rtol=1e-3, atol=1e-5 * max(scale, 1.0)):
                return False
        return True

    def _store_features(self, store: FeatureStore, keys: list[bytes], indices: list[int],
                        features: Sequence[Tensor], replace: set[int]) -> list[Tensor]:
        """Write the computed features (`replace`: images whose stored entry was corrupt); return them as the step
        uses them (rounded to the storage dtype)."""
        out = []
        for i, feature in zip(indices, features, strict=True):
            stored = feature.detach().to("cpu", self.storage_dtype or feature.dtype).contiguous()
            if self.disabled is None and store.writer is not None and self._put(store, keys[i], stored,
                                                                                 feature.dtype, i in replace):
                self.stats.stored += 1
                self.stats.bytes_written += stored.numel() * stored.element_size()
            else:
                self.stats.not_stored += 1
            if self.storage_dtype is not None and self.storage_dtype != feature.dtype:
                feature = feature.to(self.storage_dtype).to(feature.dtype)
            out.append(feature)
        return out

    def _put(self, store: FeatureStore, key: bytes, stored: Tensor, source_dtype: torch.dtype, replace: bool) -> bool:
        try:
            return store.put(key, stored, source_dtype=source_dtype, replace=replace)
        except OSError as exc:  # a full disk (space is reserved before any byte is written through the map)
            self._refuse(f"no room for features under vision_cache.dir {self.root} ({exc}); free space there or "
                         "point vision_cache.dir at a larger disk")
            return False

    def _gather(self, hits: dict[int, Tensor], entries: dict[int, Any], computed: dict[int, Tensor],
                real: list[int]) -> list[Tensor]:
        """Features of the real images in order: computed ones as they are, hits (read from the store) moved to the
        device in the dtype the tower produced."""
        device = next((f.device for f in computed.values()), None) or self._device()
        return [computed[i] if i in computed else
                hits[i].to(device=device, dtype=entries[i].source_dtype, non_blocking=True) for i in real]

    def _device(self) -> torch.device:
        return next((t.device for t in self._params), torch.device("cpu"))

    # ---- timing -------------------------------------------------------------------------------------------------
    def _timer_start(self) -> Any:
        self._runs += 1
        if self._runs == 1 or self._timed_runs >= TIMED_RUNS:  # the first run pays lazy initialisation: not timed
            return None
        self._timed_runs += 1
        device = self._device()
        if device.type == "cuda":
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _timer_stop(self, start: Any, images: int) -> None:
        if start is None:
            return
        if isinstance(start, float):
            self.stats.tower_seconds += time.perf_counter() - start
            self.stats.tower_images += images
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._events.append((start, end, images))

    def resolve_timings(self) -> None:
        """Fold recorded CUDA event pairs into the stats (waits for them: call at report time, not per step)."""
        for start, end, images in self._events:
            end.synchronize()
            self.stats.tower_seconds += start.elapsed_time(end) / 1e3
            self.stats.tower_images += images
        self._events.clear()

    # ---- reporting and life cycle -------------------------------------------------------------------------------
    def bytes_on_disk(self) -> int:
        return sum(store.disk_bytes() for store in self.stores.values())

    def entries(self) -> int:
        return sum(len(store) for store in self.stores.values())

    def describe(self) -> str:
        """One line: what is cached, the hit rate, bytes, and the tower time saved (or why the cache is off)."""
        s = self.stats
        where = f"{self.unit.name} -> {self.root}"
        if self.disabled:
            return f"vision_cache: off ({self.disabled}); {where}"
        if s.bypassed_calls and not s.calls:
            return f"vision_cache: serving nothing: {s.bypassed_calls} calls not cached ({self.bypass_reason}); {where}"
        keys = "keys hashed on the training thread" if s.hashed_images else "keys from the loader workers"
        full = ", store full" if any(store.full for store in self.stores.values()) else ""
        return (f"vision_cache: {where}: hit rate {s.hit_rate:.0%} ({s.hits} hits, {s.misses} misses), "
                f"{self.entries()} entries, {_human_bytes(self.bytes_on_disk())} on disk{full}; tower "
                f"{1e3 * s.tower_seconds_per_image:.2f} ms/image, ~{max(s.seconds_saved, 0.0):.1f} s saved; {keys}"
                + (f"; {s.bypassed_calls} calls not cached ({self.bypass_reason})" if s.bypassed_calls else ""))

    def state_dict(self) -> dict[str, Any]:
        return {"stats": asdict(self.stats), "disabled": self.disabled}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "stats" in state:
            self.stats = CacheStats(**state["stats"])

    def remove(self) -> None:
        """Put the original unit back, remove the hooks and close the stores."""
        if self.unit.owner.__dict__.get(self.unit.attribute) is self._wrapper:
            del self.unit.owner.__dict__[self.unit.attribute]
        else:
            log.warning("vision_cache: %s was wrapped again after the cache; left in place", self.unit.name)
        for handle in self._hooks:
            handle.remove()
        for store in self.stores.values():
            store.close()
        self.stores.clear()


def _on_host(inputs: list[tuple[Tensor | None, ...]]) -> list[tuple[Tensor | None, ...]]:
    """The images' tensors on the CPU: device tensors are copied without a sync each (pinned, non-blocking), then
    the stream is waited for once."""
    devices = {t.device for one in inputs for t in one if t is not None and t.device.type != "cpu"}
    if not devices:
        return inputs
    # aten _to_copy pins the CPU result of a non-blocking copy from CUDA (TensorConversions.cpp, `pin_out`), so the
    # copies queue on the stream and one wait below covers them all.
    host = [tuple(None if t is None else t.detach().to("cpu", non_blocking=True) for t in one) for one in inputs]
    for device in devices:
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
        elif (synchronize := getattr(getattr(torch, device.type, None), "synchronize", None)) is not None:
            synchronize()
    return host


def _layout(adapter: Any) -> str:
    return getattr(adapter, "layout", type(adapter).__name__)


def _short(text: str, limit: int = 160) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"

