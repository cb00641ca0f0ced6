"""Where a VLM's image path is: how it computes image features, which module is its vision tower and which run after
it (the projector). Learned from the model itself, never from a list of attribute names or model types.

Two probes, one answer (``tests/test_zoo.py`` checks that they agree on every zoo family):

- **Stand-in call** (from the model alone: the memory estimate on the meta device, the rank-balance cost model, the
  cache built in a hand-written loop): the model's ``get_image_features`` is called on a stand-in image with a
  forward pre-hook on every module that stops the call at the first module it enters (arguments it requires besides
  the image get None, else the image's height and width). Nothing is computed (it works on the meta device); the
  model's own code decides which module takes the images first. The projector is then what the call runs after the
  tower, the text embeddings aside, seen by running it on fake tensors (shapes only); where that run cannot go (a
  patch layout the stand-in does not fit, a step that reads values), what the tower's owner holds besides the tower
  and the text model (the modules holding the text embeddings).
- **Probe forward** (:func:`learn_image_path`, one no-grad forward of a training sample with an image): the tower is
  the first module the ``get_image_features`` call enters, the projector what the call runs after it; for a model
  without that method (Mllama, Phi-4-multimodal, a custom model), the tower is the outermost module below the model
  that the image tensor (a floating batch tensor of four or more dimensions: ``[N, C, H, W]`` and up), or a view of
  it, flows into with no other floating input (not a module that merges image features into the text embeddings, as
  Phi-4's ``embed_tokens_extend`` and its image half do), and that does not hold the text embeddings.

When neither decides, the caller asks for the module path (``vision_cache.module``, ``tower=``).

Usage::

    found = find_image_modules(model)                      # ImageModules(tower='model.vision_tower', ...)
    found = find_image_modules(model, batches=[batch])     # a probe forward when the stand-in call cannot decide
    path = learn_image_path(model, [batch])                # modality sync: the image call, its input and its place
"""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

__all__ = ["ImageModules", "ImagePath", "find_image_modules", "learn_image_path"]

log = logging.getLogger(__name__)


@dataclass
class ImagePath:
    """How the model computes image features, as one probe forward showed it."""

    owner: str  # the module whose ``get_image_features`` the forward called ("" for the root)
    args: tuple[Any, ...]  # that call's arguments (tensors detached, on the CPU): the stand-in's input
    kwargs: dict[str, Any]
    entry: str  # the first module the call ran (its pre-hook says "the image path ran"): the vision tower
    trigger: tuple[str, int] | None  # (module, how many times it had run before): the forward went on there
    image_key: str | None  # the forward argument holding the images
    modules: tuple[str, ...] = ()  # the outermost modules the call ran, in order: the tower, then the projector


@dataclass(frozen=True)
class ImageModules:
    """The vision tower's path and the projector's (the modules the image call runs after the tower, outside it)."""

    tower: str
    projectors: tuple[str, ...]
    learned: str  # how: "given", "stand-in call" or "probe forward"
    # the projectors are what the call ran after the tower (a shape-only run, a probe forward), not what the tower's
    # owner holds besides it and the text model (a guess: Qwen2.5-Omni's holds its audio tower too)
    seen: bool = False


def find_image_modules(model: nn.Module, batches: Iterable[Any] | None = None,
                       tower: str | None = None) -> ImageModules:
    """The image path of `model`: `tower` when given, else the stand-in call, else a probe forward on `batches`
    (mappings on the model's device; only read when the stand-in call cannot decide). Raises ValueError saying why
    when nothing decides."""
    if tower is not None:
        try:
            model.get_submodule(tower)
        except AttributeError as exc:
            raise ValueError(f"'{tower}' is not a sub-module of {type(model).__name__}") from exc
        return ImageModules(tower, _held_besides(model, tower), "given")
    found = _stand_in_call(model)
    if found is not None:
        tower, ran = found
        if ran is not None:
            return ImageModules(tower, ran, "stand-in call", seen=True)
        return ImageModules(tower, _held_besides(model, tower), "stand-in call")
    if batches is not None:
        record = _probe(model, batches, need_owner=False)
        if record is not None and "entry" in record:
            text = _text_embeddings(model)
            ran = tuple(path for path in record["ran"][1:]
                        if not any(id(m) in text for m in model.get_submodule(path).modules()))
            return ImageModules(record["entry"], ran, "probe forward", seen=True)
        if record is not None and "flow" in record:
            return ImageModules(record["flow"], (), "probe forward", seen=True)
    probed = ("a probe forward of the first samples showed no image flowing into a module" if batches is not None
              else "no sample was given for a probe forward")
    raise ValueError(f"no vision tower found in {type(model).__name__} (no get_image_features call entered a module "
                     f"on a stand-in image, and {probed})")


