"""The `profile` section in one object: phase timer + FLOPs/MFU + torch.profiler window + end-of-run plot.

Usage (what the trainer does; a hand-written loop can do the same)::

    profiler = RunProfiler(spec.profile, model, device, precision="bf16", log_dir="runs/a")
    profiler.begin_step(step)
    with profiler.phase("data_wait"):
        batch = next(loader)
    for micro_batch in micro_batches:              # host tensors
        with profiler.phase("h2d"):
            on_device = move_to_device(micro_batch, device)
        with profiler.count_flops(micro_batch):    # FlopCounterMode once per shape bucket
            with profiler.phase("forward"):
                loss = model(**on_device).loss
            with profiler.phase("backward"):
                loss.backward()
        profiler.add_flops(micro_batch)
    with profiler.phase("optimizer"):
        optimizer.step()
    metrics.update(profiler.end_step())            # perf/* on timed steps
    report_extra = profiler.finish(history)        # summary dict; writes step_time_breakdown.png
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlmfast.common.safe_files import UnsafeOutputError, write_atomic
from vlmfast.profiling.flops import FlopsMeter, peak_tflops
from vlmfast.profiling.phase_timer import Parts, PhaseTimer
from vlmfast.profiling.torch_profiler import StepProfiler
from vlmfast.spec import ProfileSpec

__all__ = ["EXCLUDED", "RunProfiler", "report_lines"]

EXCLUDED = "perf/excluded"  # a timed step left out of the statistics (traced, or FLOPs counted): its times are off

log = logging.getLogger(__name__)


class RunProfiler:
    """Everything `spec.profile` turns on, behind the trainer's few calls (see the module docstring)."""

    def __init__(self, spec: ProfileSpec, model: nn.Module, device: torch.device | str, precision: str = "fp32",
                 tf32: bool = False, log_dir: str | Path | None = None, is_main_process: bool = True,
                 keep_steps: int = 10_000, parts: Parts | None = None) -> None:
        self.spec = spec
        self.device = torch.device(device)
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.is_main_process = is_main_process
        self.peak_tflops = peak_tflops(self.device, precision, tf32, override=spec.peak_tflops) if spec.mfu else None
        self.timer = PhaseTimer(self.device, spec.every_steps, spec.warmup_steps, self.peak_tflops, nvtx=spec.nvtx,
                                keep_steps=keep_steps)
        # The vision / projector / language model split: `parts` learned by the caller (the trainer, on the plain model
        # before the engine shards it), else here by the stand-in get_image_features call (nothing computed)
        self.timer.attach(model, parts=parts)
        self.flops = FlopsMeter(model, spec.flops, parts=self.timer.parts) if spec.mfu else None
        self.trace = StepProfiler(spec.trace, self.device, log_dir)
        self.enabled = spec.timing
        self._traced = False
        self._counted = False  # this step ran (part of) its forward/backward under FlopCounterMode
        self.summary: dict[str, Any] = {}

    def begin_step(self, step: int) -> None:
        """Before the batch is fetched; `step` is the 1-based optimizer step about to run."""
        self.trace.begin_step(step)
        self._traced = self.trace.active  # torch.profiler slows this step: it stays out of the statistics
        if self.enabled:
            self.timer.begin_step(step)

    def phase(self, name: str) -> contextlib.AbstractContextManager[Any]:
        return self.timer.phase(name) if self.enabled else contextlib.nullcontext()

    def count_flops(self, host_micro_batch: Any) -> contextlib.AbstractContextManager[Any]:
        """Wrap one micro-batch's forward + backward. The formula (`analytic`, what `auto` picks where it can) costs
        nothing; `measured` runs the first micro-batch under FlopCounterMode (~6x its cost; step 1, which the
        timer skips as warm-up; a timed step that counts is left out of the timings) and scales other shapes."""
        if self.flops is None:
            return contextlib.nullcontext()
        if self.flops.will_measure(host_micro_batch):  # once, on the first micro-batch (a warm-up step by default)
            self._counted = self._counted or self.timer.sampling
        return self.flops.count(host_micro_batch)

    def add_flops(self, host_micro_batch: Any) -> None:
        """After the micro-batch's backward: add its model FLOPs to this step (only read on timed steps)."""
        if self.flops is not None and self.timer.sampling:
            self.timer.add_flops(self.flops.flops(host_micro_batch))

    def end_step(self) -> dict[str, float]:
        """perf/* metrics on timed steps, {} otherwise."""
        self.trace.end_step()
        if not self.enabled:
            return {}
        metrics = self.timer.end_step()
        if self._traced or self._counted:  # slowed by torch.profiler / FlopCounterMode: out of the statistics
            self.timer.discard_last()
            flag = "perf/traced" if self._traced else "perf/flops_counted"
            metrics = {flag: 1.0, EXCLUDED: 1.0, **metrics} if metrics else {}
        self._counted = False
        return metrics

    def finish(self, history: Sequence[Mapping[str, Any]] = ()) -> dict[str, str]:
        """Close the trace window, write the breakdown plot and profile_summary.json; return report lines.

        The full figures (perf/step_time_p50 ..., perf/*_share, perf/tflops, perf/mfu) are in :attr:`summary`."""
        traces = self.trace.close()
        summary: dict[str, Any] = dict(self.timer.summary()) if self.enabled else {}
        if self.peak_tflops is not None:
            summary["perf/peak_tflops"] = self.peak_tflops
        if traces:
            summary["profiler_traces"] = [str(path) for path in traces]
        if self.spec.plots and self.log_dir is not None and self.is_main_process and self.enabled:
            try:
                from vlmfast.profiling.plots import plot_step_breakdown

                summary["step_time_plot"] = str(plot_step_breakdown(history, self.log_dir / "step_time_breakdown.png"))
            except UnsafeOutputError:  # a link planted at the plot's name: refused, not a missing plot
                raise
            except ValueError as exc:  # no timed step (a very short run): no plot, and say why
                log.info("%s", exc)
            except OSError as exc:  # a full log disk: a warning, never the end of a run
                log.warning("cannot write the step-time plot to %s (%s)", self.log_dir, exc.strerror or exc)
        if self.log_dir is not None and self.is_main_process and summary:
            try:
                self.log_dir.mkdir(parents=True, exist_ok=True)
                write_atomic(self.log_dir / "profile_summary.json", json.dumps(summary, indent=2), what="log.dir file")
            except OSError as exc:
                log.warning("cannot write profile_summary.json to %s (%s)", self.log_dir, exc.strerror or exc)
        self.summary = summary
        return report_lines(summary)

    def close(self) -> None:
        """Remove the sub-model hooks and stop a running trace."""
        self.trace.close()
        self.timer.detach()


