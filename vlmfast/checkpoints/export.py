"""Export a trained model in the formats the Hugging Face ecosystem loads.

- a LoRA run (a PEFT model): PEFT's adapter folder (``adapter_config.json``, ``adapter_model.safetensors``), which
  ``PeftModel.from_pretrained(base, folder)`` loads; with ``merge=True`` the merged model instead, a plain
  ``save_pretrained`` folder (the adapters folded into the base weights: no PEFT needed to load it);
- a Hugging Face model: ``save_pretrained`` in safetensors (config, generation config), which ``from_pretrained``
  loads and vLLM serves;
- any other ``nn.Module``: ``model.safetensors`` of its state dict (shared tensors saved once).

``processor`` (a processor or tokenizer) is saved into the same folder. Usage::

    export_model(trainer.engine.module, "out/adapter")                     # LoRA: the adapter folder
    export_model(trainer.engine.module, "out/merged", merge=True, processor=processor)
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from torch import nn

__all__ = ["export_model"]


def _is_hf(model: nn.Module) -> bool:
    return any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__)


def _plain_forward(model: nn.Module) -> nn.Module:
    """A copy without vlmfast's instance-level forward replacements (the chunked loss): what is saved is the model."""
    for module in model.modules():
        if "_vlmfast_lce" in vars(module):
            del module.forward, module._vlmfast_lce  # instance attributes: the class's forward again
    return model


def export_model(model: nn.Module, directory: str | Path, *, merge: bool = False, processor: Any = None) -> Path:
    """Write ``model`` into ``directory`` (see the module doc); returns the folder. The model itself is unchanged
    (a merge runs on a copy)."""
    from vlmfast.common.utils import unwrap_model
    from vlmfast.strategies.lora import is_peft_model, is_quantized

    model = unwrap_model(model)
    if merge and is_peft_model(model) and is_quantized(model):
        raise ValueError("merge=True on a 4-bit base (lora.quantize) would fold the adapters into rounded 4-bit "
                         "weights: export the adapter folder (merge=False) and merge it onto the full-precision base "
                         "(PeftModel.from_pretrained(base, folder).merge_and_unload())")
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if is_peft_model(model):
        if merge:
            merged = _plain_forward(copy.deepcopy(model)).merge_and_unload()
            _save_model(merged, directory)
        else:
            model.save_pretrained(str(directory), safe_serialization=True)
    else:
        _save_model(model, directory)
    if processor is not None:
        processor.save_pretrained(str(directory))
    return directory


def _save_model(model: nn.Module, directory: Path) -> None:
    if _is_hf(model):
        model.save_pretrained(str(directory), safe_serialization=True)
        return
    from safetensors.torch import save_model

    save_model(model, str(directory / "model.safetensors"))
