"""Every rank runs the model's image path on a micro-batch where any rank has images, so ranks never desynchronise.

A VLM skips its vision tower and projector on a text-only batch. With several ranks that splits them: DDP waits for
the tower's gradients, ZeRO-2 reduces gradient buckets laid out differently per rank, and ZeRO-3 / FSDP2 all-gather
the tower's weights on the ranks with images only (DeepSpeed#7170, Qwen3-VL#126: a hang or a collective mismatch).

The mechanism, measured on the model rather than guessed from names:

1. **Learn once, before the engine wraps the model** (:func:`learn_image_path`): one no-grad forward of a probe
   sample with an image records which method computes the image features (the model's own ``get_image_features``),
   its arguments (the stand-in's input), the first module it runs (its entry: "the image path ran"), the module
   the forward starts right after it (the stand-in's point, so ZeRO-3 / FSDP2 gather in the same order on every
   rank), and which forward argument holds the images.
2. **Agree per training forward**: one host all-reduce (MAX) of "this micro-batch has images" (not under DDP, which
   needs every parameter in every backward: there every text-only micro-batch stands in, no agreement needed).
3. **Stand in**: on a rank whose micro-batch has none while another's has, ``get_image_features`` runs on the learned
   input at the learned point, and the features it returns (only those the model consumes: the tower's unused last
   layer stays unused, as on the ranks with images) join the loss with weight 0. Every rank then gathers, computes
   and reduces the same parameters in the same order; the gradient is unchanged (exact zeros added).

Usage (your own loop, before wrapping the model; ``batches`` yields a few collated training batches)::

    model = ModalitySync(lambda: batches).apply(model)
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn

from vlmfast.common.image_path import ImagePath, _to, learn_image_path
from vlmfast.engines.collectives import any_rank, gather_objects, world_size
from vlmfast.strategies.base import Strategy

log = logging.getLogger(__name__)

ProbeBatches = Callable[[], Iterable[Any]]


class ModalitySync(Strategy):
    """Runs the model's image path with weight 0 on ranks whose micro-batch has no image while another's has."""

    name = "modality_sync"

    def __init__(self, probe_batches: ProbeBatches | None, every_forward: bool = False, always: bool = False) -> None:
        self.probe_batches = probe_batches
        # DDP (without find_unused_parameters) needs every parameter used in every backward, text-only micro-batches
        # on all ranks included: stand in on each of them, and no agreement is needed
        self.always = always
        # Sharded weights (ZeRO-3, FSDP2) are gathered by no-grad forwards too (vlmfast's label probe, evaluation):
        # those must stand in as well. Otherwise only training forwards need it.
        self.every_forward = every_forward
        self.path: ImagePath | None = None
        self.shared = False  # every rank adopted one learned path (first training forward)
        self.stand_ins = 0
        self._owner: nn.Module | None = None
        self._model: nn.Module | None = None
        self._hooks: list[Any] = []
        self._reset(armed=False)

    def _reset(self, armed: bool) -> None:
        self._armed, self._ran, self._calls, self._pending = armed, False, 0, []
        self._device: torch.device | None = None

    # ---- setup -------------------------------------------------------------------------------------------------
    def apply(self, model: nn.Module) -> nn.Module:
        self._model = model
        if self.probe_batches is not None:
            self.path = learn_image_path(model, self.probe_batches())
        self._hooks += [model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
                        model.register_forward_hook(self._after_forward)]
        self._install()
        return model

    def _install(self) -> None:
        """Hooks at the learned entry (the image path ran) and trigger (where a stand-in runs)."""
        if self.path is None or self._model is None or self._owner is not None:
            return
        model, path = self._model, self.path
        self._owner = model.get_submodule(path.owner)
        self._hooks.append(model.get_submodule(path.entry).register_forward_pre_hook(self._entered))
        if path.trigger is not None:
            self._hooks.append(model.get_submodule(path.trigger[0]).register_forward_pre_hook(self._at_trigger))

    # ---- hooks -------------------------------------------------------------------------------------------------
    def _before_forward(self, module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
        if not (torch.is_grad_enabled() or self.every_forward):
            self._reset(armed=False)  # evaluation and probes of unsharded weights: no collective inside
            return
        if not self.shared:
            self._share()
        image = kwargs.get(self.path.image_key) if self.path and self.path.image_key else None
        mine = isinstance(image, torch.Tensor) and image.numel() > 0
        anyone = self.always or any_rank(mine)  # the one collective: before any module runs, on every rank
        if anyone and not mine and self.path is None and not self.always:
            raise RuntimeError(
                "modality sync: another rank's micro-batch has images and this rank's has none, but vlmfast could "
                "not learn how the model computes image features (no probed training sample ran the model's "
                "get_image_features): put a sample with an image among the first training samples, or give every "
                "micro-batch the same modalities")
        self._reset(armed=anyone and not mine)
        self._device = next((v.device for v in kwargs.values() if isinstance(v, torch.Tensor)), None)

    def _entered(self, module: nn.Module, args: Any) -> None:
        self._ran = True

    def _at_trigger(self, module: nn.Module, args: Any) -> None:
        self._calls += 1
        if self.path is not None and self.path.trigger is not None and self._calls > self.path.trigger[1]:
            self._stand_in()

    def _stand_in(self) -> None:
        """The image path on the learned input, its features with weight 0 (once per forward, where it is armed)."""
        if not self._armed or self._ran or self.path is None or self._owner is None:
            return
        self._ran = True
        dtype = next((p.dtype for p in self._owner.parameters() if p.is_floating_point()), None)
        args, kwargs = (_to(v, self._device, dtype) for v in (self.path.args, self.path.kwargs))
        features = _features(self._owner.get_image_features(*args, **kwargs))
        if torch.is_grad_enabled():  # a no-grad forward only needed the gathers
            zero = sum((f.float().sum() for f in features), torch.zeros((), device=self._device)) * 0.0
            self._pending.append(zero)
            self.stand_ins += 1

    def _after_forward(self, module: nn.Module, args: Any, output: Any) -> Any:
        self._stand_in()  # no trigger learned (the image call came last): here, which keeps DDP and ZeRO-1/2 in step
        if not self._pending:
            return None
        zero, self._pending = sum(self._pending[1:], self._pending[0]), []
        return _add_to_output(output, zero)

    def _share(self) -> None:
        """Every rank adopts the lowest learning rank's path (ranks whose probe samples had no image learn too)."""
        self.shared = True
        if world_size() == 1:
            return
        learned = next((p for p in gather_objects(self.path) if p is not None), None)
        if self.path is None and learned is not None:
            self.path = learned
            self._install()

    def describe(self) -> str | None:
        if self.path is None:
            return None
        where = f"before {self.path.trigger[0]}" if self.path.trigger else "at the end of the forward"
        return (f"modality sync: {self.path.owner or 'model'}.get_image_features runs {where} with weight 0 on "
                f"ranks without images while another rank has some ({self.stand_ins} stand-ins)")


