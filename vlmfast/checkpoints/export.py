"""Export a trained model in the formats the Hugging Face ecosystem loads.

- a LoRA run (a PEFT model): PEFT's adapter folder (``adapter_config.json``, ``adapter_model.safetensors``), which
  ``PeftModel.from_pretrained(base, folder)`` loads; with ``merge=True`` the merged model instead, a plain
  ``save_pretrained`` folder (the adapters folded into the base weights: no PEFT needed to load it);
- a Hugging Face model: ``save_pretrained`` in safetensors (config, generation config), which ``from_pretrained``
  loads and vLLM serves;
- any other ``nn.Module``: ``model.safetensors`` of its state dict (shared tensors saved once), and in
  ``vlmfast_export.json`` what rebuilds it: its class (``module:Class``) and, where vlmfast knows it (a dataclass
  ``model.config`` its constructor takes, as the built-in ``TinyVLM``'s ``TinyVLMConfig``), its constructor config;
  else the ``--task`` that built it. docs/checkpoints.md#exported-models shows the lines that load it back.

``processor`` (a processor or tokenizer) is saved into the same folder. Every export also holds
``vlmfast_export.json`` (its kind, the vlmfast version).

The folder is written as a checkpoint is: into a fresh private folder next to it, which then takes its place
(``common.safe_files.library_folder_output``): a link planted in the folder is never written through, a failed export
(a full disk) leaves the folder as it was and names it, and a new export never mixes with the files of an old one. A
folder that holds anything but a previous export of the same kind is refused naming it (:func:`check_export_target`,
run when the trainer is built), unless ``overwrite`` (``save.export.overwrite``, ``vlmfast export --overwrite``).

Usage::

    export_model(trainer.engine.module, "out/adapter")                     # LoRA: the adapter folder
    export_model(trainer.engine.module, "out/merged", merge=True, processor=processor)
"""

from __future__ import annotations

import copy
import dataclasses
import inspect
import json
import os
from pathlib import Path
from typing import Any

from torch import nn

from vlmfast.checkpoints.save_dir import OutputDirError
from vlmfast.checkpoints.store import CheckpointError
from vlmfast.common.safe_files import library_folder_output, write_atomic
from vlmfast.common.sections import SpecError

__all__ = ["EXPORT_FILE", "ExportWriteError", "check_export_target", "export_kind", "export_model"]

EXPORT_FILE = "vlmfast_export.json"  # in every export: its kind; a plain module's class and config
EXPORT_FORMAT = 1


class ExportWriteError(CheckpointError):
    """An export that could not be written (a full disk, an I/O error): the folder is left as it was; names it."""


def export_kind(model: nn.Module, merge: bool = False, lora: bool | None = None) -> str:
    """What an export of `model` writes: 'lora adapters', 'lora merged', 'save_pretrained' or 'safetensors'.
    `lora`: whether LoRA wraps the model (default: probed on `model`; the trainer's check passes the spec's, before
    the adapters are added)."""
    from vlmfast.strategies.lora import is_peft_model

    if is_peft_model(model) if lora is None else lora:
        return "lora merged" if merge else "lora adapters"
    return "save_pretrained" if _is_hf(_plain_module(model)) else "safetensors"


def check_export_target(directory: str | Path, kind: str, overwrite: bool = False,
                        what: str = "export folder") -> None:
    """Refuse `directory` when it holds anything but a previous vlmfast export of `kind` (an empty or missing folder
    passes; `overwrite` passes anything), naming it and what it holds; a file there is refused too."""
    directory = Path(directory)
    if overwrite or not directory.is_dir():
        return
    names = sorted(os.listdir(directory))
    if not names:
        return
    previous = _read_export_file(directory / EXPORT_FILE)
    if previous is not None and previous.get("kind") == kind:
        return
    held = ", ".join(names[:4]) + (f" and {len(names) - 4} more" if len(names) > 4 else "")
    found = (f"a vlmfast export of another kind ({previous.get('kind')}; this one writes {kind})" if previous
             else f"files that are not a vlmfast export ({held})")
    raise OutputDirError(
        f"{what} {directory} holds {found}: an export there would replace them, or a loader could read the old model. "
        f"Choose a new or empty folder, or replace the folder on purpose with save.export.overwrite: true "
        f"(vlmfast export --overwrite)")


def _read_export_file(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text()) if not path.is_symlink() else None
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_hf(model: nn.Module) -> bool:
    return any(cls.__name__ == "PreTrainedModel" for cls in type(model).__mro__)


