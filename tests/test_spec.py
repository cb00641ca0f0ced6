"""The spec: misspelt keys suggest the right one, cross-field mistakes fail before any work, files round-trip."""

import json

import pytest
import yaml
from pydantic import ValidationError

from vlmfast.spec import SpecError, TrainSpec, check_environment, defaults_yaml


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
        ({"batch_size": 10, "micro_batch_size": 4}, r"divisible by micro_batch_size \(4\).*\[1, 2, 5, 10\]"),
        ({"batch_size": 4, "micro_batch_size": 8}, "micro_batch_size .* larger than batch_size"),
        ({"precision": "fp16", "device": "cpu"}, "fp16' needs a CUDA device.*bf16"),
        ({"max_steps": 10, "scheduler": {"warmup_steps": 10}}, "warmup_steps .* below max_steps"),
        ({"save": {"every_steps": 5}}, "save.dir"),
        ({"precision": "fp8"}, "precision"),
    ],
)
def test_cross_field_mistakes_fail_with_what_to_change(fields, message):
    with pytest.raises(ValidationError, match=message):
        TrainSpec(**fields)


def test_fp16_on_a_machine_without_cuda_fails_before_any_work():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SpecError, match="fp16' needs a CUDA device"):
        check_environment(TrainSpec(precision="fp16"))


@pytest.mark.parametrize("suffix", [".yaml", ".yml", ".json"])
def test_round_trip_through_files(tmp_path, suffix):
    spec = TrainSpec(batch_size=16, micro_batch_size=4, precision="bf16", optimizer={"lr": 3e-4, "freeze": ["a"]},
                     save={"dir": str(tmp_path / "ck"), "every_steps": 5})
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


def test_defaults_template_is_commented_and_loads_back_to_the_defaults():
    text = defaults_yaml()
    assert "# samples per optimizer step per rank" in text
    assert TrainSpec.model_validate(yaml.safe_load(text)) == TrainSpec()


def test_schema_is_json_serialisable():
    schema = TrainSpec.model_json_schema()
    assert {"batch_size", "micro_batch_size", "precision", "optimizer", "save"} <= set(schema["properties"])
    json.dumps(schema)


def test_yaml_on_off_reads_as_words(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("log:\n  progress: off\n")  # YAML 1.1 makes this False
    assert TrainSpec.from_file(path).log.progress == "off"
