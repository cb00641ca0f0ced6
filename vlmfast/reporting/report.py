"""What a run tells its user: a progress bar (plain lines off a terminal: progress_lines.py), per-step metrics
(JSONL, TensorBoard) and an end-of-run report.

Only rank 0 writes. After a resume, ``metrics.jsonl`` is first cut back to the step the run resumed from (a killed
run may have logged steps after its last checkpoint, which are about to run again), and TensorBoard purges its events
after that step; ``report.json`` describes the whole run across resumes (:meth:`MetricsLogger.whole_run`). A fresh
run (not a resume) in a log.dir that holds another run's report.json keeps it as ``report.previous.json``, and its
report ends with what changed against it: the spec fields and the headline figures (:meth:`MetricsLogger.compare`).
A log that cannot be written (a full disk) is warned about once and skipped: it never stops training or its
checkpoints.

Usage::

    with MetricsLogger(spec.log, total_steps=spec.max_steps, initial_step=resumed_step) as metrics:
        metrics.log_step({"step": 1, "loss": 2.3, ...})
        metrics.compare(session_report, eval_loss=0.9)  # the spec, and the previous run's figures to compare with
        report = metrics.whole_run(session_report)      # cumulative over every session of this run
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import sys
import textwrap
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from vlmfast.common.safe_files import open_fd, refuse_symlink, write_atomic
from vlmfast.profiling.phase_timer import percentile
from vlmfast.reporting.progress_lines import ProgressLines
from vlmfast.reporting.tracking import close_trackers, open_trackers
from vlmfast.spec import LogSpec

# The one definition of "step time" the report prints (the profiler's phase split uses its timed steps only).
STEP_TIME_DEFINITION = "wall clock from one optimizer step's end to the next's, data wait included"

log = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
REPORT_FILE = "report.json"
PREVIOUS_REPORT_FILE = "report.previous.json"  # the report of the run before this one in the same log.dir
TRACKER_FOLDERS = ("wandb", "mlruns")  # where W&B and a local MLflow store write under log.dir (reporting.tracking)


class MetricsLogger:
    """Writes per-step metrics to metrics.jsonl / TensorBoard and drives the progress bar."""

    def __init__(self, spec: LogSpec, total_steps: int, initial_step: int = 0, enabled: bool = True,
                 config: dict[str, Any] | None = None) -> None:
        self.spec = spec
        self.enabled = enabled
        self.initial_step = initial_step
        self._fd: int | None = None
        self._tensorboard = None
        if enabled and spec.dir is not None:  # before anything is opened: a planted link fails the run at its start
            for name in (METRICS_FILE, REPORT_FILE, PREVIOUS_REPORT_FILE, *TRACKER_FOLDERS):
                refuse_symlink(Path(spec.dir) / name, "log.dir entry")
        # W&B / MLflow get the records metrics.jsonl gets; `config` (the spec) is their run's parameters.
        self._trackers = open_trackers(spec, config) if enabled else []
        self.config = config
        self.previous: dict[str, Any] | None = None
        self._failed: str | None = None  # the first write error, warned once
        self.path = Path(spec.dir) / METRICS_FILE if spec.dir is not None else None
        if enabled and self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._fd = self._open_truncated(self.path, initial_step)
            # the run before this one (a resume's earlier sessions are this run: report.json, merged by whole_run)
            self.previous = self._previous_run(initial_step)
            if spec.tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                # purge_step: events of steps after the resumed one (logged before a kill) are hidden, as in the JSONL
                # A random suffix: no one can plant a link at the event file's name in advance (TensorBoard opens
                # it by name, truncating); checked once it exists.
                self._tensorboard = SummaryWriter(log_dir=str(spec.dir), purge_step=initial_step + 1,
                                                  filename_suffix=f".{secrets.token_hex(6)}")
                _check_event_file(self._tensorboard)
        mode = spec.progress if spec.progress != "auto" else "on" if sys.stderr.isatty() else "lines"
        self._bar = tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True,
                         disable=not (enabled and mode == "on"))
        # no terminal (a log file, nohup, a cluster job): plain lines instead of the bar, flushed at once
        self._lines = ProgressLines(spec.lines_every_steps, spec.lines_every_s, total_steps) \
            if enabled and mode == "lines" else None

    @staticmethod
    def _open_truncated(path: Path, initial_step: int) -> int | None:
        """Open metrics.jsonl for appending, cut after the last whole line of a step <= `initial_step`."""
        fd = open_fd(path, os.O_RDWR | os.O_APPEND, what="log.dir file")  # never through a link (common.safe_files)
        keep, dropped = _lines_up_to(path, initial_step)
        if dropped:
            os.ftruncate(fd, keep)  # shrinking needs no free space
            if initial_step:
                log.info("%s: dropped %d line(s) after step %d (logged before the run was stopped; they run again)",
                         path, dropped, initial_step)
            else:
                log.warning("%s held %d line(s) of an earlier run that never saved a checkpoint: starting it afresh",
                            path, dropped)
        return fd

    def _previous_run(self, initial_step: int) -> dict[str, Any] | None:
        """The previous run's report. A fresh run (nothing resumed: initial_step 0) finding a report.json keeps it as
        report.previous.json (it is another run's: this one has written none yet); a resumed run's report.json is
        its own earlier sessions', so its previous run is the report.previous.json its first session kept."""
        folder = Path(self.spec.dir)  # type: ignore[arg-type]
        current, kept = folder / REPORT_FILE, folder / PREVIOUS_REPORT_FILE
        if initial_step == 0 and current.exists():
            try:
                os.replace(current, kept)  # a link at either name was refused above
            except OSError as exc:
                log.warning("cannot keep the previous run's %s as %s (%s): this report is not compared with it",
                            current, kept.name, exc.strerror or exc)
                return None
            log.info("%s: the previous run's report, kept as %s to compare with", current, kept.name)
        return _read_report(kept)

    def compare(self, session: RunReport, eval_loss: float | None = None) -> None:
        """Complete this session's report: its spec, its held-out loss, and the previous run's report to compare
        with (the "vs the previous run" block of :meth:`RunReport.to_text`)."""
        session.eval_loss = eval_loss if eval_loss is not None else session.eval_loss
        if self.config is not None:
            session.spec = _plain(self.config)
        if self.previous is not None:
            session.previous = {key: self.previous.get(key) for key in PREVIOUS_KEYS}

    def log_step(self, metrics: dict[str, Any]) -> None:
        """Record one optimizer step (written every `log.every_steps`; the bar moves every step)."""
        if not self.enabled:
            return
        self._bar.update(1)
        if self._lines is not None:
            self._lines.step(metrics)
        step = metrics["step"]
        if step % self.spec.every_steps:
            return
        if not self._bar.disable:
            self._bar.set_postfix(loss=f"{metrics['loss']:.4f}", samples_s=f"{metrics['samples_per_s']:.1f}",
                                  tokens_s=f"{metrics['tokens_per_s']:.0f}", refresh=False)
        if self._fd is not None:
            self._append((json.dumps(metrics) + "\n").encode())
        if self._tensorboard is not None:
            try:
                for key, value in metrics.items():
                    if key != "step" and isinstance(value, (int, float)):
                        self._tensorboard.add_scalar(key if "/" in key else f"train/{key}", value, step)
            except OSError as exc:
                self._warn_failed("TensorBoard events", exc)
        for tracker in list(self._trackers):
            try:
                tracker.log(metrics, step)
            except Exception as exc:  # a tracker's store gone read-only or offline: training goes on, said once
                self._trackers.remove(tracker)
                log.warning("log.%s failed at step %d (%s: %s): training goes on without it; metrics.jsonl keeps "
                            "every step", tracker.name, step, type(exc).__name__, exc)
                close_trackers([tracker])

    def log_event(self, name: str, step: int, **fields: Any) -> None:
        """A record that is not a step's metrics, in metrics.jsonl (``{"event": name, "step": step, ...}``): what
        changed at a resume on another rank count or engine. Usage: ``logger.log_event("resumed", 4, ranks=1)``"""
        if self.enabled and self._fd is not None:
            self._append((json.dumps({"event": name, "step": step, **fields}) + "\n").encode())

    def _append(self, line: bytes) -> None:
        """One whole line or nothing: a failed write is cut back, so the file never holds half a line."""
        size = os.fstat(self._fd).st_size
        try:
            self._write(line)
        except OSError as exc:
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, size)
            self._warn_failed(str(self.path), exc)
            return
        if self._failed:
            log.warning("%s is written again (from step %s on)", self.path, json.loads(line)["step"])
            self._failed = None

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self._fd, view):]

    def _warn_failed(self, what: str, exc: OSError) -> None:
        if self._failed is None:
            log.warning("cannot write %s (%s): training goes on and checkpoints are still saved; these metrics are "
                        "missing until it can be written again (check the disk of log.dir)", what, exc.strerror or exc)
        self._failed = what

    def whole_run(self, session: RunReport) -> RunReport:
        """The report of the whole run: this session's `session` report merged with the steps logged before it
        (metrics.jsonl, cut back to the resumed step) and the earlier sessions in report.json. Without log.dir,
        or when nothing ran before, `session` itself."""
        if self.path is None:
            return session
        logged = [m for m in _read_lines(self.path) if "step_time" in m]
        before = [m for m in logged if m["step"] <= self.initial_step]
        if not before:  # the run's first session
            first = {"from_step": self.initial_step, "to_step": self.initial_step + session.steps,
                     "wall_time_s": session.wall_time_s}
            return RunReport(**{**asdict(session), "extra": {**session.extra, "sessions": [first]}})
        return _merge(session, logged, before, self.initial_step, _read_report(self.path.parent / REPORT_FILE),
                      self.spec.every_steps)

    def write(self, message: str) -> None:
        """Print a line without breaking the progress bar."""
        if self.enabled:
            self._bar.write(message, file=sys.stderr)
            sys.stderr.flush()  # a log file sees it now, not when the run ends

    def close(self) -> None:
        self._bar.close()
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tensorboard is not None:
            try:
                self._tensorboard.close()
            except OSError as exc:
                self._warn_failed("TensorBoard events", exc)
        for failure in close_trackers(self._trackers):
            log.warning(failure)
        self._trackers = []

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check_event_file(writer: Any) -> None:
    """Refuse TensorBoard's event file if it turned out to be a link (closing the writer first)."""
    name = getattr(getattr(writer.file_writer, "event_writer", None), "_file_name", None)
    try:
        if name is not None:
            refuse_symlink(name, "TensorBoard event file")
    except BaseException:
        writer.close()
        raise