def _features(output: Any) -> list[torch.Tensor]:
    """What the model consumes of a ``get_image_features`` result: a tensor, or a ModelOutput's ``pooler_output``."""
    if isinstance(output, torch.Tensor):
        return [output]
    pooled = output.get("pooler_output") if isinstance(output, Mapping) else getattr(output, "pooler_output", None)
    if isinstance(pooled, torch.Tensor):
        return [pooled]
    if isinstance(pooled, (list, tuple)) and all(isinstance(t, torch.Tensor) for t in pooled):
        return list(pooled)
    if isinstance(output, (list, tuple)) and output and all(isinstance(t, torch.Tensor) for t in output):
        return list(output)
    raise TypeError(f"modality sync: get_image_features returned a {type(output).__name__} without a tensor or "
                    "pooler_output: vlmfast cannot tell which image features the model uses")


def _add_to_output(output: Any, zero: torch.Tensor) -> Any:
    """`output` with `zero` added to its loss, or (no loss: the user's loss_fn reads the logits) its first floating
    tensor."""
    if isinstance(output, torch.Tensor):
        return output + zero.to(output.dtype)
    loss = output.get("loss") if isinstance(output, Mapping) else getattr(output, "loss", None)
    key = "loss" if isinstance(loss, torch.Tensor) else next(
        (k for k, v in (output.items() if isinstance(output, Mapping) else ())
         if isinstance(v, torch.Tensor) and v.is_floating_point()), None)
    if key is None:
        raise RuntimeError("modality sync: the model's output has no loss or floating tensor to carry the image "
                           "path's weight-0 stand-in")
    output[key] = output[key] + zero.to(output[key].dtype)
    return output
