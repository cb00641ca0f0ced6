"""Bad specs fail validation with a message naming the field, before any work; valid specs round-trip through YAML.

Hypothesis builds specs from the spec's own field types and constraints: random valid ones, valid ones with one
field spoilt, and runnable ones that are trained for a step (where a bad combination must still be named, not
surface as a traceback from inside torch).
"""

from __future__ import annotations

import json
import os
import re
import traceback
import types
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin

import pytest
import torch
import yaml
from hypothesis import HealthCheck, assume, event, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

import vlmfast
from vlmfast import NonFiniteLossError, OptimizedTrainer
from vlmfast.attention.dispatch import AttentionBackendError
from vlmfast.checkpoints.store import CorruptCheckpointError
from vlmfast.data.bad_samples import BadSampleError, TooManyBadSamplesError
from vlmfast.engines.process_group import RankFailureError
from vlmfast.models import ShapesCaptionDataset, TinyVLM, TinyVLMConfig, VLMCollator
from vlmfast.spec import SpecError, TrainSpec, check_environment
from vlmfast.strategies.oom import OutOfMemoryAtMinimumError


def examples(n: int) -> settings:
    """n examples (times VLMFAST_FUZZ_SCALE, for a deeper search than CI's), no deadline, no example database."""
    return settings(
        max_examples=n * int(os.environ.get("VLMFAST_FUZZ_SCALE", "1")),
        deadline=None,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


# ---- strategies from the spec's fields ---------------------------------------------------------------------------
def _section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def leaf_fields(model: type[BaseModel] = TrainSpec, prefix: str = "") -> dict[str, Any]:
    """Dotted path -> pydantic FieldInfo of every non-section field."""
    found = {}
    for name, field in model.model_fields.items():
        if _section(field.annotation):
            found.update(leaf_fields(field.annotation, f"{prefix}{name}."))
        else:
            found[f"{prefix}{name}"] = field
    return found


def sections(model: type[BaseModel] = TrainSpec, prefix: str = "") -> dict[str, type[BaseModel]]:
    """Dotted path ('' for the top level) -> section model."""
    found = {prefix.rstrip("."): model}
    for name, field in model.model_fields.items():
        if _section(field.annotation):
            found.update(sections(field.annotation, f"{prefix}{name}."))
    return found


FIELDS = leaf_fields()
SECTIONS = sections()
SPECIAL = {
    "device": st.sampled_from(["auto", "cpu", "cuda", "cuda:1"]),
    "deepspeed.config": st.none(),
    "save.resume": st.sampled_from(["auto", "never"]),
}  # a config path must exist: not generated


def _bounds(metadata: list) -> tuple[float | None, float | None, bool]:
    low = high = None
    strict = False
    for m in metadata:
        low = getattr(m, "ge", low)
        if getattr(m, "gt", None) is not None:
            low, strict = m.gt, True
        high = getattr(m, "le", high)
    return low, high, strict


def valid_values(annotation: Any, metadata: list) -> st.SearchStrategy:
    """Values pydantic accepts for a field of this type and these constraints."""
    origin, args = get_origin(annotation), get_args(annotation)
    low, high, strict = _bounds(metadata)
    if origin in (Union, types.UnionType):
        return st.one_of([valid_values(a, metadata) for a in args])
    if annotation is type(None):
        return st.none()
    if origin is Literal:
        return st.sampled_from(args)
    if annotation is bool:
        return st.booleans()
    if annotation is int:
        start = int(low or 0) + strict
        return st.integers(start, int(high) if high is not None else start + 40)
    if annotation is float:
        return st.floats(
            low if low is not None else -10.0,
            high if high is not None else 10.0,
            exclude_min=strict,
            allow_nan=False,
            allow_infinity=False,
        )
    if annotation is str:
        return st.sampled_from(["labels", "images", "inductor", "aot_eager"])
    if annotation is Path:
        return st.sampled_from(["ckpt", "runs/a"])
    if origin is tuple:
        return st.tuples(*[valid_values(a, []) for a in args])
    if origin is list:
        min_size = next((m.min_length for m in metadata if hasattr(m, "min_length")), 0)
        return st.lists(valid_values(args[0], []), min_size=min_size, max_size=2)
    if origin is dict:
        return st.just({})
    if _section(annotation):
        return section_values(annotation)
    raise NotImplementedError(f"no strategy for {annotation}")


def section_values(model: type[BaseModel], prefix: str = "") -> st.SearchStrategy:
    optional = {}
    for name, field in model.model_fields.items():
        path = f"{prefix}{name}"
        if _section(field.annotation):
            optional[name] = section_values(field.annotation, f"{path}.")
        else:
            optional[name] = SPECIAL[path] if path in SPECIAL else valid_values(field.annotation, field.metadata)
    return st.fixed_dictionaries({}, optional=optional)


def invalid_values(field: Any) -> st.SearchStrategy:
    """Values no type of the field accepts, or that break its bounds or choices."""
    annotation, metadata = field.annotation, field.metadata
    args = get_args(annotation) or (annotation,)
    takes_dict = any(a is dict or get_origin(a) is dict for a in args)
    options = [st.just([[1, 2]] if takes_dict else {"bad": 1})]
    low, _, strict = _bounds(metadata)
    numeric = [a for a in args if a in (int, float)]
    if low is not None and numeric:
        options.append(st.just(low if strict else low - 1))
    literals = [a for a in args if get_origin(a) is Literal]
    if literals and not any(a in (int, str) for a in args):
        options.append(st.just("no-such-option"))
    return st.one_of(options)


def spoil(data: dict, dotted: str, value: Any) -> dict:
    section = data
    *parents, leaf = dotted.split(".")
    for part in parents:
        section = section.setdefault(part, {})
    section[leaf] = value
    return data


# vlmfast's own exception classes: raised by its checks, with a message written for the user.
VLMFAST_ERRORS = (
    SpecError,
    AttentionBackendError,
    BadSampleError,
    CorruptCheckpointError,
    NonFiniteLossError,
    OutOfMemoryAtMinimumError,
    RankFailureError,
    TooManyBadSamplesError,
)
VLMFAST_DIR = Path(vlmfast.__file__).resolve().parent


def set_fields(data: dict, prefix: str = "") -> set[str]:
    """Dotted paths of the spec fields that `data` sets (its leaves: a section given as a dict is recursed into)."""
    found = set()
    for key, value in data.items():
        path = f"{prefix}{key}"
        if path in SECTIONS and isinstance(value, dict):
            found |= set_fields(value, f"{path}.")
        else:
            found.add(path)
    return found


def _names(path: str, message: str) -> bool:
    return re.search(rf"(?<![\w.]){re.escape(path)}(?!\w)", message) is not None


def names_a_set_field(exc: BaseException, data: dict) -> bool:
    """The error names the full dotted path (optimizer.freeze; not freeze, nor optimizer) of a field set in `data`,
    or of a nested field it lacks (deepspeed.nvme_path, save.dir): a bare top-level name counts only when set.

    A pydantic error carries its location: one in section profile.trace whose message says warmup_steps (or
    trace.warmup_steps) names profile.trace.warmup_steps."""
    fields = set_fields(data)
    nested = {path for path in FIELDS if "." in path}
    if any(_names(path, str(exc)) for path in fields | nested):
        return True
    if not isinstance(exc, ValidationError):
        return False
    for error in exc.errors():
        section = ".".join(map(str, error["loc"]))
        for path in fields:
            if section and path.startswith(section + "."):
                parts, depth = path.split("."), section.count(".") + 1
                if any(_names(".".join(parts[i:]), error["msg"]) for i in range(depth + 1)):
                    return True
    return False


def raised_in_vlmfast(exc: BaseException) -> bool:
    """The innermost frame of the traceback (where the exception was raised) is vlmfast's code."""
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and Path(frames[-1].filename).resolve().is_relative_to(VLMFAST_DIR)


def refused_clearly(exc: BaseException, data: dict) -> bool:
    """Refused by vlmfast or pydantic, not from inside torch: one of their error types, or an error raised in
    vlmfast's code; and the message names the dotted path of a field that this spec sets."""
    ours = isinstance(exc, (ValidationError, *VLMFAST_ERRORS)) or raised_in_vlmfast(exc)
    return ours and names_a_set_field(exc, data)


def describe(exc: BaseException) -> str:
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (raised at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return f"{type(exc).__module__}.{type(exc).__name__}{where}: {exc}"


# ---- properties ----------------------------------------------------------------------------------------------
@examples(60)
@given(data=section_values(TrainSpec))
def test_every_generated_spec_validates_and_round_trips_or_fails_naming_a_field(data, tmp_path_factory):
    try:
        spec = TrainSpec.model_validate(data)
    except ValidationError as exc:  # a cross-field combination the spec refuses: it must say which fields
        event("refused")
        assert refused_clearly(exc, data), describe(exc)
        return
    event("valid")
    path = tmp_path_factory.mktemp("spec") / "run.yaml"
    spec.to_file(path)
    assert TrainSpec.from_file(path) == spec
    assert TrainSpec.model_validate(json.loads(json.dumps(spec.to_dict()))) == spec


@examples(80)
@given(data=st.data())
def test_a_spoilt_field_fails_validation_naming_it_in_code_and_in_a_file(data, tmp_path_factory):
    dotted = data.draw(st.sampled_from(sorted(FIELDS)), label="field")
    value = data.draw(invalid_values(FIELDS[dotted]), label="value")
    spec = spoil({"log": {"progress": "off"}}, dotted, value)
    with pytest.raises(ValidationError) as info:
        TrainSpec.model_validate(spec)
    assert dotted in str(info.value)
    path = tmp_path_factory.mktemp("spec") / "run.yaml"
    path.write_text(yaml.safe_dump(spec))
    with pytest.raises(SpecError) as info:
        TrainSpec.from_file(path)
    assert str(path) in str(info.value) and f"  {dotted}" in str(info.value)


@examples(40)
@given(section=st.sampled_from(sorted(SECTIONS)), key=st.text("abcdefghijklmnopqrstuvwxyz_", min_size=3, max_size=12))
def test_an_unknown_key_anywhere_is_named_with_its_section(section, key):
    assume(key not in SECTIONS[section].model_fields)
    where = f"section '{section}'" if section else "the spec"
    with pytest.raises(ValidationError, match=rf"unknown key '{key}' in {where}"):
        TrainSpec.model_validate(spoil({}, f"{section}.{key}" if section else key, 1))


# ---- runnable specs: a bad combination is named, never a deep traceback ------------------------------------------
SMALL = TinyVLMConfig(vision_dim=16, text_dim=32, vision_heads=2, text_heads=2, vision_layers=1, text_layers=2)
RUNNABLE = st.fixed_dictionaries(
    {
        "max_steps": st.integers(1, 2),
        "batch_size": st.sampled_from([2, 4]),
        "log": st.just({"progress": "off"}),
        "memory": st.just({"leak_check": False, "timeline_plot": False}),
    },
    optional={
        "micro_batch_size": st.sampled_from([None, 1, 2, 3, 4]),
        "precision": st.sampled_from(["fp32", "bf16", "fp16"]),
        "device": st.sampled_from(["auto", "cpu", "cuda"]),
        "grad_clip": st.sampled_from([None, 0.5]),
        "optimizer": st.fixed_dictionaries(
            {},
            optional={
                "name": st.sampled_from(["adamw", "sgd", "adafactor"]),
                "implementation": st.sampled_from(["auto", "fused", "foreach", "for_loop"]),
                "freeze": st.sampled_from([[], ["vision_tower"], ["no_such_module"]]),
                "param_groups": st.sampled_from(
                    [[], [{"modules": ["multi_modal_projector"], "lr": 1e-3}], [{"modules": ["no_such_module"]}]]
                ),
            },
        ),
        "scheduler": st.fixed_dictionaries(
            {}, optional={"name": st.sampled_from(["constant", "linear", "cosine"]), "warmup_steps": st.integers(0, 2)}
        ),
        "loss": st.fixed_dictionaries(
            {},
            optional={
                "weighting": st.sampled_from(["auto", "tokens", "samples"]),
                "label_key": st.sampled_from(["labels", "targets"]),
                "shift_labels": st.sampled_from(["auto", "yes", "no"]),
            },
        ),
        "activation_checkpointing": st.fixed_dictionaries(
            {"enabled": st.booleans()},
            optional={
                "scope": st.sampled_from(["all", "language_model", "vision"]),
                "blocks": st.sampled_from([[], ["no_such_block"]]),
            },
        ),
        "attention": st.fixed_dictionaries(
            {},
            optional={
                "backend": st.sampled_from([None, "auto", "eager", "sdpa", "flash_attn"]),
                "vision_backend": st.sampled_from([None, "eager", "sdpa"]),
            },
        ),
        "oom": st.fixed_dictionaries({"enabled": st.booleans()}, optional={"min_micro_batch_size": st.integers(1, 3)}),
        "packing": st.fixed_dictionaries(
            {"enabled": st.booleans()},
            optional={
                "max_tokens": st.sampled_from([8, 40, 256]),
                "image_layout": st.sampled_from(["per_row", "flat"]),
            },
        ),
        "data": st.fixed_dictionaries(
            {}, optional={"group_by_length": st.sampled_from(["none", "length"]), "drop_last": st.booleans()}
        ),
    },
)


@examples(20)
@given(data=RUNNABLE)
def test_a_runnable_spec_trains_or_fails_naming_a_field_never_deep_inside_the_run(data):
    try:
        spec = TrainSpec.model_validate(data)
        check_environment(spec)
    except (ValidationError, SpecError) as exc:
        event("refused by validation")
        assert refused_clearly(exc, data), describe(exc)
        return
    dataset = ShapesCaptionDataset(num_samples=16, seed=0, max_image_size=32)
    torch.manual_seed(0)
    try:
        trainer = OptimizedTrainer(TinyVLM(SMALL), dataset, spec, collate_fn=VLMCollator(image_size=SMALL.image_size))
        trainer.fit()
    except Exception as exc:  # refused with a message: it must be vlmfast's, naming the spec field
        event(f"refused by the trainer: {type(exc).__name__}")
        assert refused_clearly(exc, data), describe(exc)
        return
    event("trained")


@pytest.mark.parametrize("field", ["backend", "vision_backend"])
def test_flash_attn_on_cpu_is_refused_naming_the_attention_field(field):
    data = {"max_steps": 1, "batch_size": 2, "device": "cpu", "log": {"progress": "off"}}
    data["attention"] = {"backend": "sdpa", field: "flash_attn"}
    dataset = ShapesCaptionDataset(num_samples=4, seed=0, max_image_size=32)
    with pytest.raises(Exception) as info:
        collate = VLMCollator(image_size=SMALL.image_size)
        OptimizedTrainer(TinyVLM(SMALL), dataset, TrainSpec(**data), collate_fn=collate).fit()
    assert refused_clearly(info.value, data), describe(info.value)
    assert f"attention.{field}" in str(info.value)


def test_the_check_refuses_torch_errors_and_bare_section_names():
    """The check itself: torch's own error (it says 'optimizer') and a vlmfast error that names only a section do not
    count as naming a field; a vlmfast error naming a set field's dotted path, or pydantic's located error, do."""
    data = {"optimizer": {"lr": 0.1, "freeze": []}, "batch_size": 4}
    with pytest.raises(ValueError, match="optimizer got an empty parameter list") as info:
        torch.optim.SGD([], lr=0.1)
    assert not refused_clearly(info.value, data)
    assert not refused_clearly(SpecError("the optimizer cannot run"), data)
    assert not refused_clearly(SpecError("lr is too high"), data)  # a tail, not the dotted path
    assert not refused_clearly(SpecError("device 'cuda' is not available"), data)  # a bare name the spec does not set
    assert refused_clearly(SpecError("optimizer.lr is too high"), data)
    assert refused_clearly(SpecError("batch_size 4 is too small"), data)
    assert refused_clearly(SpecError("deepspeed.nvme_path is needed"), data)  # a nested field to add
    with pytest.raises(ValidationError) as info:
        TrainSpec(optimizer={"lr": -1.0})
    assert refused_clearly(info.value, {"optimizer": {"lr": -1.0}})


# ---- examples (moved from tests/test_spec.py) ---------------------------------------------------------------
def test_misspelt_top_level_key_suggests_the_closest():
    expected = r"unknown key 'micro_batchsize' in the spec; did you mean 'micro_batch_size'"
    with pytest.raises(ValidationError, match=expected):
        TrainSpec(micro_batchsize=4)


def test_misspelt_nested_key_names_the_section_and_suggests():
    expected = r"unknown key 'warmup' in section 'scheduler'; did you mean 'warmup_steps'"
    with pytest.raises(ValidationError, match=expected):
        TrainSpec(scheduler={"warmup": 10})


def test_misspelt_key_in_a_file_names_the_file(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("batch_size: 8\noptimizer:\n  learning_rate: 0.1\n")
    with pytest.raises(SpecError) as info:
        TrainSpec.from_file(path)
    assert str(path) in str(info.value)
    assert "optimizer: unknown key 'learning_rate'" in str(info.value)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"batch_size": 4, "micro_batch_size": 8}, "micro_batch_size .* larger than batch_size"),
        ({"precision": "fp16", "device": "cpu"}, "fp16' needs a CUDA device.*bf16"),
        ({"save": {"every_steps": 5}}, "save.dir"),
        ({"precision": "fp8"}, "precision"),
        ({"device": "gpu"}, "device 'gpu' is not a device name: use auto, cpu, cuda"),
        (
            {"batch_size": 4, "micro_batch_size": 2, "packing": {"enabled": True, "image_layout": "flat"}},
            "packing.image_layout 'flat' .* cannot be split into micro-batches",
        ),
    ],
)
def test_cross_field_mistakes_fail_with_what_to_change(fields, message):
    with pytest.raises(ValidationError, match=message):
        TrainSpec(**fields)


def test_fp16_on_a_machine_without_cuda_fails_before_any_work():
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SpecError, match="fp16' needs a CUDA device"):
        check_environment(TrainSpec(precision="fp16"))


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_round_trip_through_files(tmp_path, suffix):
    spec = TrainSpec(
        batch_size=16,
        micro_batch_size=4,
        precision="bf16",
        optimizer={"lr": 3e-4, "freeze": ["a"]},
        save={"dir": str(tmp_path / "ck"), "every_steps": 5},
    )
    path = tmp_path / f"run{suffix}"
    spec.to_file(path)
    assert TrainSpec.from_file(path) == spec


def test_unsupported_or_missing_file_is_named(tmp_path):
    with pytest.raises(SpecError, match="not found"):
        TrainSpec.from_file(tmp_path / "nope.yaml")
    bad = tmp_path / "run.toml"
    bad.write_text("x = 1")
    with pytest.raises(SpecError, match=r"unsupported spec format '\.toml'"):
        TrainSpec.from_file(bad)
    broken = tmp_path / "broken.yaml"
    broken.write_text("batch_size: [8\n")
    with pytest.raises(SpecError, match=r"broken.yaml: cannot parse"):
        TrainSpec.from_file(broken)