def _global(metrics: dict[str, Any], name: str, world_size: int) -> float:
    """A step's samples or tokens over all ranks: the loop's sum over ranks ("global_tokens"); a history without it
    (hand-made, or older) counts this rank's x the rank count."""
    return metrics.get(f"global_{name}", metrics[name] * world_size)


def _plain(value: Any) -> Any:
    """`value` as report.json holds it (paths as strings), so that a spec compares equal to its saved copy."""
    return json.loads(json.dumps(value, default=str))


def _lines_up_to(path: Path, step: int) -> tuple[int, int]:
    """(bytes to keep, lines dropped): whole JSON lines of steps <= `step`, up to the first other line."""
    keep, dropped = 0, 0
    with open(path, "rb") as f:
        for raw in f:
            if dropped:
                dropped += 1
                continue
            try:
                good = raw.endswith(b"\n") and json.loads(raw)["step"] <= step
            except (ValueError, KeyError, TypeError):
                good = False
            if good:
                keep += len(raw)
            else:
                dropped = 1
    return keep, dropped


def _read_lines(path: Path) -> list[dict[str, Any]]:
    out = []
    try:
        with open(path, "rb") as f:
            for raw in f:
                try:
                    out.append(json.loads(raw))
                except ValueError:
                    continue
    except OSError:
        return []
    return out


