"""The `vlmfast` command: spec printing/checking, overrides, and clear one-line errors."""

from __future__ import annotations

import json

import yaml

from vlmfast.cli import build_spec, main
from vlmfast.spec import TrainSpec


def test_spec_schema_and_defaults(capsys):
    assert main(["spec", "--schema"]) == 0
    assert "micro_batch_size" in json.loads(capsys.readouterr().out)["properties"]
    assert main(["spec", "--defaults"]) == 0
    assert TrainSpec.model_validate(yaml.safe_load(capsys.readouterr().out)) == TrainSpec()


def test_spec_check_reports_a_misspelt_key_in_one_line(tmp_path, capsys):
    path = tmp_path / "run.yaml"
    path.write_text("max_step: 10\n")
    assert main(["spec", "--check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "unknown key 'max_step' in the spec; did you mean 'max_steps'?" in err
    assert "Traceback" not in err


def test_set_overrides_are_validated_before_any_work(capsys):
    spec = build_spec(None, ["precision=bf16", "optimizer.lr=3e-4", "micro_batch_size=4"])
    assert (spec.precision, spec.optimizer.lr, spec.micro_batch_size) == ("bf16", 3e-4, 4)
    assert main(["train", "--set", "micro_batch_size=17"]) == 2  # above batch_size 16
    assert "micro_batch_size (17) is larger than batch_size (16)" in capsys.readouterr().err


def test_find_batch_size_command_prints_a_valid_recommendation(capsys):
    assert main(["find-batch-size", "--set", "batch_size=8", "--samples", "64"]) == 0
    out = capsys.readouterr().out
    assert "largest micro-batch that fits: 8" in out
    recommended = int(out.split("micro_batch_size: ")[1].split()[0])
    assert TrainSpec(batch_size=8, micro_batch_size=recommended)  # the spec accepts it


def test_bad_overrides_and_tasks_fail_in_one_line(capsys):
    assert main(["train", "--set", "max_steps.x=1"]) == 2  # max_steps holds a value in the demo spec
    assert "'max_steps' is a value, not a section" in capsys.readouterr().err
    assert main(["train", "--task", "no_such_module:build"]) == 2
    assert "--task 'no_such_module:build': cannot load it" in capsys.readouterr().err


def test_every_contract_section_is_in_the_spec():
    # DESIGN.md's top-level names: all of them are real sections.
    contract = {"seed", "max_steps", "batch_size", "micro_batch_size", "precision", "optimizer", "scheduler",
                "grad_clip", "activation_checkpointing", "attention", "oom", "ddp", "deepspeed", "compile", "data",
                "packing", "profile", "save", "log"}
    assert contract <= set(TrainSpec.model_fields)
