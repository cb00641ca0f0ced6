"""The base of every spec section, shared by spec.py and the strategy files that hold their own sections.

Usage (a strategy's own section, composed into TrainSpec by vlmfast.spec)::

    class EMASpec(Section):
        enabled: bool = Field(False, description="keep an exponential moving average of the weights")
"""

from __future__ import annotations

import difflib
import functools
from typing import Any, get_args

from pydantic import BaseModel, ConfigDict, Field, model_validator

__all__ = ["Field", "Section", "SpecError", "set_root"]

_ROOT: list[type[BaseModel]] = []  # the top-level spec class (set by vlmfast.spec), for dotted section labels


def set_root(root: type[BaseModel]) -> None:
    """Name the top-level spec class, so errors can say where a section sits (e.g. 'ddp.powersgd')."""
    _ROOT[:] = [root]
    _section_paths.cache_clear()


class SpecError(ValueError):
    """A spec that cannot run; the message names the field and what to change."""


# Names users bring from other trainers (HF TrainingArguments, Accelerate, Lightning), mapped to ours.
KEY_ALIASES: dict[str, str] = {
    "learning_rate": "lr", "max_grad_norm": "grad_clip", "gradient_clip_val": "grad_clip", "clip_grad": "grad_clip",
    "max_iters": "max_steps", "num_steps": "max_steps", "train_steps": "max_steps", "mixed_precision": "precision",
    "fp16": "precision", "bf16": "precision", "gradient_checkpointing": "activation_checkpointing",
    "per_device_train_batch_size": "micro_batch_size", "train_micro_batch_size_per_gpu": "micro_batch_size",
    "lr_scheduler_type": "name", "warmup_ratio": "warmup_steps", "dataloader_num_workers": "num_workers",
    "output_dir": "dir", "save_steps": "every_steps", "save_total_limit": "keep_last", "attn_implementation": "backend",
}


# Fields that moved: the old key is refused with the new one named (docs/migration.md).
RENAMED_KEYS: dict[str, dict[str, str]] = {
    "DeepSpeedSpec": {"enabled": "the top-level field `engine: deepspeed` (deepspeed.enabled was replaced in 0.2)"},
    "FSDPSpec": {"enabled": "the top-level field `engine: fsdp` (fsdp.enabled was replaced in 0.2)"},
}


class Section(BaseModel):
    """Base of every spec section: unknown keys fail with a suggestion of the closest valid key."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        valid = set(cls.model_fields)
        for key in data:
            if (moved := RENAMED_KEYS.get(cls.__name__, {}).get(key)) is not None:
                raise ValueError(f"'{key}' in {_section_label(cls)} was renamed: use {moved}")
            if key not in valid:
                raise ValueError(f"unknown key '{key}' in {_section_label(cls)}{_suggestion(str(key), valid)}")
        return data


def _suggestion(key: str, valid: set[str]) -> str:
    alias = KEY_ALIASES.get(key)
    close = [alias] if alias in valid else difflib.get_close_matches(key, sorted(valid), n=1, cutoff=0.5)
    return f"; did you mean '{close[0]}'?" if close else f"; valid keys: {', '.join(sorted(valid))}"


def _section_label(cls: type[BaseModel]) -> str:
    if _ROOT and cls is _ROOT[0]:
        return "the spec"
    return f"section '{_section_paths().get(cls, cls.__name__.removesuffix('Spec').lower())}'"


@functools.cache
def _section_paths() -> dict[type[BaseModel], str]:
    """Each section class -> its dotted place in the spec, e.g. PowerSGDSpec -> ddp.powersgd."""
    paths: dict[type[BaseModel], str] = {}

    def walk(model: type[BaseModel], prefix: str) -> None:
        for name, field in model.model_fields.items():
            inner = get_args(field.annotation) or (field.annotation,)  # list[ParamGroupSpec] too
            for cls in inner:
                if isinstance(cls, type) and issubclass(cls, Section) and cls not in paths:
                    paths[cls] = f"{prefix}{name}"
                    walk(cls, f"{prefix}{name}.")

    if _ROOT:
        walk(_ROOT[0], "")
    return paths


