"""What a run tells its user: a progress bar, per-step metrics (JSONL, TensorBoard) and an end-of-run report.

Only rank 0 writes. Usage::

    with MetricsLogger(spec.log, total_steps=spec.max_steps) as metrics:
        metrics.log_step({"step": 1, "loss": 2.3, ...})
"""

from __future__ import annotations

import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from vlmfast.profiling.phase_timer import percentile
from vlmfast.spec import LogSpec
from vlmfast.tracking import open_trackers

# The one definition of "step time" the report prints (the profiler's phase split uses its timed steps only).
STEP_TIME_DEFINITION = "wall clock from one optimizer step's end to the next's, data wait included"


class MetricsLogger:
    """Writes per-step metrics to metrics.jsonl / TensorBoard and drives the progress bar."""

    def __init__(self, spec: LogSpec, total_steps: int, initial_step: int = 0, enabled: bool = True,
                 config: dict[str, Any] | None = None) -> None:
        self.spec = spec
        self.enabled = enabled
        self._jsonl = None
        self._tensorboard = None
        # W&B / MLflow get the records metrics.jsonl gets; `config` (the spec) is their run's parameters.
        self._trackers = open_trackers(spec, config) if enabled else []
        if enabled and spec.dir is not None:
            Path(spec.dir).mkdir(parents=True, exist_ok=True)
            self._jsonl = open(Path(spec.dir) / "metrics.jsonl", "a")  # noqa: SIM115 - closed in close()
            if spec.tensorboard:
                from torch.utils.tensorboard import SummaryWriter

                self._tensorboard = SummaryWriter(log_dir=str(spec.dir))
        show = {"on": True, "off": False, "auto": sys.stderr.isatty()}[spec.progress]
        self._bar = tqdm(total=total_steps, initial=initial_step, unit="step", dynamic_ncols=True,
                         disable=not (enabled and show))

    def log_step(self, metrics: dict[str, Any]) -> None:
        """Record one optimizer step (written every `log.every_steps`; the bar moves every step)."""
        if not self.enabled:
            return
        self._bar.update(1)
        step = metrics["step"]
        if step % self.spec.every_steps:
            return
        if not self._bar.disable:
            self._bar.set_postfix(loss=f"{metrics['loss']:.4f}", samples_s=f"{metrics['samples_per_s']:.1f}",
                                  tokens_s=f"{metrics['tokens_per_s']:.0f}", refresh=False)
        if self._jsonl is not None:
            self._jsonl.write(json.dumps(metrics) + "\n")
            self._jsonl.flush()
        if self._tensorboard is not None:
            for key, value in metrics.items():
                if key != "step" and isinstance(value, (int, float)):
                    self._tensorboard.add_scalar(key if "/" in key else f"train/{key}", value, step)
        for tracker in self._trackers:
            tracker.log(metrics, step)

    def write(self, message: str) -> None:
        """Print a line without breaking the progress bar."""
        if self.enabled:
            self._bar.write(message, file=sys.stderr)

    def close(self) -> None:
        self._bar.close()
        if self._jsonl is not None:
            self._jsonl.close()
        if self._tensorboard is not None:
            self._tensorboard.close()
        for tracker in self._trackers:
            tracker.close()
        self._trackers = []

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def write_json(self, path: Path) -> None:
        path.write_text(json.dumps(self.to_dict(), indent=2))

    @classmethod
    def from_history(
        cls, history: list[dict[str, Any]], wall_time: float, *, world_size: int, **fields: Any
    ) -> RunReport:
        """Summarise per-step metrics: throughput over all ranks, step-time percentiles, data-wait share."""
        times = [m["step_time"] for m in history]
        total_time = sum(times) or 1.0
        return cls(
            steps=len(history), wall_time_s=wall_time,
            samples_per_s=sum(m["samples"] for m in history) * world_size / total_time,
            tokens_per_s=sum(m["tokens"] for m in history) * world_size / total_time,
            step_time_p50_s=percentile(times, 0.5), step_time_p90_s=percentile(times, 0.9),
            step_time_p99_s=percentile(times, 0.99),
            data_wait_ratio=sum(m["data_time"] for m in history) / total_time,
            first_loss=history[0]["loss"] if history else None,
            final_loss=history[-1]["loss"] if history else None, **fields,
        )

