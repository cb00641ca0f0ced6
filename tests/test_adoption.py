"""What a new team hits first (issue 20): short runs, launchers that start fewer processes than asked, their own model
through the CLI, BatchNorm under micro-batching. Single-process and fast; the multi-process loops are in
tests/test_hooks_in_loops.py and the printed commands in tests/test_printed_commands.py.
"""

from __future__ import annotations

import logging

import pytest

from vlmfast.spec import TrainSpec


def test_a_warm_up_longer_than_the_run_is_clamped_with_a_note(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vlmfast.spec"):
        spec = TrainSpec(max_steps=10, scheduler={"name": "cosine", "warmup_steps": 20})
    assert spec.scheduler.warmup_steps == 1
    assert "scheduler.warmup_steps 20 is not below max_steps 10: warming up over 1 step(s)" in caplog.text
    caplog.clear()
    assert TrainSpec(max_steps=30, scheduler={"warmup_steps": 20}).scheduler.warmup_steps == 20  # untouched
    assert not caplog.records


def test_launch_warning_when_accelerate_launch_started_one_process(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    from vlmfast import integrations
    from vlmfast.engines.process_group import init_distributed
    from vlmfast.integrations import launch_warning

    monkeypatch.setattr(integrations, "_warned", set())  # warned once per process: start from none

    # What `accelerate launch --num_processes 2` sets on a machine without GPUs: one process, MASTER_ADDR, no WORLD_SIZE
    simple = {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "False", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": "29500"}
    assert "--multi_gpu --num_processes N" in launch_warning(environ=simple)
    assert launch_warning(environ={**simple, "WORLD_SIZE": "2"}) is None  # torchrun-style: fine
    assert launch_warning(environ={"MASTER_ADDR": "127.0.0.1"}) is None  # not accelerate: nothing to say
    assert launch_warning(environ={}) is None

    class AloneAccelerator:  # an Accelerator() that found no GPU under a 2-process launch
        num_processes = 1

    assert "Accelerator(cpu=True)" in launch_warning(AloneAccelerator(), environ={"WORLD_SIZE": "2"})

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in simple.items():
        monkeypatch.setenv(key, value)
    with caplog.at_level(logging.WARNING, logger="vlmfast.integrations"):
        assert init_distributed().world_size == 1  # the trainer's first call
    assert "started only this one" in caplog.text