def _plain_forward(model: nn.Module) -> nn.Module:
    """A copy without vlmfast's instance-level forward replacements (the chunked loss): what is saved is the model."""
    for module in model.modules():
        if "_vlmfast_lce" in vars(module):
            del module.forward, module._vlmfast_lce  # instance attributes: the class's forward again
    return model


def export_model(model: nn.Module, directory: str | Path, *, merge: bool = False, processor: Any = None,
                 overwrite: bool = False, task: str | None = None, what: str = "export folder") -> Path:
    """Write ``model`` into ``directory`` (see the module doc); returns the folder. The model itself is unchanged
    (a merge runs on a copy). `task`: the ``--task`` that built the model, recorded for a plain module whose config
    vlmfast does not know; `what`: how errors name the folder (``save.export.dir``)."""
    from vlmfast.common.utils import unwrap_model
    from vlmfast.strategies.lora import is_peft_model, is_quantized

    model = unwrap_model(model)
    if merge and is_peft_model(model) and is_quantized(model):
        raise ValueError("merge=True on a 4-bit base (lora.quantize) would fold the adapters into rounded 4-bit "
                         "weights: export the adapter folder (merge=False) and merge it onto the full-precision base "
                         "(PeftModel.from_pretrained(base, folder).merge_and_unload())")
    directory, kind = Path(directory), export_kind(model, merge)
    check_export_target(directory, kind, overwrite, what)
    try:
        with library_folder_output(directory, what) as tmp:
            saved = _write_export(model, tmp, merge)
            if processor is not None:
                processor.save_pretrained(str(tmp))
            write_atomic(tmp / EXPORT_FILE, json.dumps(_export_record(saved, kind, task), indent=2) + "\n")
    except (ValueError, CheckpointError, SpecError):
        raise
    except Exception as exc:  # safetensors reports a full disk as its own SafetensorError, not an OSError
        raise ExportWriteError(
            f"{what} {directory}: cannot write the export ({type(exc).__name__}: {exc}). Nothing was changed in "
            f"{directory}. Free space or check the disk, or set {what} to another folder") from exc
    return directory


def _write_export(model: nn.Module, directory: Path, merge: bool) -> nn.Module:
    """Write the model's files; returns the module saved (the merged copy of a LoRA model)."""
    from vlmfast.strategies.lora import is_peft_model

    if not is_peft_model(model):
        _save_model(_plain_module(model), directory)
        return model
    if merge:
        merged = _plain_forward(copy.deepcopy(model)).merge_and_unload()
        _save_model(merged, directory)
        return merged
    model.save_pretrained(str(directory), safe_serialization=True)
    return model


def _export_record(model: nn.Module, kind: str, task: str | None) -> dict[str, Any]:
    """vlmfast_export.json: the kind; for a plain module (safetensors) its class, and its constructor config where
    the constructor takes a dataclass ``config`` the model holds, else the task that built it."""
    from vlmfast.version import __version__

    record: dict[str, Any] = {"format": EXPORT_FORMAT, "kind": kind, "vlmfast_version": __version__}
    module = _plain_module(model)
    if _is_hf(module) or kind == "lora adapters":
        return record  # from_pretrained reads config.json / adapter_config.json
    record.update(model_class=_class_path(type(module)), weights="model.safetensors")
    config = getattr(module, "config", None)
    if dataclasses.is_dataclass(config) and not isinstance(config, type) and _takes_config(type(module)):
        record.update(config_class=_class_path(type(config)), config=json.loads(json.dumps(
            dataclasses.asdict(config), default=str)))
    else:
        record.update(task=task, note="vlmfast does not know this model's constructor config: build the model as "
                      "the task above (or your code) did, then load_model(model, 'model.safetensors')")
    return record


def _takes_config(cls: type) -> bool:
    """Whether the constructor has a ``config`` parameter (read off its signature, never assumed)."""
    try:
        return "config" in inspect.signature(cls).parameters
    except (TypeError, ValueError):  # a constructor Python cannot describe
        return False


def _class_path(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def _plain_module(model: nn.Module) -> nn.Module:
    return getattr(model, "_orig_mod", model)  # torch.compile's wrapper: the module it compiled


def _save_model(model: nn.Module, directory: Path) -> None:
    if _is_hf(model):
        model.save_pretrained(str(directory), safe_serialization=True)
        return
    from safetensors.torch import save_model

    save_model(model, str(directory / "model.safetensors"))