# ---- the stand-in call ------------------------------------------------------------------------------------------
class _Entered(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def _stand_in_call(model: nn.Module) -> tuple[str, tuple[str, ...] | None] | None:
    """The first module the model's (outermost) ``get_image_features`` enters on a stand-in image, stopped there;
    with what the call runs after it (:func:`_ran_after`), or None where a shape-only run of the call fails."""
    owner = next((m for _, m in model.named_modules() if callable(getattr(m, "get_image_features", None))), None)
    if owner is None:
        return None
    # The model's own get_image_features, not an instance-level stand-in for it (a vision cache's lookup, a probe's
    # recorder); hooks prepended: the call stops before any other pre-hook (the user's, a cache's) sees the stand-in.
    wrapped = {m: m.__dict__.pop("get_image_features") for m in model.modules() if "get_image_features" in m.__dict__}
    hooks = [m.register_forward_pre_hook(_stop(name), prepend=True) for name, m in model.named_modules() if name]
    try:
        method = getattr(owner, "get_image_features", None)
        if not callable(method):
            return None
        required = [p.name for p in _positional(method)[1:] if p.default is inspect.Parameter.empty]
        channels, size = _image_shape(model)
        # The other arguments it requires: None, else the image's height and width (what image_sizes-like ones take)
        for values in itertools.product((None, torch.tensor([[size, size]])), repeat=min(len(required), 3)):
            for shape in ((1, channels, size, size), (1, 1, channels, size, size)):  # an image; a row of slots
                arguments = dict(zip(required, values, strict=False))
                try:
                    with torch.no_grad():
                        method(torch.zeros(shape), **arguments)
                except _Entered as entered:
                    for hook in hooks:
                        hook.remove()
                    hooks.clear()
                    return entered.name, _ran_after_once(model, method, shape, arguments, entered.name)
                except Exception as exc:  # this stand-in is not the call's layout: the next one
                    log.debug("image path: stand-in %s for get_image_features failed (%s)", shape, exc)
    finally:
        for hook in hooks:
            hook.remove()
        for module, stand_in in wrapped.items():
            module.__dict__["get_image_features"] = stand_in
    return None


_RAN_AFTER: dict[tuple[Any, ...], tuple[str, ...] | None] = {}  # architecture -> what runs after the tower


def _ran_after_once(model: nn.Module, method: Callable[..., Any], shape: tuple[int, ...],
                    arguments: dict[str, Any], tower: str) -> tuple[str, ...] | None:
    """:func:`_ran_after`, remembered per architecture: the same class, module tree and config run the same modules
    on the same stand-in shapes, and the fake-tensor run costs ~0.4 s (a fresh fake mode converts every weight);
    a model without a serialisable config is probed every time."""
    to_json = getattr(getattr(model, "config", None), "to_json_string", None)
    try:
        config = to_json() if callable(to_json) else None
    except (TypeError, ValueError):  # a value json cannot write
        config = None
    if config is None:
        return _ran_after(model, method, shape, arguments, tower)
    key = (type(model), tuple((name, type(m)) for name, m in model.named_modules()), config, shape,
           repr(sorted(arguments.items())), tower)
    if key not in _RAN_AFTER:
        if len(_RAN_AFTER) >= 64:
            _RAN_AFTER.pop(next(iter(_RAN_AFTER)))
        _RAN_AFTER[key] = _ran_after(model, method, shape, arguments, tower)
    return _RAN_AFTER[key]


def _ran_after(model: nn.Module, method: Callable[..., Any], shape: tuple[int, ...], arguments: dict[str, Any],
               tower: str) -> tuple[str, ...] | None:
    """The outermost modules the image call runs after the tower, the text embeddings aside (Chameleon's VQ
    quantizer, not its decoder layers), from a run of the call on fake tensors (shapes only: nothing computed, no
    memory); None when the call does not run that way (a layout the stand-in does not fit, a data-dependent step)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    ran: list[str] = []

    def enter(name: str) -> Callable[..., None]:
        def record(module: nn.Module, args: Any) -> None:
            if not any(name == r or name.startswith(f"{r}.") for r in ran):
                ran.append(name)
        return record

    weight = next(model.get_submodule(tower).parameters(), None)
    state = _module_state(model)  # a module that keeps a tensor of the call (a cache) gets its own value back
    for m in model.modules():  # pre-hooks (a user's, vlmfast's) never see fake inputs: restored below. Forward
        m._forward_pre_hooks.clear()  # hooks stay: transformers' output capture (hidden_states) lives there
    hooks = [m.register_forward_pre_hook(enter(name)) for name, m in model.named_modules() if name]
    try:
        with FakeTensorMode(allow_non_fake_inputs=True), torch.no_grad():
            image = torch.zeros(shape, device=weight.device if weight is not None else None,
                                dtype=weight.dtype if weight is not None and weight.is_floating_point() else None)
            method(image, **arguments)
    except Exception as exc:  # not a failure of the model's: the owner's children stand in (_held_besides)
        log.debug("image path: a shape-only run of get_image_features failed (%s)", exc)
        return None
    finally:
        for hook in hooks:
            hook.remove()
        _restore_module_state(state)
    if tower not in ran:
        return None
    text = _text_embeddings(model)
    return tuple(path for path in ran[ran.index(tower) + 1:]
                 if not any(id(m) in text for m in model.get_submodule(path).modules()))


def _module_state(model: nn.Module) -> list[tuple[dict[str, Any], dict[str, Any]]]:
    """Per module: its attribute dicts (own, parameters, buffers, and those of the plain objects it holds: Chameleon's
    vocabulary mapping caches a tensor in a cached_property) and a shallow copy of each."""
    dicts = [d for m in model.modules() for d in (m.__dict__, m._parameters, m._buffers)]
    held = [v if isinstance(v, dict) else vars(v) for m in model.modules() for v in list(m.__dict__.values())
            if isinstance(v, dict) or (not isinstance(v, (nn.Module, torch.Tensor, type))
                                       and isinstance(getattr(v, "__dict__", None), dict))]
    return [(d, dict(d)) for d in (*dicts, *held)]


def _restore_module_state(state: list[tuple[dict[str, Any], dict[str, Any]]]) -> None:
    for live, saved in state:
        for key in [k for k in live if k not in saved]:
            del live[key]
        for key, value in saved.items():
            if live.get(key) is not value:
                live[key] = value


def _stop(name: str) -> Callable[..., None]:
    def stop(module: nn.Module, args: Any) -> None:
        raise _Entered(name)
    return stop


def _image_shape(model: nn.Module) -> tuple[int, int]:
    """(channels, size) of a stand-in image: the vision config's, else 3 x 224."""
    config = getattr(model, "config", None)
    for source in (getattr(config, "vision_config", None), config):
        size = getattr(source, "image_size", None)
        if isinstance(size, int):
            channels = getattr(source, "num_channels", 3)
            return (channels if isinstance(channels, int) else 3), size
    return 3, 224


def _held_besides(model: nn.Module, tower: str) -> tuple[str, ...]:
    """The projector, structurally: what the tower's owner (the deepest module above it with get_image_features)
    holds besides the tower and the text model (modules holding the text embeddings), parameters included."""
    parts = tower.split(".")
    owner_path = next((p for p in (".".join(parts[:d]) for d in range(len(parts) - 1, -1, -1))
                       if callable(getattr(model.get_submodule(p) if p else model, "get_image_features", None))), None)
    if owner_path is None:
        return ()
    owner, text = model.get_submodule(owner_path) if owner_path else model, _text_embeddings(model)
    out = []
    for name, child in owner.named_children():
        path = f"{owner_path}.{name}" if owner_path else name
        if path == tower or tower.startswith(f"{path}.") or not any(True for _ in child.parameters()):
            continue
        if not any(id(m) in text for m in child.modules()):
            out.append(path)
    return tuple(out)


def text_embedding_modules(model: nn.Module) -> list[nn.Module]:
    """The model's input and output embedding modules (where token ids go in and logits come out), those it has."""
    out = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, getter)()
        except (AttributeError, NotImplementedError, TypeError):
            continue
        if isinstance(module, nn.Module):
            out.append(module)
    return out


