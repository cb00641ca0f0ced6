"""The spec: defaults template, schema, YAML quirks (bad specs and round trips: tests/faults/test_bad_specs.py)."""

import json

import pytest
import yaml

from vlmfast.spec import TrainSpec, defaults_yaml


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


@pytest.mark.parametrize(("data", "suggested"), [
    ({"optimizer": {"learning_rate": 1e-3}}, "lr"),  # a name from another trainer
    ({"max_grad_norm": 1.0}, "grad_clip"),
    ({"save": {"output_dir": "runs"}}, "dir"),
    ({"optimzer": {}}, "optimizer"),  # a typo
])
def test_unknown_keys_suggest_the_field_meant(data, suggested):
    with pytest.raises(ValueError, match=f"did you mean '{suggested}'"):
        TrainSpec(**data)


def test_any_micro_batch_size_up_to_the_batch_is_valid():
    """8 at 3 is 3 + 3 + 2: micro-batches are weighted by their loss items, so no divisor rule."""
    assert TrainSpec(batch_size=8, micro_batch_size=3).resolved_micro_batch_size == 3
