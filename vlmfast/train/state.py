"""What a run counts and what `fit` returns.

Usage::

    trainer.state.step, trainer.state.micro_batch_size, trainer.state.accumulation_steps
    result = trainer.fit(); result.history[-1]["loss"]
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from vlmfast.reporting.report import RunReport


@dataclass
class TrainState:
    """Counters a checkpoint restores (`step` counts optimizer steps), and how the last step was split.

    `micro_batch_size` and `accumulation_steps` describe the last step; the size itself is owned by the loop's
    micro-batch sizer (the OOM fallback may change it), so checkpoints store it there, once.
    """

    step: int = 0
    samples_seen: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    micro_batch_size: int = 0
    accumulation_steps: int = 1

    def state_dict(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k not in ("micro_batch_size", "accumulation_steps")}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        known = {f.name for f in fields(self)} - {"micro_batch_size", "accumulation_steps"}
        for key in known & state.keys():  # checkpoints of older versions carry more keys
            setattr(self, key, state[key])


@dataclass
class FitResult:
    """What `fit` returns: per-step metrics of this run, the report, and how it ended."""

    history: list[dict[str, Any]]
    report: RunReport | None = None
    interrupted: str | None = None  # the signal name when SIGTERM/SIGINT ended the run
    checkpoint: Path | None = None
    exported: Path | None = None  # where save.export.dir's export was written (rank 0; None when not exported)
    eval_loss: float | None = None
    resumed_from: Path | None = None
    eval_history: list[dict[str, Any]] = field(default_factory=list)