def _text_embeddings(model: nn.Module) -> set[int]:
    return {id(module) for module in text_embedding_modules(model)}


# ---- the probe forward ------------------------------------------------------------------------------------------
def learn_image_path(model: nn.Module, batches: Iterable[Any]) -> ImagePath | None:
    """The :class:`ImagePath` of `model` from the first of `batches` (mappings, on the model's device) whose forward
    calls ``get_image_features``; None when the model has no such method or no batch ran it."""
    record = _probe(model, batches, need_owner=True)
    if record is None or "owner" not in record or "entry" not in record:
        return None
    return ImagePath(record["owner"], _to(record["args"], "cpu"), _to(record["kwargs"], "cpu"), record["entry"],
                     record.get("trigger"), _image_key(record), tuple(record["ran"]))


def _probe(model: nn.Module, batches: Iterable[Any], need_owner: bool) -> dict[str, Any] | None:
    """One no-grad forward (eval mode) per batch until one calls ``get_image_features`` (or, unless `need_owner`,
    sends an image tensor into a module); what it ran, recorded by pre-hooks on every module."""
    owners = {name: m for name, m in model.named_modules() if callable(getattr(m, "get_image_features", None))}
    if need_owner and not owners:
        return None
    text = _text_embeddings(model)
    record: dict[str, Any] = _fresh()
    hooks = [m.register_forward_pre_hook(
        _watcher(record, name, any(id(sub) in text for sub in m.modules())), with_kwargs=True)
        for name, m in model.named_modules()]
    hooks.append(model.register_forward_pre_hook(lambda _m, _a, kwargs: record.update(forward=kwargs),
                                                 with_kwargs=True))
    for name, owner in owners.items():
        owner.get_image_features = _recording(record, name, owner.get_image_features)  # removed below
    was_training = model.training
    model.eval()  # no running statistics updated, no random numbers drawn: training starts as it would have
    try:
        for batch in batches:
            if not isinstance(batch, Mapping):
                continue
            images = {v.untyped_storage().data_ptr() for v in batch.values() if _image_like(v)}
            if not owners and not images:
                continue  # nothing an image could flow from: no forward needed
            record.clear()
            record.update(_fresh(), images=images)
            try:
                with torch.no_grad():
                    model(**batch)
            except Exception as exc:  # a batch only the user's loss_fn can take: nothing learned from it
                log.debug("image path: probe forward failed (%s)", exc)
                record.clear()
                record.update(_fresh())
                continue
            if "flow_mixed" in record and "flow" not in record:  # the images change before any tower (a cast)
                record["flow"] = record["flow_mixed"]
            if "owner" in record or (not need_owner and "flow" in record):
                return record
    finally:
        model.train(was_training)
        for hook in hooks:
            hook.remove()
        for owner in owners.values():
            del owner.get_image_features  # the instance attribute: the class's method is back
    return None