def report_lines(summary: Mapping[str, Any]) -> dict[str, str]:
    """The profile summary as a few readable report lines (RunReport.extra)."""
    # No step-time percentiles here: the report prints one step time, over every step (reporting.py); the
    # profiler's own (timed steps only, perf/step_time_p* in profile_summary.json) would be a second figure.
    lines: dict[str, str] = {}
    phases = [(name, summary.get(f"perf/{name}_share", 0.0)) for name in
              ("data_wait", "h2d", "forward", "backward", "optimizer", "comm", "other")]
    if any(share for _, share in phases):
        parts = [f"{name} {share:.0%}" for name, share in phases if share >= 0.005]
        towers = [f"{name} {summary[f'perf/{name}_forward_share']:.0%}" for name in
                  ("vision", "projector", "language_model") if f"perf/{name}_forward_share" in summary]
        timed = int(summary.get("perf/sampled_steps", 0))
        lines["time split"] = f"{timed} timed step{'s' * (timed != 1)}: " + ", ".join(parts) + (
            f" (forward: {', '.join(towers)})" if towers else "")
    if "perf/tflops" in summary:  # model FLOPs of the timed steps over their time
        mfu = summary.get("perf/mfu")
        peak = summary.get("perf/peak_tflops")
        lines["compute"] = f"{summary['perf/tflops']:.3g} TFLOP/s" + (
            f", MFU {mfu:.1%} of {peak:g} TFLOP/s peak" if mfu is not None else " (MFU: no peak known for this device; "
            "set profile.peak_tflops)")
    if "profiler_traces" in summary:
        lines["profiler trace"] = str(summary["profiler_traces"][0])
    return lines
