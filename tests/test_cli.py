"""The `vlmfast` command: spec printing/checking, overrides, and clear one-line errors."""

from __future__ import annotations

import json

import pytest
import yaml

from vlmfast.cli.jobs import build_spec, fields_changed_from_demo
from vlmfast.cli.main import main
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
    assert main(["train", "--set", "micro_batch_size=17"]) == 2  # above batch_size 16: refused before any work
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


HEAVY_MODULES = ("torch", "transformers", "numpy", "vlmfast.train", "vlmfast.spec", "vlmfast.data", "vlmfast.models")


def _modules_loaded_after(code: str) -> list[str]:
    """Run `code` in a fresh interpreter and return which of HEAVY_MODULES it imported."""
    import subprocess
    import sys

    probe = f"import sys\n{code}\nprint(sorted(m for m in {HEAVY_MODULES!r} if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1].replace("'", '"'))


def test_help_imports_neither_torch_nor_the_trainer():
    """`vlmfast --help` and `vlmfast train --help` answer at once: parsing imports no torch (issue 29)."""
    code = ("import contextlib, io\nimport vlmfast.cli.main\n"
            "for argv in (['--help'], ['train', '--help'], ['find-batch-size', '--help'], ['spec', '--help']):\n"
            "    with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
            "        vlmfast.cli.main.main(argv)\n"
            "    assert 'usage: vlmfast' in out.getvalue(), argv")
    assert _modules_loaded_after(code) == []


def test_version_prints_the_package_version_without_importing_torch(capsys):
    import vlmfast

    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0 and capsys.readouterr().out == f"vlmfast {vlmfast.__version__}\n"
    code = ("import contextlib, io\nimport vlmfast.cli.main\n"
            "with contextlib.redirect_stdout(io.StringIO()) as out, contextlib.suppress(SystemExit):\n"
            "    vlmfast.cli.main.main(['--version'])\n"
            "assert out.getvalue().startswith('vlmfast '), out.getvalue()")
    assert _modules_loaded_after(code) == []


def test_importing_the_package_is_lazy_and_its_names_still_resolve():
    assert _modules_loaded_after("import vlmfast") == []
    import vlmfast
    from vlmfast import OptimizedTrainer, TrainSpec  # noqa: F401  (still importable by name)

    assert all(getattr(vlmfast, name) is not None for name in vlmfast.__all__)
    assert vlmfast.OptimizedTrainer.__module__ == "vlmfast.train.loop" and callable(vlmfast.attention)


def test_every_lazily_registered_command_lists_the_help_its_registrar_gives():
    """`vlmfast --help` lists the modules' sub-commands without importing them: the help must be theirs."""
    from vlmfast.cli.main import LAZY_COMMANDS, _parser

    full = {a.dest: a.help for a in _parser()._subparsers._group_actions[0]._choices_actions}
    listed = {a.dest: a.help for a in _parser(["--help"])._subparsers._group_actions[0]._choices_actions}
    assert list(full) == list(listed) and set(LAZY_COMMANDS) < set(full)
    assert {name: full[name] for name in LAZY_COMMANDS} == {name: listed[name] for name in LAZY_COMMANDS}
    bench = _parser(["bench", "--quick"]).parse_args(["bench", "--quick"])
    assert bench.command == "bench" and callable(bench.run)


LOGITS_TASK = '''
import torch
from torch import nn


class Logits(nn.Module):
    """Returns logits only, in a dict: no loss for the trainer to read."""

    def __init__(self):
        super().__init__()
        self.embed, self.head = nn.Embedding(10, 8), nn.Linear(8, 10)

    def forward(self, input_ids, labels=None):
        return {"logits": self.head(self.embed(input_ids))}


def build():
    g = torch.Generator().manual_seed(0)
    return Logits(), [{"input_ids": torch.randint(0, 10, (5,), generator=g)} for _ in range(8)], None
'''


