"""LoRA fine-tuning through PEFT: low-rank adapters on the language model, the rest frozen (``lora`` section).

`lora: {enabled, r, alpha, dropout, target_modules, modules_to_save, towers}` - PEFT's own names where it has them
(``r``, ``lora_alpha`` as ``alpha``, ``lora_dropout`` as ``dropout``, ``target_modules``, ``modules_to_save``).
``target_modules: all-linear`` (the default) means every ``nn.Linear`` of the towers in ``towers`` except the
output head; ``towers: [language]`` (the default) puts adapters on the language model only, ``[language, vision]``
also on everything outside it (the vision tower and the projector). The language model is learned from the model,
not from its type: the smallest module holding the input embedding (``get_input_embeddings()``, else the first
embedding a probe batch's token ids reach) together with layers to adapt. Modules listed in ``modules_to_save``
(e.g. the projector) train fully; everything else is frozen. A model the user already wrapped with PEFT is used as
it is.

Usage in a hand-written loop::

    model = apply_lora(model, LoRASpec(enabled=True, r=8, modules_to_save=["multi_modal_projector"]))
    optimizer = torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterable
from typing import Any, Literal

import torch
from torch import nn

from vlmfast.common.sections import Field, Section
from vlmfast.strategies.base import Strategy

__all__ = ["LoRA", "LoRASpec", "apply_lora", "frozen_fingerprint", "is_peft_model", "lora_target_modules",
           "require_peft"]

log = logging.getLogger(__name__)

Tower = Literal["language", "vision"]


class LoRASpec(Section):
    """LoRA adapters (PEFT) on the language model, the base frozen (docs/lora.md); needs: pip install 'vlmfast[lora]'"""

    enabled: bool = Field(False, description="train low-rank adapters instead of the full model (needs peft)")
    r: int = Field(8, ge=1, description="rank of each adapter")
    alpha: float = Field(16.0, gt=0, description="scaling numerator (PEFT's lora_alpha): updates scale by alpha / r")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input (PEFT's lora_dropout)")
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear", description="all-linear: every Linear of the towers below but the output head; or module names "
        "(PEFT matches a name or a dotted suffix)")
    towers: list[Tower] = Field(["language"], min_length=1, description=(  # pydantic copies a mutable default
        "where all-linear puts adapters: language (the model around the input embedding), vision (everything outside "
        "it: the vision tower, the projector)"))
    modules_to_save: list[str] = Field(default_factory=list, description="modules trained fully next to the "
                                       "adapters, e.g. [multi_modal_projector]")


def require_peft() -> Any:
    """The ``peft`` module, or an ImportError naming the extra to install."""
    try:
        import peft
    except ImportError as exc:
        raise ImportError("lora.enabled needs peft: pip install 'vlmfast[lora]' (or pip install peft), or turn "
                          "lora.enabled off") from exc
    return peft


def is_peft_model(model: nn.Module) -> bool:
    """Whether ``model`` is already a PEFT model (wrapped by the user): used as it is."""
    return callable(getattr(model, "get_base_model", None)) and hasattr(model, "peft_config")


def _language_model(model: nn.Module, embedding: nn.Module) -> str:
    """The path of the smallest module that holds ``embedding`` and a Linear layer besides it."""
    paths = {id(m): name for name, m in model.named_modules()}
    path = paths.get(id(embedding))
    if path is None:
        raise ValueError(f"lora: the input embedding {type(embedding).__name__} is not a sub-module of the model")
    parts = path.split(".") if path else []
    for depth in range(len(parts) - 1, -1, -1):
        candidate = ".".join(parts[:depth])
        module = model.get_submodule(candidate) if candidate else model
        if any(isinstance(m, nn.Linear) for m in module.modules()):
            return candidate
    return ""


def _input_embedding(model: nn.Module, probe_batch: Callable[[], Any] | None) -> nn.Module:
    get = getattr(model, "get_input_embeddings", None)
    if callable(get):
        try:
            embedding = get()
            if isinstance(embedding, nn.Module):
                return embedding
        except (NotImplementedError, AttributeError):
            pass
    if probe_batch is not None:
        from vlmfast.data.sample_checks import embedding_module_reached_by_ids

        found = embedding_module_reached_by_ids(model, probe_batch())
        if found is not None:
            return found
    raise ValueError("lora: cannot find the language model's input embedding (no get_input_embeddings(), and no "
                     "embedding reached by the batch's input_ids): set lora.target_modules to module names")


def lora_target_modules(model: nn.Module, towers: Iterable[str] = ("language",), exclude: Iterable[str] = (),
                        probe_batch: Callable[[], Any] | None = None) -> list[str]:
    """The full names of the ``nn.Linear`` modules ``all-linear`` adapts in ``towers``: never the output head, nor
    anything under ``exclude`` (modules trained fully). Usage: ``lora_target_modules(llava, ["language"])``"""
    language = _language_model(model, _input_embedding(model, probe_batch))
    head = getattr(model, "get_output_embeddings", lambda: None)()
    excluded = tuple(exclude)
    chosen = []
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear) or module is head:
            continue
        if any(name == e or name.startswith(f"{e}.") or f".{e}." in f".{name}." for e in excluded):
            continue
        inside = not language or name == language or name.startswith(f"{language}.")
        if ("language" if inside else "vision") in towers:
            chosen.append(name)
    if not chosen:
        raise ValueError(f"lora: no Linear layer to adapt in {list(towers)} (language model: "
                         f"'{language or 'the root'}'); set lora.target_modules to module names")
    return chosen


def apply_lora(model: nn.Module, spec: LoRASpec, probe_batch: Callable[[], Any] | None = None) -> nn.Module:
    """``model`` with LoRA adapters (a PEFT model; returned as it is when already one). Usage: see module doc."""
    if is_peft_model(model):
        log.info("lora: the model is already a PEFT model: its adapters are used as they are")
        return model
    peft = require_peft()
    targets: Any = spec.target_modules
    if targets == "all-linear":
        targets = lora_target_modules(model, spec.towers, spec.modules_to_save, probe_batch)
    config = peft.LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets,
                             modules_to_save=list(spec.modules_to_save) or None)
    return peft.get_peft_model(model, config)


def frozen_fingerprint(model: nn.Module) -> str:
    """SHA-256 over every frozen parameter (name, dtype, shape and bytes) and buffer: what a LoRA checkpoint does not
    save, so a resume checks it is the same base, to the last element. Usage: ``frozen_fingerprint(model)[:12]``"""
    digest = hashlib.sha256()
    tensors = [(n, p) for n, p in model.named_parameters() if not p.requires_grad] + list(model.named_buffers())
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        data = tensor.detach().reshape(-1)
        digest.update(f"{name}|{data.dtype}|{tuple(tensor.shape)}|".encode())
        for chunk in data.split(1 << 24):  # 16M elements at a time: a bounded host copy of a device tensor
            digest.update(chunk.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


class LoRA(Strategy):
    """The ``lora`` spec section as a trainer strategy: wraps the model first, before any other strategy."""

    name = "lora"

    def __init__(self, spec: LoRASpec, probe_batches: Callable[[], Iterable[Any]] | None = None) -> None:
        self.spec = spec
        self.probe_batches = probe_batches
        self.model: nn.Module | None = None
        self.given = False  # the user passed a PEFT model
        self._fingerprint: str | None = None

    def fingerprint(self) -> str:
        """The frozen base's :func:`frozen_fingerprint`, computed once per run (the base never changes in it)."""
        if self._fingerprint is None:
            self._fingerprint = frozen_fingerprint(self.model)
        return self._fingerprint

    def apply(self, model: nn.Module) -> nn.Module:
        self.given = is_peft_model(model)
        probe = (lambda: next(iter(self.probe_batches()), None)) if self.probe_batches is not None else None
        self.model = apply_lora(model, self.spec, probe)
        return self.model

    def describe(self) -> str:
        if self.model is None:
            return ""
        trainable = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        total = sum(p.numel() for p in self.model.parameters())
        targets = self.spec.target_modules
        where = f"{targets} on {'+'.join(self.spec.towers)}" if isinstance(targets, str) else f"{len(targets)} modules"
        how = "the user's PEFT model" if self.given else f"r {self.spec.r}, alpha {self.spec.alpha:g}, {where}"
        return f"lora: {how}; {trainable:,} of {total:,} parameters train ({trainable / max(total, 1):.2%})"