def _read_report(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _merge(session: RunReport, logged: list[dict[str, Any]], before: list[dict[str, Any]], initial_step: int,
           previous: dict[str, Any] | None, every_steps: int) -> RunReport:
    """Totals over every logged step of the run; wall time and peak memory from the earlier sessions' reports."""
    times = sorted(m["step_time"] for m in logged) or [0.0]
    total_time = sum(times) or 1.0
    sessions = _earlier_sessions(previous, before, initial_step, every_steps)
    end = initial_step + session.steps
    if session.steps:
        sessions.append({"from_step": initial_step, "to_step": end, "wall_time_s": session.wall_time_s})
    merged = {f.name: getattr(session, f.name) for f in fields(session)}
    merged.update(
        steps=end, wall_time_s=sum(s["wall_time_s"] for s in sessions),
        samples_per_s=sum(m["samples_per_s"] * m["step_time"] for m in logged) / total_time,
        tokens_per_s=sum(m["tokens_per_s"] * m["step_time"] for m in logged) / total_time,
        step_time_p50_s=percentile(times, 0.5), step_time_p90_s=percentile(times, 0.9),
        data_wait_ratio=sum(m.get("data_time", 0.0) for m in logged) / total_time,
        first_loss=before[0]["loss"] if before[0]["step"] <= every_steps else session.first_loss,
        final_loss=session.final_loss if session.steps else logged[-1]["loss"],
        peak_memory_gb=max(session.peak_memory_gb, float((previous or {}).get("peak_memory_gb") or 0.0)),
        extra={**session.extra, "sessions": sessions},
    )
    return RunReport(**merged)


def _earlier_sessions(previous: dict[str, Any] | None, before: list[dict[str, Any]], initial_step: int,
                      every_steps: int) -> list[dict[str, Any]]:
    """The sessions that led to `initial_step`: report.json's (those that ended by then), and for steps no report
    covers (a session that was killed) an estimate from their logged step times."""
    known = [dict(s) for s in ((previous or {}).get("extra", {}).get("sessions") or []) if s["to_step"] <= initial_step]
    if not known and previous and previous.get("steps") and previous["steps"] <= initial_step and not previous.get(
            "extra", {}).get("sessions"):
        known = [{"from_step": 0, "to_step": previous["steps"], "wall_time_s": previous["wall_time_s"]}]
    covered = known[-1]["to_step"] if known else 0
    if covered < initial_step:
        gap = [m["step_time"] for m in before if covered < m["step"] <= initial_step]
        estimate = sum(gap) * every_steps if gap else 0.0
        known.append({"from_step": covered, "to_step": initial_step, "wall_time_s": estimate, "estimated": True})
    return known


# The figures the "vs the previous run" block compares: (label, RunReport field, scale, decimals). Each has one
# definition whatever the precision or packing (FIGURE_DEFINITIONS, printed under them).
HEADLINE_FIGURES = (
    ("samples/s", "samples_per_s", 1.0, 1),
    ("real tokens/s", "tokens_per_s", 1.0, 0),
    ("step time p50 (ms)", "step_time_p50_s", 1e3, 1),
    ("step time p90 (ms)", "step_time_p90_s", 1e3, 1),
    ("peak memory (GiB)", "peak_memory_gb", 1.0, 2),
    ("eval loss", "eval_loss", 1.0, 4),
)
PREVIOUS_KEYS = ("steps", "device", *(key for _, key, _, _ in HEADLINE_FIGURES), "spec")
FIGURE_DEFINITIONS = (
    "tokens: real input tokens (the attention mask's sum; packed rows without their padding), the same count at "
    "every precision, packed or not; samples: training samples (several per packed row); step time: "
    f"{STEP_TIME_DEFINITION}; peak memory: the device allocator's peak (process RSS on cpu); eval loss: "
    "loss-token-weighted mean over eval_data at the end"
)


def spec_changes(old: dict[str, Any], new: dict[str, Any], prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted name, old value, new value) of every spec field that differs (a field one side lacks: None)."""
    changes = []
    for key in sorted(set(old) | set(new), key=lambda k: (list(new).index(k) if k in new else len(new), k)):
        a, b = old.get(key), new.get(key)
        if isinstance(a, dict) and isinstance(b, dict):
            changes += spec_changes(a, b, f"{prefix}{key}.")
        elif a != b:
            changes.append((f"{prefix}{key}", a, b))
    return changes


def _show(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


@dataclass
class RunReport:
    """The end-of-run summary: time, throughput, memory, loss and what each enabled strategy changed."""

    steps: int
    wall_time_s: float
    samples_per_s: float
    tokens_per_s: float
    step_time_p50_s: float
    step_time_p90_s: float
    data_wait_ratio: float
    peak_memory_gb: float
    device: str
    first_loss: float | None
    final_loss: float | None
    skipped_steps: int = 0
    strategies: list[str] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    step_time_p99_s: float = 0.0
    eval_loss: float | None = None  # the held-out loss at the end (None: no eval_data)
    spec: dict[str, Any] | None = None  # the run's TrainSpec, as a dict
    previous: dict[str, Any] | None = None  # the previous run's figures and spec (PREVIOUS_KEYS); None: first run

    def to_text(self) -> str:
        loss = (f"loss {self.first_loss:.4f} -> {self.final_loss:.4f}" if self.final_loss is not None
                else "loss: no step run")
        lines = [
            f"vlmfast run report ({self.device})",
            f"  steps {self.steps} in {self.wall_time_s:.1f} s; {loss}",
            f"  throughput {self.samples_per_s:.1f} samples/s, {self.tokens_per_s:.0f} tokens/s",
            f"  step time p50 {self.step_time_p50_s * 1e3:.1f} ms, p90 {self.step_time_p90_s * 1e3:.1f} ms, "
            f"p99 {self.step_time_p99_s * 1e3:.1f} ms ({STEP_TIME_DEFINITION}, {self.steps} steps); "
            f"data wait (blocked on the loader) {self.data_wait_ratio:.1%} of it",
            f"  peak memory {self.peak_memory_gb:.2f} GiB" + (" (process RSS)" if self.device == "cpu" else ""),
        ]
        if self.skipped_steps:
            lines.append(f"  skipped steps (non-finite loss/gradients): {self.skipped_steps}")
        lines += [f"  {key}: {value}" for key, value in self.extra.items()]
        lines.append("  strategies:")
        lines += [f"    - {line}" for line in self.strategies]
        if self.previous is not None:
            lines += self._versus_previous(self.previous)
        return "\n".join(lines)

    def _versus_previous(self, previous: dict[str, Any]) -> list[str]:
        """What changed against the previous run in this log.dir: its spec fields, then each headline figure."""
        lines = [f"  vs the previous run ({PREVIOUS_REPORT_FILE}: {previous.get('steps')} steps on "
                 f"{previous.get('device')}; ratio = this run / previous):"]
        if previous.get("spec") is None or self.spec is None:
            lines.append("    spec: not recorded in the previous report")
        else:
            changes = spec_changes(previous["spec"], self.spec)
            lines.append("    spec: " + ("no field differs" if not changes else f"{len(changes)} field(s) differ"))
            lines += [f"      {name}: {_show(old)} -> {_show(new)}" for name, old, new in changes]
        for label, key, scale, digits in HEADLINE_FIGURES:
            old, new = previous.get(key), getattr(self, key)
            shown = [f"{value * scale:.{digits}f}" if isinstance(value, (int, float)) else "-" for value in (old, new)]
            ratio = f"{new / old:.2f}x" if isinstance(old, (int, float)) and isinstance(new, (int, float)) and old \
                else "-"
            lines.append(f"    {label:<20} {shown[0]:>10} -> {shown[1]:<10} {ratio}")
        lines += textwrap.wrap(FIGURE_DEFINITIONS, 116, initial_indent="    ", subsequent_indent="    ")
        if previous.get("device") != self.device:
            lines.append(f"    the devices differ ({previous.get('device')} -> {self.device}): peak memory is not the "
                         "same measure on both")
        return lines

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write_json(self, path: Path) -> None:
        """Write atomically (a temporary file, then a rename); a failure is a warning, never the end of the run."""
        try:  # a link at `path` is refused (UnsafeOutputError), not warned about
            write_atomic(path, json.dumps(self.to_dict(), indent=2, default=str), what="log.dir file")
        except OSError as exc:
            log.warning("cannot write %s (%s): the report is printed above only", path, exc.strerror or exc)

    @classmethod
    def from_history(
        cls, history: list[dict[str, Any]], wall_time: float, *, world_size: int, **fields: Any
    ) -> RunReport:
        """Summarise per-step metrics: throughput over all ranks, step-time percentiles, data-wait share."""
        times = [m["step_time"] for m in history]
        total_time = sum(times) or 1.0
        return cls(
            steps=len(history), wall_time_s=wall_time,
            samples_per_s=sum(_global(m, "samples", world_size) for m in history) / total_time,
            tokens_per_s=sum(_global(m, "tokens", world_size) for m in history) / total_time,
            step_time_p50_s=percentile(times, 0.5), step_time_p90_s=percentile(times, 0.9),
            step_time_p99_s=percentile(times, 0.99),
            data_wait_ratio=sum(m["data_time"] for m in history) / total_time,
            first_loss=history[0]["loss"] if history else None,
            final_loss=history[-1]["loss"] if history else None, **fields,
        )

