"""Resuming with a changed spec: refused with a message naming the field, or carried on with a message saying what
the change means; never two trainings silently mixed."""

from __future__ import annotations

import logging

import pytest
import torch
from _faults import losses, make_spec, train
from conftest import TinyCausalLM

from vlmfast import SpecError, TrainSpec
from vlmfast.checkpoints.store import check_resume_compatible


def saved_run(tmp_path, **overrides):
    """A 2-step run that leaves a checkpoint in tmp_path; returns the spec overrides a resume starts from."""
    base = {"max_steps": 2, "save": {"dir": str(tmp_path)}, **overrides}
    train(make_spec(**base))
    return base


@pytest.mark.parametrize(
    ("change", "field", "why"),
    [
        ({"seed": 7}, "seed=0 but the spec now says 7", "data order"),
        ({"optimizer": {"name": "sgd"}}, "optimizer.name='adamw' but the spec now says 'sgd'", "optimizer state"),
        ({"optimizer": {"lr": 1e-4}}, "optimizer.lr=0.01 but the spec now says 0.0001", "silently override"),
        ({"scheduler": {"name": "cosine"}}, "scheduler.name='constant' but the spec now says 'cosine'", "lr would"),
        ({"data": {"shuffle": False}}, "data.shuffle=True but the spec now says False", "old sample order"),
    ],
)
def test_a_change_that_would_mix_two_trainings_is_refused_naming_the_field(tmp_path, change, field, why):
    base = saved_run(tmp_path)
    spec = make_spec(**{**base, "max_steps": 4, **change})
    with pytest.raises(SpecError, match=rf"cannot resume: the checkpoint was written with {field}.*{why}.*Restore"):
        train(spec)


def test_a_changed_global_batch_is_refused_naming_batch_size_and_the_value_that_continues(tmp_path):
    base = saved_run(tmp_path)
    spec = make_spec(**{**base, "max_steps": 4, "batch_size": 16, "micro_batch_size": 4})
    with pytest.raises(SpecError, match=r"global batch is 1 rank\(s\) x batch_size 8 = 8 samples, this run's 1 x 16 = "
                       r"16: the data position counts global batches.*set batch_size: 8 to continue on 1 rank"):
        train(spec)


def test_a_different_model_shape_is_refused_naming_the_checkpoint(tmp_path):
    base = saved_run(tmp_path)
    with pytest.raises(SpecError, match=r"(?s)cannot resume from .*step_00000002.*size mismatch.*save.resume: never"):
        train(make_spec(**{**base, "max_steps": 4}), TinyCausalLM(dim=48))


def test_micro_batch_size_may_change_and_the_trajectory_is_kept(tmp_path, caplog):
    _, full = train(make_spec(max_steps=6))
    base = saved_run(tmp_path)
    with caplog.at_level(logging.INFO, logger="vlmfast"):
        trainer, resumed = train(make_spec(**{**base, "max_steps": 6, "micro_batch_size": 4}))
    assert resumed.history[0]["step"] == 3 and trainer.state.micro_batch_size == 4
    assert "resuming with a changed spec: max_steps 2 -> 6, micro_batch_size 2 -> 4" in caplog.text
    torch.testing.assert_close(losses(resumed), losses(full)[2:], rtol=1e-5, atol=1e-6)  # same gradient


def test_precision_and_schedule_length_may_change_with_a_warning_saying_what_changes(tmp_path, caplog):
    base = saved_run(tmp_path, scheduler={"name": "cosine"})
    with caplog.at_level(logging.WARNING, logger="vlmfast"):
        trainer, resumed = train(make_spec(**{**base, "max_steps": 4, "precision": "bf16"}))
    assert resumed.history[0]["step"] == 3 and trainer.state.step == 4
    warning = next(r.getMessage() for r in caplog.records if "resuming with a changed spec" in r.getMessage())
    assert "precision 'fp32' -> 'bf16'" in warning and "max_steps, precision change(s) what is trained" in warning
    assert "the lr schedule now spans the new max_steps" in warning


@pytest.mark.parametrize(
    ("field", "old", "new"),
    [
        ("engine", "deepspeed", "ddp"),
        ("engine", "ddp", "fsdp"),
        ("deepspeed.zero_stage", 2, 3),
        ("data.group_by_length", "none", "length"),
        ("optimizer.param_groups", [], [{"modules": ["head"]}]),
    ],
)
def test_backend_and_state_layout_changes_are_refused(field, old, new):
    saved, current = _with(field, old), _with(field, new)
    with pytest.raises(SpecError, match=rf"{field}={old!r} but the spec now says {new!r}".replace("[", r"\[")):
        check_resume_compatible(saved, current)


def test_a_field_newer_than_the_checkpoint_is_not_a_change(caplog):
    saved, current = TrainSpec().to_dict(), TrainSpec().to_dict()
    del saved["optimizer"]["implementation"], saved["scheduler"]["min_lr_ratio"]  # as an older vlmfast wrote it
    with caplog.at_level(logging.INFO, logger="vlmfast"):
        check_resume_compatible(saved, current)
    assert "scheduler.min_lr_ratio (absent) -> 0.0" in caplog.text


def _with(dotted: str, value) -> dict:
    spec = TrainSpec().to_dict()
    section, _, key = dotted.rpartition(".")
    (spec[section] if section else spec)[key] = value
    return spec
