"""The base of every spec section, shared by spec.py and the strategy files that hold their own sections.

Usage (a strategy's own section, composed into TrainSpec by vlmfast.spec)::

    class EMASpec(Section):
        enabled: bool = Field(False, description="keep an exponential moving average of the weights")
"""

from __future__ import annotations

import difflib
import functools
import math
import re
import types
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

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
    """Base of every spec section: unknown keys fail with a suggestion of the closest valid key; numbers are strict
    (no boolean for a number, no fraction for a whole number, finite, within 64 bits)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _strict_numbers(cls, value: Any, info: ValidationInfo) -> Any:
        # pydantic's lax mode reads `batch_size: true` as 1 and `grad_clip: yes` (YAML 1.1: true) as 1.0
        kinds = _number_kinds(cls.model_fields[info.field_name].annotation)
        if kinds:
            items = value if isinstance(value, (list, tuple)) and kinds & {"seq_int", "seq_float"} else [value]
            for item in items:
                _check_number_type(item, kinds)
        return value

    @field_validator("*", mode="before")
    @classmethod
    def _yaml_booleans_as_words(cls, value: Any, info: ValidationInfo) -> Any:
        # YAML 1.1 reads `shift_labels: yes` as True and `progress: off` as False: a field whose choices are words
        # ("yes"/"no", "on"/"off") takes the word back; a field that takes a boolean as such keeps it
        if not isinstance(value, bool):
            return value
        words, takes_bool = _word_choices(cls.model_fields[info.field_name].annotation)
        if takes_bool or not words & {"yes", "no", "on", "off"}:  # not a yes/no or on/off choice: other checks say
            return value
        word = next((w for w in (("yes", "on") if value else ("no", "off")) if w in words), None)
        if word is None:
            raise ValueError(f"expected one of {', '.join(repr(w) for w in sorted(words))}, got the boolean "
                             f"{str(value).lower()} (YAML reads true/false, yes/no and on/off as booleans)")
        return word

    @field_validator("*", mode="after")
    @classmethod
    def _finite_numbers(cls, value: Any) -> Any:
        for item in value if isinstance(value, (list, tuple)) else (value,):
            if isinstance(item, float) and not math.isfinite(item):
                raise ValueError(f"must be a finite number, got {item} (a YAML number beyond 1.8e308 reads as "
                                 "infinity)")
            if isinstance(item, int) and not isinstance(item, bool) and abs(item) >= 2**63:
                raise ValueError(f"{item} is out of range: at most 2**63 - 1 (a 64-bit integer)")
        return value

    @model_validator(mode="before")
    @classmethod
    def _reject_unknown_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        valid = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        for key in data:
            if (moved := RENAMED_KEYS.get(cls.__name__, {}).get(key)) is not None:
                raise ValueError(f"'{key}' in {_section_label(cls)} was renamed: use {moved}")
            if key not in valid:
                raise ValueError(f"unknown key '{key}' in {_section_label(cls)}{_suggestion(str(key), valid)}")
        return data


def _number_kinds(annotation: Any) -> set[str]:
    """What numbers a field takes: int / float / bool, and seq_int / seq_float for tuples and lists of them."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _number_kinds(args[0])
    if origin in (Union, types.UnionType):
        return set().union(*(_number_kinds(a) for a in args))
    if origin is Literal:
        return {"bool" if isinstance(a, bool) else "int" for a in args if isinstance(a, int)}
    if origin in (tuple, list):
        inner = set().union(*(_number_kinds(a) for a in args if a is not Ellipsis))
        return {f"seq_{k}" for k in inner & {"int", "float"}} | ({"seq_bool"} if "bool" in inner else set())
    return {"bool"} if annotation is bool else {"int"} if annotation is int else {"float"} if annotation is float \
        else set()


def _word_choices(annotation: Any) -> tuple[set[str], bool]:
    """The text choices of a Literal field (through Annotated, Optional and unions), and whether it takes a bool."""
    origin, args = get_origin(annotation), get_args(annotation)
    if origin is Annotated:
        return _word_choices(args[0])
    if origin in (Union, types.UnionType):
        parts = [_word_choices(a) for a in args]
        return set().union(*(w for w, _ in parts)), any(b for _, b in parts)
    if origin is Literal:
        return {a for a in args if isinstance(a, str)}, any(isinstance(a, bool) for a in args)
    return set(), annotation is bool


def _check_number_type(value: Any, kinds: set[str]) -> None:
    ints, floats = kinds & {"int", "seq_int"}, kinds & {"float", "seq_float"}
    if isinstance(value, float) and not math.isfinite(value):  # before range checks: they would say "greater than"
        raise ValueError(f"must be a finite number, got {value}")
    if isinstance(value, bool) and (ints or floats) and not kinds & {"bool", "seq_bool"}:
        raise ValueError(f"expected a number, got the boolean {str(value).lower()} (YAML reads true/false, yes/no and "
                         "on/off as booleans): write the number")
    if isinstance(value, float) and ints and not floats:
        raise ValueError(f"expected a whole number, got {value!r}: write it without a fraction or exponent")
    if isinstance(value, str) and ints and not floats and not re.fullmatch(r"\s*[-+]?\d+\s*", value):
        try:
            number = float(value)
        except ValueError:
            return  # not a number at all: pydantic's own message says so
        hint = f": write {int(number)}" if math.isfinite(number) and number == int(number) else ""
        raise ValueError(f"expected a whole number, got the text {value!r} (YAML reads 1e5 without a dot as "
                         f"text){hint}")


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


