"""Spec files that would silently mean something else are refused, naming the file, the field (or key and line).

- A key repeated in one YAML mapping or JSON object: PyYAML and json keep the last one silently.
- Strict numbers: no boolean for a number (`batch_size: true`, `grad_clip: yes`), no fraction for a whole number,
  nothing non-finite (`lr: 1e400` is infinity) or beyond 64 bits, seed within numpy's range.
- Non-UTF-8 bytes, YAML syntax, a folder instead of a file: the file is named.
"""

from __future__ import annotations

import math
import re

import pytest
from pydantic import BaseModel, ValidationError

from vlmfast.common.sections import _number_kinds
from vlmfast.spec import SpecError, TrainSpec


def _load(tmp_path, text: str | bytes, name: str = "run.yaml") -> TrainSpec:
    path = tmp_path / name
    path.write_bytes(text if isinstance(text, bytes) else text.encode())
    return TrainSpec.from_file(path)


@pytest.mark.parametrize(("text", "key", "lines"), [
    ("optimizer:\n  lr: 0.1\nbatch_size: 8\noptimizer:\n  name: sgd\n", "optimizer", (1, 4)),
    ("optimizer:\n  lr: 0.1\n  name: sgd\n  lr: 0.2\n", "lr", (2, 4)),
    ("save:\n  dir: a\nlog:\n  dir: b\n  every_steps: 2\n  dir: c\n", "dir", (4, 6)),
], ids=["section", "field", "nested"])
def test_duplicate_yaml_keys_are_refused_naming_the_key_and_lines(tmp_path, text, key, lines):
    with pytest.raises(SpecError, match=rf"run.yaml: key '{key}' appears twice in one mapping \(lines {lines[0]} and "
                       rf"{lines[1]}\).*merge them"):
        _load(tmp_path, text)


def test_duplicate_json_keys_are_refused_and_yaml_merge_keys_still_work(tmp_path):
    with pytest.raises(SpecError, match=r"run.json: key 'lr' appears twice in one object"):
        _load(tmp_path, '{"optimizer": {"lr": 0.1, "lr": 0.2}}', "run.json")
    text = "optimizer: &opt\n  lr: 0.1\n  name: sgd\nscheduler:\n  name: cosine\n"
    assert _load(tmp_path, text).optimizer.lr == 0.1
    merged = ("optimizer:\n  <<: &base {lr: 0.1, weight_decay: 0.01}\n  lr: 0.2\n")  # an override, not a duplicate
    spec = _load(tmp_path, merged)
    assert (spec.optimizer.lr, spec.optimizer.weight_decay) == (0.2, 0.01)


NUMBERS = [
    ("batch_size: true\n", "batch_size", "expected a number, got the boolean true"),
    ("grad_clip: yes\n", "grad_clip", "expected a number, got the boolean true"),
    ("data:\n  num_workers: on\n", "data.num_workers", "expected a number, got the boolean true"),
    ("deepspeed:\n  zero_stage: false\n", "deepspeed.zero_stage", "expected a number, got the boolean false"),
    ("optimizer:\n  betas: [0.9, true]\n", "optimizer.betas", "expected a number, got the boolean true"),
    ("batch_size: 8.0\n", "batch_size", "expected a whole number, got 8.0"),
    ("max_steps: 2.5\n", "max_steps", "expected a whole number, got 2.5"),
    ("max_steps: 1e5\n", "max_steps", "expected a whole number, got the text '1e5' .*write 100000"),
    ("optimizer:\n  lr: 1e400\n", "optimizer.lr", "must be a finite number, got inf"),
    ("optimizer:\n  lr: .nan\n", "optimizer.lr", "must be a finite number, got nan"),
    ("grad_clip: .inf\n", "grad_clip", "must be a finite number, got inf"),
    ("seed: 100000000000000000000\n", "seed", "Input should be less than or equal to 4294967295"),
    ("seed: -1\n", "seed", "Input should be greater than or equal to 0"),
    ("max_steps: 100000000000000000000\n", "max_steps", "100000000000000000000 is out of range: at most 2\\*\\*63"),
    ("ddp:\n  timeout_minutes: 1e300\n", "ddp.timeout_minutes", "Input should be less than or equal to 1000000"),
]


@pytest.mark.parametrize(("text", "field", "message"), NUMBERS,
                         ids=[f"{i}-{field}" for i, (_, field, _) in enumerate(NUMBERS)])