def test_yes_no_words_read_from_yaml_booleans_through_set_and_files(tmp_path):
    """`--set loss.shift_labels=yes` (YAML: True), the value the label probe's error suggests, is the word."""
    spec = build_spec(None, ["loss.shift_labels=yes", "log.progress=on", "data.check_samples=off"])
    assert (spec.loss.shift_labels, spec.log.progress, spec.data.check_samples) == ("yes", "on", "off")
    assert build_spec(None, ["loss.shift_labels=no"]).loss.shift_labels == "no"
    assert build_spec(None, ["loss.shift_labels='yes'"]).loss.shift_labels == "yes"  # quoted: the word itself
    path = tmp_path / "run.yaml"
    path.write_text("loss:\n  shift_labels: yes\ndata:\n  check_samples: off\n")
    spec = TrainSpec.from_file(path)
    assert (spec.loss.shift_labels, spec.data.check_samples) == ("yes", "off")
    assert TrainSpec.model_validate(yaml.safe_load("loss: {shift_labels: no}")).loss.shift_labels == "no"
    assert TrainSpec.from_file(path).to_dict() == TrainSpec.model_validate(spec.to_dict()).to_dict()  # round trip


def test_a_boolean_without_a_word_is_refused_naming_the_choices(capsys):
    assert main(["train", "--set", "data.check_samples=yes"]) == 2  # choices skip/error/off: no word for true
    err = capsys.readouterr().err
    assert "data.check_samples: expected one of 'error', 'off', 'skip', got the boolean true" in err, err


def test_a_model_without_a_loss_is_one_line_naming_loss_fn_and_the_task(tmp_path, monkeypatch, capsys):
    """Before: the probe asked for loss.shift_labels; with it set, the run died in a raw TypeError traceback."""
    (tmp_path / "logits_task.py").write_text(LOGITS_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    run = ["train", "--task", "logits_task:build", "--set", "max_steps=1", "--set", "batch_size=4"]
    for extra in ([], ["--set", "loss.shift_labels=yes"], ["--set", "loss.shift_labels='yes'"]):
        assert main([*run, *extra]) == 2, extra
        err = capsys.readouterr().err
        assert "Traceback" not in err and "the model returned a dict without a 'loss'" in err, err
        assert "loss_fn" in err and "--task" in err and "shift_labels" not in err, err


def test_an_interrupted_run_without_save_dir_does_not_print_checkpoint_none(monkeypatch, capsys):
    from types import SimpleNamespace

    import vlmfast.cli.main

    for save_dir, checkpoint, said in ((None, None, "no checkpoint written (no save.dir)"),
                                       ("ckpt", "ckpt/step_00000002", "checkpoint: ckpt/step_00000002")):
        trainer = SimpleNamespace(is_main_process=True, spec=TrainSpec(save={"dir": save_dir}),
                                  fit=lambda c=checkpoint: SimpleNamespace(interrupted="SIGTERM", checkpoint=c))
        monkeypatch.setattr(vlmfast.cli.main, "_build_trainer", lambda args, t=trainer: (t, None))
        assert main(["train"]) == 130
        err = capsys.readouterr().err
        assert f"interrupted by SIGTERM; {said}" in err and "None" not in err, err


def test_the_demo_template_is_exactly_what_train_runs_with_no_config(tmp_path, capsys):
    """The quickstart's "change one thing" flow starts from `vlmfast spec --demo > run.yaml`: that file trains the
    built-in task exactly as `vlmfast train` with no config does (the defaults template trains 100 steps, not 600)."""
    assert main(["spec", "--demo"]) == 0
    path = tmp_path / "run.yaml"
    path.write_text(capsys.readouterr().out)
    from_file = build_spec(str(path), ["precision=bf16"], builtin_task=True)
    no_config = build_spec(None, ["precision=bf16"], builtin_task=True)
    assert from_file == no_config
    assert fields_changed_from_demo(from_file) == []
    assert "max_steps 100 (demo: 600)" in fields_changed_from_demo(TrainSpec())


def test_a_failed_image_check_on_a_spec_that_is_not_the_demos_says_what_differs(monkeypatch, capsys):
    from types import SimpleNamespace

    import vlmfast.cli.main

    for spec, hint in ((TrainSpec(), True), (build_spec(None, ["precision=bf16"]), False)):
        trainer = SimpleNamespace(is_main_process=True, spec=spec,
                                  fit=lambda: SimpleNamespace(interrupted=None, eval_loss=1.2))
        monkeypatch.setattr(vlmfast.cli.main, "_build_trainer", lambda args, t=trainer: (t, 1.0))
        assert main(["train"]) == 0
        err = capsys.readouterr().err
        assert "NOT below the best a model that ignores the image can do" in err
        assert ("max_steps 100 (demo: 600)" in err and "vlmfast spec --demo > run.yaml" in err) == hint, err
