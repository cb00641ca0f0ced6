"""`vlmfast doctor [CONFIG]`: profile a short run of the job and print a ranked diagnosis with spec changes.

Usage::

    vlmfast doctor                                  # the built-in tiny VLM
    vlmfast doctor run.yaml --task mypkg.jobs:build --steps 30
    vlmfast doctor run.yaml --apply                 # also run each suggested change alone and measure its gain
    vlmfast doctor --apply --trial-limit 0          # ... waiting for a change's start-up however long (a compile)
    vlmfast doctor run.yaml --out doctor/ --json doctor/diagnosis.json   # keep the trace, plot and findings

In cli.py: ``from vlmfast.profiling.doctor_cli import add_doctor_command; add_doctor_command(sub)``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from dataclasses import asdict
from typing import Any

from vlmfast.cli.jobs import add_job_arguments, build_spec, load_task, run_task, task_job
from vlmfast.common.safe_files import open_for_writing

__all__ = ["add_doctor_command", "run_doctor"]


def add_doctor_command(subparsers: Any) -> argparse.ArgumentParser:
    """Add the `doctor` sub-command to the `vlmfast` parser."""
    doctor = subparsers.add_parser(
        "doctor", help="profile a few steps of the job and print what is slow, ranked, with the spec change to try")
    add_job_arguments(doctor)
    doctor.add_argument("--steps", type=int, default=20, help="optimizer steps to profile (default 20)")
    doctor.add_argument("--apply", action="store_true",
                        help="then re-run with each suggested change alone and report its measured gain")
    doctor.add_argument("--trial-limit", type=float, default=None, metavar="SECONDS",
                        help="--apply: abandon a change's run past this many seconds, its row 'not measured' (a "
                        "compile with a cold cache); default: 3x the baseline run, at least 20 s; 0: no limit")
    doctor.add_argument("--out", default=None, help="folder for the profiler trace, the step-time plot and metrics")
    doctor.add_argument("--json", default=None, help="also write the findings (and trials) to this JSON file")
    doctor.set_defaults(run=_cmd_doctor)
    return doctor


def _cmd_doctor(args: argparse.Namespace) -> int:
    spec = build_spec(args.config, args.set)  # fails here, before any model or data is built
    load_task(args.task)  # a bad --task fails before any run

    def build_job() -> Any:
        return run_task(args.task, spec.seed, args.samples)

    report = run_doctor(spec, build_job, steps=args.steps, apply=args.apply, out_dir=args.out,
                        trial_limit_s=args.trial_limit)
    if report is None:  # not rank 0
        return 0
    print(report["text"])
    if args.json:
        with open_for_writing(args.json, "w", what="--json file") as handle:
            json.dump({k: v for k, v in report.items() if k != "text"}, handle, indent=2, default=str)
    return 0


def run_doctor(spec: Any, build_job: Any, steps: int = 20, apply: bool = False,
               out_dir: str | None = None, trial_limit_s: float | None = None) -> dict[str, Any] | None:
    """Profile `steps` steps of the job `build_job()` -> (model, dataset, collate_fn) returns, diagnose, and with
    `apply` measure each suggested change alone, each within `trial_limit_s` (None: 3x the baseline run, at least
    20 s; 0: no limit; vlmfast.profiling.trial_budget). Returns findings, trials and the printable text (None off
    rank 0)."""
    from vlmfast.profiling.doctor import (
        diagnose,
        doctor_spec,
        format_findings,
        format_trials,
        one_flag_at_a_time,
        rank_findings,
    )
    from vlmfast.profiling.trial_budget import trial_budget_for

    main_process = [True]
    # The baseline's trace is printed (report line, findings), so it is kept: in --out, else in a folder of its own
    # that the doctor names at the end. The trials need only timings: no trace, nothing to delete.
    trace_dir = None if out_dir else tempfile.mkdtemp(prefix="vlmfast-doctor-") + "/profiler"

    def run(candidate: Any, keep: str | None = None, trace: bool = False) -> Any:
        spec_run = doctor_spec(candidate, steps, keep, trace_dir if trace else None, trace=trace)
        trainer, result = _fit(spec_run, build_job)
        main_process[0] = trainer.is_main_process
        from vlmfast.profiling.doctor import collect_evidence

        return collect_evidence(trainer, result)

    print(f"vlmfast doctor: profiling {steps} steps ...", file=sys.stderr)
    started = time.monotonic()
    evidence = run(spec, out_dir, trace=True)
    limit = trial_budget_for(time.monotonic() - started) if trial_limit_s is None else trial_limit_s or None
    findings = diagnose(evidence)
    trials = []
    if apply and any(f.change for f in findings):
        print(f"vlmfast doctor: measuring {sum(bool(f.change) for f in findings)} change(s) one at a time"
              + (f", each within {limit:.0f} s" if limit else "") + " ...", file=sys.stderr)
        trials = one_flag_at_a_time(run, spec, findings, baseline=evidence, limit_s=limit)
        findings = rank_findings(findings, trials)  # by the measured gain over the job: no advice the table refutes
    text = format_findings(findings, evidence)
    if trials:
        text += "\n\none flag at a time (each change alone, same steps):\n" + format_trials(trials)
    if not main_process[0]:
        return None
    if trace_dir is not None and main_process[0]:
        text += f"\n\nprofiler trace kept in {trace_dir} (open in ui.perfetto.dev; --out DIR chooses the folder)"
    return {"text": text, "findings": [asdict(f) for f in findings], "trials": [asdict(t) for t in trials],
            "step_time_p50_ms": evidence.step_ms, "mfu": evidence.mfu}


def _fit(spec: Any, build_job: Any) -> tuple[Any, Any]:

    job = build_job()  # a fresh model per run: every trial starts from the same weights
    trainer = (job if hasattr(job, "trainer") else task_job(job, "build_job()")).trainer(spec)
    return trainer, trainer.fit()
