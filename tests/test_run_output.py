"""What a run prints when nobody watches a terminal: plain progress lines, where each checkpoint went, and a resumed
run that has nothing left to do.

- `log.progress: lines` (what `auto` picks when stderr is not a terminal): a line at the first step, every
  `log.lines_every_steps` steps or `log.lines_every_s` seconds (whichever first) and at the last step, with step,
  loss, samples/s, tokens/s and ETA; `vlmfast train > file 2>&1` has one in the file while the process still runs;
- each checkpoint's path is printed when it is written, and the last one is in the run report;
- a resume from a checkpoint already at `max_steps` prints one "nothing to do" line and returns: no report of
  zeros, no second evaluation, no second export.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import TinyCausalLM, TokenDataset

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.reporting.progress_lines import ProgressLines, format_duration

pytestmark = pytest.mark.usefixtures("one_thread")


class _Clock:
    """A clock the test moves by hand (no timing in a unit test)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _metrics(step: int, step_time: float = 0.5) -> dict[str, float]:
    return {"step": step, "loss": 2.0 / step, "step_time": step_time, "samples_per_s": 8 / step_time,
            "tokens_per_s": 400 / step_time}


def test_progress_lines_come_at_the_first_step_every_n_steps_after_t_seconds_and_at_the_last_step(tmp_path):
    clock, out = _Clock(), open(tmp_path / "out.txt", "w")  # noqa: SIM115
    lines = ProgressLines(every_steps=10, every_s=30.0, total_steps=25, stream=out, clock=clock)
    printed = {}
    for step in range(1, 26):
        clock.now += 0.5 if step != 14 else 40.0  # step 14 ends 40 s after the previous line
        if (line := lines.step(_metrics(step))) is not None:
            printed[step] = line
    assert sorted(printed) == [1, 10, 14, 20, 25]
    assert printed[20] == "step 20/25 (80%) | loss 0.1000 | 16.0 samples/s | 800 tokens/s | 0.50 s/step | ETA 2s"
    out.close()
    assert (tmp_path / "out.txt").read_text().splitlines() == [printed[s] for s in sorted(printed)]  # flushed


def test_the_eta_is_the_remaining_steps_at_the_pace_since_the_previous_line():
    lines = ProgressLines(every_steps=2, every_s=1e9, total_steps=1000, stream=open(os.devnull, "w"),  # noqa: SIM115
                          clock=_Clock())
    lines.step(_metrics(1, step_time=9.0))  # a slow first step (a compile) does not weigh on the later ETAs
    assert lines.step(_metrics(2, step_time=1.5)).endswith("1.50 s/step | ETA 24m57s")
    assert [format_duration(s) for s in (7, 185, 7440)] == ["7s", "3m05s", "2h04m"]


def test_auto_writes_lines_and_no_bar_when_stderr_is_not_a_terminal(capsys):
    spec = TrainSpec(max_steps=3, batch_size=4, device="cpu", log={"lines_every_steps": 2},
                     memory={"leak_check": False})  # log.progress: auto; pytest's stderr is not a terminal
    OptimizedTrainer(TinyCausalLM(), TokenDataset(16), spec).fit()
    err = capsys.readouterr().err
    assert [line.split(" |")[0] for line in err.splitlines() if line.startswith("step ")] == \
        ["step 1/3 (33%)", "step 2/3 (67%)", "step 3/3 (100%)"]
    assert "\r" not in err  # no bar


def test_vlmfast_train_to_a_file_has_step_and_checkpoint_lines_while_it_runs(tmp_path):
    log_file, ckpt = tmp_path / "train.log", tmp_path / "ckpt"
    command = [sys.executable, "-m", "vlmfast.cli.main", "train", "--samples", "64", "--set", "max_steps=100000",
               "--set", "batch_size=4", "--set", "log.lines_every_steps=1", "--set", f"save.dir={ckpt}",
               "--set", "save.every_steps=2", "--set", "save.keep_last=1"]
    with open(log_file, "wb") as out:  # stdout and stderr to a file: no terminal, as under nohup or a cluster job
        proc = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        deadline = time.monotonic() + 240
        while "checkpoint of step 2: " not in log_file.read_text() and time.monotonic() < deadline:
            assert proc.poll() is None, log_file.read_text()
            time.sleep(0.2)
        text = log_file.read_text()
        assert proc.poll() is None  # found while the run still runs (max_steps 100000)
    finally:
        proc.send_signal(signal.SIGTERM)  # the run's handler: a final checkpoint, exit 130
        code = proc.wait(timeout=120)
    assert "step 1/100000 (0%) | loss " in text and " tokens/s | " in text and "| ETA " in text, text
    assert f"checkpoint of step 2: {ckpt / 'step_00000002'}" in text, text
    final = log_file.read_text()
    assert code == 130 and "interrupted by SIGTERM; checkpoint: " + str(ckpt / "step_") in final, final


def _spec(tmp_path, max_steps: int) -> TrainSpec:
    return TrainSpec(max_steps=max_steps, batch_size=4, device="cpu", log={"progress": "off"},
                     memory={"leak_check": False},
                     save={"dir": str(tmp_path / "ckpt"), "export": {"dir": str(tmp_path / "export")}})


def test_the_final_checkpoint_is_printed_and_in_the_report_and_a_finished_run_resumed_has_nothing_to_do(
        tmp_path, capsys):
    first = OptimizedTrainer(TinyCausalLM(), TokenDataset(16), _spec(tmp_path, 2), eval_data=TokenDataset(8)).fit()
    final = tmp_path / "ckpt" / "step_00000002"
    assert first.checkpoint == final and first.report.extra["checkpoint"] == str(final)
    assert f"checkpoint: {final}" in first.report.to_text()
    assert f"checkpoint of step 2: {final}" in capsys.readouterr().err
    exported = (tmp_path / "export" / "model.safetensors").stat().st_mtime_ns

    again = OptimizedTrainer(TinyCausalLM(), TokenDataset(16), _spec(tmp_path, 2), eval_data=TokenDataset(8)).fit()
    err = capsys.readouterr().err
    assert err == f"nothing to do: {final} is at step 2 and max_steps is 2 (raise max_steps to train further)\n"
    assert again.report is None and again.history == [] and again.eval_history == [] and again.eval_loss is None
    assert again.resumed_from == final == again.checkpoint and again.exported is None
    assert (tmp_path / "export" / "model.safetensors").stat().st_mtime_ns == exported  # not exported again


def test_vlmfast_train_of_a_finished_run_says_nothing_to_do_and_exits_0(tmp_path, capsys):
    from vlmfast.cli.main import main

    argv = ["train", "--samples", "32", "--set", "max_steps=1", "--set", "batch_size=4", "--set", "log.progress=off",
            "--set", "scheduler.warmup_steps=0",
            "--set", f"save.dir={tmp_path / 'ckpt'}"]
    assert main(argv) == 0
    assert "held-out loss" in capsys.readouterr().err
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert err.splitlines() == [f"nothing to do: {tmp_path / 'ckpt' / 'step_00000001'} is at step 1 and max_steps is 1 "
                                "(raise max_steps to train further)"]

