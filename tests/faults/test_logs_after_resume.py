"""Logs that tell the truth after a resume, and logging that never stops training.

- metrics.jsonl is cut back to the resumed step: after a SIGKILL and a resume every step appears once, no half line.
- report.json describes the whole run across sessions; re-running a finished run does not rewrite it with 0 steps.
- A log that cannot be written (a full disk) is warned about once; training and its checkpoints go on.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

from _faults import losses, make_spec, tiny_filesystem, train

from vlmfast.checkpoints.store import latest_checkpoint, verify_checkpoint

TESTS = Path(__file__).resolve().parents[1]


def _metrics(log_dir: Path) -> list[dict]:
    text = (log_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n") or not text
    return [json.loads(line) for line in text.splitlines()]


def test_no_duplicated_steps_in_metrics_after_kill_and_resume(tmp_path):
    """Killed (SIGKILL) after logging step 8, with the last checkpoint at step 6: the resumed run logs 7.. again."""
    save, logs = tmp_path / "ckpt", tmp_path / "logs"
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path.insert(0, {str(TESTS / "faults")!r}); sys.path.insert(0, {str(TESTS)!r})
        from _faults import make_spec, train

        class KillAfterStep8:
            def on_step_end(self, trainer, metrics):
                if metrics["step"] == 8:
                    with open({str(logs / "metrics.jsonl")!r}, "a") as f:
                        f.write('{{"step": 9, "loss": 1.')  # a line cut short by the kill
                    os.kill(os.getpid(), signal.SIGKILL)

        train(make_spec(max_steps=12, save={{"dir": {str(save)!r}, "every_steps": 3}},
                        log={{"dir": {str(logs)!r}, "progress": "off"}}), callbacks=[KillAfterStep8()])
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert latest_checkpoint(save).name == "step_00000006"
    spec = make_spec(max_steps=12, save={"dir": str(save), "every_steps": 3}, log={"dir": str(logs), "progress": "off"})
    _, resumed = train(spec)
    assert resumed.resumed_from.name == "step_00000006"
    steps = [m["step"] for m in _metrics(logs)]
    assert steps == list(range(1, 13))  # each step once; 7 and 8 of the killed run and its half line are gone
    _, full = train(make_spec(max_steps=12))
    assert [m["loss"] for m in _metrics(logs)] == losses(full)  # the log is the run: the killed steps' re-runs
    report = json.loads((logs / "report.json").read_text())
    assert report["steps"] == 12 and report["first_loss"] == losses(full)[0]
    sessions = report["extra"]["sessions"]
    assert [(s["from_step"], s["to_step"]) for s in sessions] == [(0, 6), (6, 12)]
    assert sessions[0]["estimated"]  # the killed session wrote no report: its time is estimated from its steps


def test_report_json_is_cumulative_and_a_finished_run_rerun_keeps_it(tmp_path):
    save, logs = tmp_path / "ckpt", tmp_path / "logs"

    def spec(max_steps):
        return make_spec(max_steps=max_steps, save={"dir": str(save)}, log={"dir": str(logs), "progress": "off"})

    _, first = train(spec(5))
    _, second = train(spec(9))
    report = json.loads((logs / "report.json").read_text())
    assert report["steps"] == 9
    assert report["wall_time_s"] == first.report.wall_time_s + second.report.wall_time_s
    assert report["first_loss"] == first.report.first_loss and report["final_loss"] == second.report.final_loss
    assert [(s["from_step"], s["to_step"]) for s in report["extra"]["sessions"]] == [(0, 5), (5, 9)]
    _, again = train(spec(9))  # nothing left to run: no report of zeros (docs/checkpoints.md)
    assert again.report is None and again.history == [] and again.resumed_from is not None
    rerun = json.loads((logs / "report.json").read_text())
    assert rerun["steps"] == 9 and rerun["final_loss"] == second.report.final_loss
    assert rerun["extra"]["sessions"] == report["extra"]["sessions"]
    assert [m["step"] for m in _metrics(logs)] == list(range(1, 10))


def test_a_failing_metrics_log_never_stops_training_or_its_checkpoints(tmp_path, monkeypatch, caplog):
    from vlmfast.reporting.report import MetricsLogger

    real_write, calls = MetricsLogger._write, []

    def full_disk_from_step_3(self, data):
        calls.append(data)
        if len(calls) >= 3:
            os.write(self._fd, data[:7])  # part of the line reaches the file, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(self, data)

    monkeypatch.setattr(MetricsLogger, "_write", full_disk_from_step_3)
    save, logs = tmp_path / "ckpt", tmp_path / "logs"
    with caplog.at_level(logging.WARNING, logger="vlmfast.reporting.report"):
        trainer, result = train(make_spec(max_steps=6, save={"dir": str(save)},
                                          log={"dir": str(logs), "progress": "off"}))
    assert trainer.state.step == 6 and result.checkpoint.name == "step_00000006"
    verify_checkpoint(result.checkpoint)
    assert [m["step"] for m in _metrics(logs)] == [1, 2]  # whole lines only
    assert caplog.text.count("cannot write") == 1 and "training goes on" in caplog.text


def test_a_full_log_disk_never_stops_training(tmp_path):
    with tiny_filesystem(tmp_path / "logs", "12k") as logs:
        (logs / "filler").write_bytes(b"x" * (8 << 10))  # a few metrics lines fit, then the disk is full
        save = tmp_path / "ckpt"
        trainer, result = train(make_spec(max_steps=40, save={"dir": str(save)},
                                          log={"dir": str(logs), "progress": "off"}))
        assert trainer.state.step == 40 and result.checkpoint.name == "step_00000040"
        steps = [m["step"] for m in _metrics(logs)]
        assert steps == list(range(1, len(steps) + 1)) and len(steps) < 40