def _fresh() -> dict[str, Any]:
    return {"depth": 0, "counts": {}, "ran": [], "images": set()}


def _image_like(value: Any) -> bool:
    """A floating tensor of four or more dimensions: images ``[N, C, H, W]`` and up, never text (ids ``[B, T]``,
    embeddings ``[B, T, D]``)."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 4 and value.numel() > 0


def _watcher(record: dict[str, Any], name: str, holds_text: bool) -> Callable[..., None]:
    def watch(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if record["depth"]:  # inside the image call
            record.setdefault("entry", name)
            ran = record["ran"]
            if not any(name == r or name.startswith(f"{r}.") for r in ran):
                ran.append(name)
            return
        if "owner" in record and "trigger" not in record:
            record["trigger"] = (name, record["counts"].get(name, 0))
        record["counts"][name] = record["counts"].get(name, 0) + 1
        if not name or holds_text or "flow" in record or not record["images"]:
            return
        floating = [t for t in (*args, *kwargs.values()) if isinstance(t, torch.Tensor) and t.is_floating_point()]
        images = [t.untyped_storage().data_ptr() in record["images"] for t in floating]
        if any(images):  # the outermost module below the model the images flow into, text aside
            record.setdefault("flow_mixed", name)
            if all(images):  # ... and nothing else floating: not a module that merges them into the text's
                record["flow"] = name  # embeddings (Phi-4's embed_tokens_extend and its image half): its tower
    return watch


def _recording(record: dict[str, Any], name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any, **kwargs: Any) -> Any:
        outermost = record["depth"] == 0 and "owner" not in record
        record["depth"] += 1
        try:
            output = method(*args, **kwargs)
        finally:
            record["depth"] -= 1
        if outermost:
            first = _positional(method)
            record.update(owner=name, args=_detached(args), kwargs=_detached(kwargs),
                          image=args[0] if args else kwargs.get(first[0].name if first else None))
        return output
    return call


def _positional(method: Callable[..., Any]) -> list[inspect.Parameter]:
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    return [p for p in inspect.signature(method).parameters.values() if p.kind in kinds]


def _image_key(record: dict[str, Any]) -> str | None:
    """The forward argument that is the image call's first argument (the same tensor object)."""
    image, forward = record.get("image"), record.get("forward", {})
    for key, value in forward.items():
        if value is image and isinstance(value, torch.Tensor):
            return key
    return None


def _detached(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_detached(v) for v in value)
    if isinstance(value, Mapping):
        return {k: _detached(v) for k, v in value.items()}
    return value


def _to(value: Any, device: Any, dtype: torch.dtype | None = None) -> Any:
    """`value` with its tensors on `device`, floating ones in `dtype` (the tower's: DeepSpeed holds bf16 weights)."""
    if isinstance(value, torch.Tensor):
        value = value.to(device) if device is not None else value
        return value.to(dtype) if dtype is not None and value.is_floating_point() else value
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device, dtype) for v in value)
    if isinstance(value, Mapping):
        return {k: _to(v, device, dtype) for k, v in value.items()}
    return value
