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

``quantize: 4bit`` is QLoRA: the frozen Linear layers all-linear would adapt are stored in 4 bits through bitsandbytes
(``quant_type``, ``double_quant``, ``compute_dtype``: ``BitsAndBytesConfig``'s ``bnb_4bit_*`` fields), on CUDA only.
A model loaded with ``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))`` is already
quantized and used as it is.

Usage in a hand-written loop::

    model = apply_lora(model, LoRASpec(enabled=True, r=8, modules_to_save=["multi_modal_projector"]))
    optimizer = torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import re
from collections.abc import Callable, Iterable
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Literal

import torch
from pydantic import model_validator
from torch import nn

from vlmfast.common.sections import Field, Section, SpecError
from vlmfast.strategies.base import Strategy

__all__ = ["LoRA", "LoRASpec", "apply_lora", "frozen_fingerprint", "is_peft_model", "is_quantized",
           "lora_target_modules", "quantize_4bit", "quantize_refusal", "require_peft"]

log = logging.getLogger(__name__)

Tower = Literal["language", "vision"]
COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class LoRASpec(Section):
    """LoRA adapters (PEFT) on the language model, the base frozen (docs/lora.md); needs: pip install 'vlmfast[lora]'"""

    enabled: bool = Field(False, description="train low-rank adapters instead of the full model (needs peft)")
    r: int = Field(8, ge=1, description="rank of each adapter")
    alpha: float = Field(16.0, gt=0, description="scaling numerator (PEFT's lora_alpha): updates scale by alpha / r; "
                         "NOTE the default 16 differs from PEFT's 8 (at r 8: scale 2, PEFT's 1)")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapters' input (PEFT's lora_dropout)")
    target_modules: Literal["all-linear"] | list[str] = Field(
        "all-linear", description="all-linear: every Linear of the towers below but the output head; or module names "
        "(PEFT matches a name or a dotted suffix). NOTE PEFT's default is none (a preset per model type, often "
        "q_proj and v_proj only)")
    towers: list[Tower] = Field(["language"], min_length=1, description=(  # pydantic copies a mutable default
        "where all-linear puts adapters: language (the model around the input embedding), vision (everything outside "
        "it: the vision tower, the projector)"))
    modules_to_save: list[str] = Field(default_factory=list, description="modules trained fully next to the "
                                       "adapters, e.g. [multi_modal_projector]")
    quantize: Literal["none", "4bit"] = Field("none", description=(
        "4bit: QLoRA, the frozen Linear layers of the towers above stored in 4 bits (bitsandbytes' Linear4bit, as "
        "transformers' load_in_4bit); needs CUDA and pip install bitsandbytes"))
    quant_type: Literal["nf4", "fp4"] = Field("nf4", description="4-bit data type (bnb_4bit_quant_type)")
    double_quant: bool = Field(True, description="quantize the quantization constants too (bnb_4bit_use_double_quant)")
    compute_dtype: Literal["bf16", "fp16", "fp32"] = Field("bf16", description=(
        "dtype of the 4-bit layers' matmul for fp16 inputs (bnb_4bit_compute_dtype; bitsandbytes computes fp32 and "
        "bf16 inputs in their own dtype)"))

    @model_validator(mode="after")
    def _check_quantize(self) -> LoRASpec:
        if self.quantize != "none" and not self.enabled:
            raise ValueError(f"lora.quantize: {self.quantize} quantizes the frozen base under LoRA adapters: set "
                             "lora.enabled: true, or lora.quantize: none")
        return self


def _scale_text(r: int, alpha: float, rslora: bool = False) -> str:
    """'r 8, alpha 16, scale alpha / r = 2': what multiplies each adapter's update (rsLoRA: alpha / sqrt(r))."""
    scale, rule = (alpha / r**0.5, "alpha / sqrt(r)") if rslora else (alpha / r, "alpha / r")
    return f"r {r}, alpha {alpha:g}, scale {rule} = {scale:.4g}"


def _scale_of(model: nn.Module) -> str:
    """_scale_text of a PEFT model's (first) LoRA config, as PEFT reads it."""
    config = next(iter(getattr(model, "peft_config", {}).values()), None)
    if config is None or not hasattr(config, "lora_alpha"):
        return "no LoRA config"
    return _scale_text(config.r, config.lora_alpha, bool(getattr(config, "use_rslora", False)))


def require_peft() -> Any:
    """The ``peft`` module, or an ImportError naming the extra to install."""
    try:
        import peft
    except ImportError as exc:
        raise ImportError("lora.enabled needs peft: pip install 'vlmfast[lora]' (or pip install peft), or turn "
                          "lora.enabled off") from exc
    return peft


def quantize_refusal(spec: LoRASpec, device: torch.device | str) -> str | None:
    """Why ``spec.quantize`` cannot run on ``device`` here, or None: said before any work (``check_environment``)."""
    if spec.quantize == "none":
        return None
    device = torch.device(device)
    missing = [f"the device is {device.type}"] if device.type != "cuda" else []
    if importlib.util.find_spec("bitsandbytes") is None:
        missing.append("bitsandbytes is not installed")
    if not missing:
        return None
    return (f"lora.quantize: {spec.quantize} (QLoRA) needs a CUDA device and bitsandbytes (pip install "
            f"bitsandbytes), but {' and '.join(missing)}: run it on a GPU, or set lora.quantize: none to train the "
            "adapters on the full-precision base")


def is_quantized(model: nn.Module) -> bool:
    """Whether ``model``'s base is k-bit (transformers' and :func:`quantize_4bit`'s ``is_loaded_in_4bit``/``8bit``)."""
    return bool(getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False))