def test_wrong_numbers_are_refused_naming_the_field_and_the_file(tmp_path, text, field, message):
    with pytest.raises(SpecError, match=rf"(?s)run.yaml: invalid spec\n  {field}: {message}"):
        _load(tmp_path, text)


def _number_fields(model: type[BaseModel] = TrainSpec, prefix: str = "") -> dict[str, set[str]]:
    found: dict[str, set[str]] = {}
    for name, field in model.model_fields.items():
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            found.update(_number_fields(field.annotation, f"{prefix}{name}."))
        elif (kinds := _number_kinds(field.annotation)) & {"int", "float"} and "bool" not in kinds:
            found[f"{prefix}{name}"] = kinds
    return found


def _nested(dotted: str, value) -> dict:
    *parents, leaf = dotted.split(".")
    data = {leaf: value}
    for part in reversed(parents):
        data = {part: data}
    return data


@pytest.mark.parametrize("dotted", sorted(_number_fields()))
def test_every_number_field_refuses_booleans_and_non_finite_values(dotted):
    kinds = _number_fields()[dotted]
    with pytest.raises(ValidationError, match=rf"(?s){dotted.split('.')[-1]}.*expected a number, got the boolean"):
        TrainSpec(**_nested(dotted, True))
    if "float" in kinds:
        for bad in (math.inf, -math.inf, math.nan):
            with pytest.raises(ValidationError, match=rf"{dotted.split('.')[-1]}\n  Value error, must be a finite"):
                TrainSpec(**_nested(dotted, bad))


def test_load_errors_name_the_file(tmp_path):
    with pytest.raises(SpecError, match=r"run.yaml: not UTF-8 text \(byte 0xe9 at offset 19\)"):
        _load(tmp_path, b"batch_size: 8\n# caf\xe9\n")
    with pytest.raises(SpecError, match=r"(?s)run.yaml: cannot parse: .*line 2"):
        _load(tmp_path, "batch_size: 8\n  - oops: [\n")
    with pytest.raises(SpecError, match=r"run.json: cannot parse"):
        _load(tmp_path, '{"batch_size": 8,', "run.json")
    (tmp_path / "folder.yaml").mkdir()
    with pytest.raises(SpecError, match=r"folder.yaml: not a file"):
        TrainSpec.from_file(tmp_path / "folder.yaml")
    with pytest.raises(SpecError, match=r"run.yaml: cannot parse: .*python/object"):
        _load(tmp_path, "batch_size: !!python/object/apply:os.system ['true']\n")
    with pytest.raises(SpecError, match=r"run.yaml: the spec must be a mapping"):
        _load(tmp_path, "- 1\n- 2\n")


@pytest.mark.parametrize(("text", "key"), [
    ("optimizer: {lr: 0.1, lr: 0.0001}\n", "lr"),
    ("save: {keep_last: 2, keep_last: 5}\n", "keep_last"),
    ("{max_steps: 3, max_steps: 4}\n", "max_steps"),
], ids=["optimizer", "save", "top level"])
def test_a_key_repeated_on_one_line_is_refused(tmp_path, text, key):
    with pytest.raises(SpecError, match=rf"run.yaml: key '{key}' appears twice in one mapping \(line 1\)"):
        _load(tmp_path, text)


@pytest.mark.parametrize("name", ["run.yaml", "run.json"])
def test_nesting_deeper_than_python_can_read_is_one_error_line_naming_the_file(tmp_path, capsys, name):
    from vlmfast.cli.main import main

    path = tmp_path / name
    path.write_text('{"seed": ' + "[" * 50_000 + "]" * 50_000 + "}")
    assert main(["spec", "--check", str(path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"vlmfast: error: {path}: nested too deeply to read") and "Traceback" not in err


@pytest.mark.parametrize(("item", "message"), [
    ("seed=!!python/object/apply:os.system ['touch pwned']", r"cannot parse: .*python/object"),
    ("optimizer={lr: 0.1, lr: 0.2}", r"key 'lr' appears twice in one mapping \(line 1\)"),
    ("seed=" + "[" * 50_000, "nested too deeply"),
], ids=["tag", "repeated key", "deep"])
def test_a_bad_set_value_is_one_error_line_naming_the_set(tmp_path, capsys, monkeypatch, item, message):
    from vlmfast.cli.main import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", "--set", item]) == 2
    err = capsys.readouterr().err
    assert re.match(rf"(?s)vlmfast: error: --set .{re.escape(item[:20])}.*: {message}", err) and "Traceback" not in err
    assert not (tmp_path / "pwned").exists()
