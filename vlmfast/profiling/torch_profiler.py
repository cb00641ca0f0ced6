"""torch.profiler around optimizer steps K..K+n of a real run: Chrome trace, TensorBoard, memory, top operators.

Usage::

    profiler = StepProfiler(TraceSpec(enabled=True, start_step=10, active_steps=3), device, log_dir="runs/a")
    for step in range(1, steps + 1):
        profiler.begin_step(step)     # starts the profiler warmup_steps before start_step
        train_step()
        profiler.end_step()           # advances torch.profiler's schedule; writes the trace when done
    profiler.close()
    profiler.trace_files, profiler.top_ops   # written paths; operators ranked by self time

From the command line (one command): ``vlmfast train run.yaml --set profile.trace.enabled=true --set
profile.trace.start_step=50``. Open trace_steps_*.json in chrome://tracing or https://ui.perfetto.dev, or the
TensorBoard files with ``tensorboard --logdir DIR`` (torch-tb-profiler plugin). The profiler starts by absolute step
number, so a resumed run profiles the same steps. For Nsight Systems use ``profile.nvtx: true`` instead (phase
ranges from :class:`~vlmfast.profiling.phase_timer.PhaseTimer`) and ``nsys profile -t cuda,nvtx``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import time
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from vlmfast.common.safe_files import ensure_dir, library_output, open_for_writing, write_atomic
from vlmfast.common.utils import quiet_profiler_log
from vlmfast.spec import TraceSpec

__all__ = ["StepProfiler", "nvtx_range", "top_operators"]

# Operator names whose share of device time suggests attention is the bottleneck (math SDPA, eager softmax path).
ATTENTION_OPS = ("attention", "softmax", "_efficient_attention", "flash")


def nvtx_range(name: str, enabled: bool = True) -> contextlib.AbstractContextManager[Any]:
    """An NVTX range for Nsight Systems on CUDA; a no-op elsewhere or when disabled."""
    if enabled and torch.cuda.is_available():
        return torch.cuda.nvtx.range(name)
    return contextlib.nullcontext()


def top_operators(prof: profile, limit: int = 15) -> list[dict[str, Any]]:
    """Operators ranked by self time on the device (CUDA) or CPU: name, calls, milliseconds, share."""
    events = prof.key_averages()
    use_device = any(getattr(e, "self_device_time_total", 0) > 0 for e in events)
    attr = "self_device_time_total" if use_device else "self_cpu_time_total"
    # ProfilerStep#N spans whole steps on the CPU timeline: not an operator.
    rows = [(e.key, e.count, getattr(e, attr)) for e in events if not e.key.startswith("ProfilerStep")]
    total = sum(us for _, _, us in rows) or 1.0
    rows.sort(key=lambda row: row[2], reverse=True)
    return [{"name": name, "calls": calls, "ms": us / 1e3, "share": us / total, "clock": "device" if use_device
             else "cpu"} for name, calls, us in rows[:limit]]


class StepProfiler:
    """torch.profiler for a window of optimizer steps (see the module docstring); a no-op when disabled."""

    def __init__(self, spec: TraceSpec, device: torch.device | str, log_dir: str | Path | None = None) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.dir = Path(spec.dir or (Path(log_dir) / "profiler" if log_dir else "profiler"))
        self.trace_files: list[Path] = []
        self.top_ops: list[dict[str, Any]] = []
        self._profiler: profile | None = None
        self._first_step = spec.start_step - spec.warmup_steps
        self._finished = False

    @property
    def active(self) -> bool:
        return self._profiler is not None

    def begin_step(self, step: int) -> None:
        """Start the profiler when `step` (1-based optimizer step) is the first warm-up step of the window."""
        if not self.spec.enabled or self._finished or self._profiler is not None:
            return
        if self._first_step <= step < self.spec.start_step + self.spec.active_steps:
            warmup = max(self.spec.start_step - step, 0)
            active = self.spec.start_step + self.spec.active_steps - max(step, self.spec.start_step)
            self._start(warmup, active)

    def end_step(self) -> None:
        """Advance the schedule; the trace is written when the last active step ends."""
        if self._profiler is not None:
            self._profiler.step()
            if self._finished:  # window done: stop recording now, not at the end of the run
                self._profiler.stop()
                self._profiler = None

    def close(self) -> list[Path]:
        """Stop (writing a trace if the run ended inside the window) and return the trace files."""
        if self._profiler is not None:
            self._profiler.stop()
            self._profiler = None
        return self.trace_files

    def _start(self, warmup: int, active: int) -> None:
        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
        if self.spec.dir:  # the user's folder (it may be a link they made)
            self.dir.mkdir(parents=True, exist_ok=True)
        else:  # log.dir/profiler: ours, so never a link
            ensure_dir(self.dir, "profiler folder")
        self._window = (self.spec.start_step, self.spec.start_step + self.spec.active_steps - 1)
        quiet_profiler_log()  # no "USDT: ... profiler_start" lines on the user's terminal
        self._profiler = profile(
            activities=activities,
            schedule=schedule(wait=0, warmup=warmup, active=active, repeat=1),
            on_trace_ready=self._on_trace_ready,
            record_shapes=self.spec.record_shapes,
            profile_memory=self.spec.profile_memory,
            with_stack=self.spec.with_stack,
        )
        self._profiler.start()

    def _on_trace_ready(self, prof: profile) -> None:
        # A trace can be exported once: write it under one name and copy it for the other format.
        first, last = self._window
        names = []
        if self.spec.format in ("chrome", "both"):
            names.append(f"trace_steps_{first}-{last}.json")
        if self.spec.format in ("tensorboard", "both"):  # the layout tensorboard_trace_handler uses
            names.append(f"{socket.gethostname()}_{os.getpid()}.{time.time_ns()}.pt.trace.json")
        paths = [self.dir / name for name in names]
        with library_output(paths[0], what="profiler trace") as tmp:  # torch writes by name: a folder of our own
            prof.export_chrome_trace(str(tmp))
        for path in paths[1:]:
            with open(paths[0], "rb") as src, open_for_writing(path, "wb", what="profiler trace") as dst:
                shutil.copyfileobj(src, dst)
        self.trace_files += paths
        self.top_ops = top_operators(prof)
        write_atomic(self.dir / f"top_ops_steps_{first}-{last}.json", json.dumps(self.top_ops, indent=2),
                     what="profiler summary")
        self._finished = True