def quantize_4bit(model: nn.Module, names: Iterable[str], spec: LoRASpec) -> nn.Module:
    """The ``nn.Linear`` layers ``names`` of ``model`` (on a CUDA device) as bitsandbytes ``Linear4bit``, in place.

    What ``from_pretrained(quantization_config=BitsAndBytesConfig(load_in_4bit=True, ...))`` does while it loads,
    done on a model already in memory with the same functions: ``Bnb4BitHfQuantizer._process_model_before_weight_
    loading`` calls ``transformers.integrations.bitsandbytes.replace_with_bnb_linear`` (every other Linear named in
    ``modules_to_not_convert``), which puts empty ``bnb.nn.Linear4bit`` layers on the meta device; then, per weight,
    ``Bnb4bitQuantize.convert`` builds ``bnb.nn.Params4bit(value, requires_grad=False, **meta_param.__dict__)`` and
    ``.to(device)`` quantizes it (``Params4bit._quantize``); ``_process_model_after_weight_loading`` sets
    ``is_loaded_in_4bit``, which PEFT reads to give the adapters bitsandbytes' LoRA layers (``dispatch_bnb_4bit``).
    Usage: ``quantize_4bit(model.cuda(), lora_target_modules(model), LoRASpec(enabled=True, quantize="4bit"))``"""
    from transformers import BitsAndBytesConfig
    from transformers.integrations.bitsandbytes import replace_with_bnb_linear
    from transformers.pytorch_utils import Conv1D

    chosen = set(names)
    originals = {name: (m.weight, m.bias) for name, m in model.named_modules()
                 if name in chosen and type(m) is nn.Linear}  # what replace_with_bnb_linear converts (or a Conv1D)
    if not originals:
        raise ValueError("lora.quantize: no nn.Linear layer to quantize")
    device = next(iter(originals.values()))[0].device
    if refusal := quantize_refusal(spec, device):
        raise SpecError(refusal)
    import bitsandbytes as bnb

    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=spec.quant_type,
                                bnb_4bit_use_double_quant=spec.double_quant,
                                bnb_4bit_compute_dtype=COMPUTE_DTYPES[spec.compute_dtype])
    # Patterns (transformers' should_convert_module): escaped, so a name matches itself and nothing else
    keep = [re.escape(name) for name, m in model.named_modules()
            if name not in originals and (type(m) is nn.Linear or isinstance(m, Conv1D))]
    replace_with_bnb_linear(model, modules_to_not_convert=keep, quantization_config=config)
    for name, (weight, bias) in originals.items():
        layer = model.get_submodule(name)
        layer.weight = bnb.nn.Params4bit(weight.data, requires_grad=False, **layer.weight.__dict__).to(device)
        if bias is not None:
            layer.bias = nn.Parameter(bias.data, requires_grad=False)
    model.is_loaded_in_4bit = True
    log.info("lora.quantize: %d Linear layers in 4 bits (%s%s)", len(originals), spec.quant_type,
             ", double quantization" if spec.double_quant else "")
    return model


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
    linear = None
    if targets == "all-linear" or spec.quantize != "none":
        linear = lora_target_modules(model, spec.towers, spec.modules_to_save, probe_batch)
    if targets == "all-linear":
        targets = linear
    if spec.quantize == "4bit" and not is_quantized(model):
        quantize_4bit(model, linear, spec)
    if is_quantized(model):
        # PEFT's QLoRA preparation (peft.utils.other.prepare_model_for_kbit_training): freeze the base, float32 for
        # its fp16/bf16 layers (norms, embeddings) but the 4-bit ones. Activation checkpointing stays the spec's.
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    config = peft.LoraConfig(r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout, target_modules=targets,
                             modules_to_save=list(spec.modules_to_save) or None)
    return peft.get_peft_model(model, config)


def frozen_fingerprint(model: nn.Module) -> str:
    """SHA-256 over every frozen parameter (name, dtype, shape and bytes) and buffer: what a LoRA checkpoint does not
    save, so a resume checks it is the same base, to the last element. An FSDP2 shard (a DTensor) is gathered one
    tensor at a time, so the fingerprint is the unsharded model's; it is then a collective, which every rank calls (the
    trainer's state_dict and resume check do). Usage: ``frozen_fingerprint(model)[:12]``"""
    digest = hashlib.sha256()
    tensors = [(n, p) for n, p in model.named_parameters() if not p.requires_grad] + list(model.named_buffers())
    for name, tensor in sorted(tensors, key=lambda item: item[0]):
        with _gathered(tensor):
            tensor = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # FSDP2: gathered
            data = tensor.detach().reshape(-1)
            digest.update(f"{name}|{data.dtype}|{tuple(tensor.shape)}|".encode())
            for chunk in data.split(1 << 24):  # 16M elements at a time: a bounded host copy of a device tensor
                digest.update(chunk.cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def _gathered(tensor: torch.Tensor) -> AbstractContextManager[Any]:
    """A ZeRO-3 parameter (an empty placeholder per rank) gathered whole for the context, a collective (DeepSpeed's
    ``GatheredParameters``); any other tensor as it is."""
    if not hasattr(tensor, "ds_id"):
        return nullcontext()
    from deepspeed.runtime.zero import GatheredParameters

    return GatheredParameters([tensor])


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
        how = f"the user's PEFT model ({_scale_of(self.model)})" if self.given \
            else f"{_scale_text(self.spec.r, self.spec.alpha)}, {where}"
        if self.spec.quantize != "none" and not self.given:
            how += f", base in {self.spec.quantize} ({self.spec.quant_type})"
        return f"lora: {how}; {trainable:,} of {total:,} parameters train ({trainable / max(total, 1):.2%})"
