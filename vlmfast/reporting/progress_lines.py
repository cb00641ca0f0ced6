"""Plain progress lines for a run whose output is not a terminal (``log.progress: lines``, what ``auto`` picks then).

A progress bar redraws one line with carriage returns, so in a log file (``vlmfast train ... > train.log 2>&1``,
``nohup``, a cluster job) it is off, and without these lines nothing would be written until the run ends. Like the
Hugging Face Trainer's and Lightning's logging, one line every ``log.lines_every_steps`` optimizer steps or
``log.lines_every_s`` seconds, whichever comes first (and at the first and the last step), flushed at once::

    step 50/600 (8%) | loss 2.3817 | 41.2 samples/s | 2350 tokens/s | 1.2 s/step | ETA 10m58s

The rates are those of the steps since the previous line (what the run does now, not since its start); the ETA is
the remaining steps at that pace. ``log.every_steps`` (how often metrics.jsonl is written) is a separate setting.

Usage::

    lines = ProgressLines(spec.log, total_steps=600)
    lines.step(metrics)          # every step; prints only when a line is due
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import Any, TextIO

__all__ = ["ProgressLines", "format_duration"]


def format_duration(seconds: float) -> str:
    """``7s``, ``3m05s``, ``2h04m``: short and fixed-order, for an ETA."""
    seconds = max(0, round(seconds))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


class ProgressLines:
    """One plain line every N steps or T seconds, whichever comes first (see the module docstring)."""

    def __init__(self, every_steps: int, every_s: float, total_steps: int, stream: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.every_steps, self.every_s, self.total_steps = every_steps, every_s, total_steps
        self.stream = stream
        self._clock = clock
        self._last_line_at = clock()
        self._lines = 0  # written so far: the session's first step always gets one (the run started, compiled, ...)
        self._pending = {"steps": 0, "time": 0.0, "samples": 0.0, "tokens": 0.0}  # since the previous line

    def step(self, metrics: dict[str, Any]) -> str | None:
        """Account one optimizer step's metrics; print and return the line when one is due."""
        pending = self._pending
        step_time = float(metrics.get("step_time", 0.0))
        pending["steps"] += 1
        pending["time"] += step_time
        pending["samples"] += float(metrics.get("samples_per_s", 0.0)) * step_time  # every rank's samples
        pending["tokens"] += float(metrics.get("tokens_per_s", 0.0)) * step_time
        step, now = int(metrics["step"]), self._clock()
        due = (not self._lines or step % self.every_steps == 0 or step >= self.total_steps
               or now - self._last_line_at >= self.every_s)
        if not due:
            return None
        line = self._line(step, float(metrics["loss"]))
        stream = self.stream or sys.stderr
        print(line, file=stream, flush=True)
        self._last_line_at, self._lines = now, self._lines + 1
        self._pending = {"steps": 0, "time": 0.0, "samples": 0.0, "tokens": 0.0}
        return line

    def _line(self, step: int, loss: float) -> str:
        pending = self._pending
        seconds = max(pending["time"], 1e-9)
        per_step = seconds / pending["steps"]
        share = f" ({step / self.total_steps:.0%})" if self.total_steps else ""
        eta = format_duration(per_step * (self.total_steps - step))
        return (f"step {step}/{self.total_steps}{share} | loss {loss:.4f} | {pending['samples'] / seconds:.1f} "
                f"samples/s | {pending['tokens'] / seconds:.0f} tokens/s | {per_step:.2f} s/step | ETA {eta}")
