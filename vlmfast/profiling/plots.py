"""The step-time breakdown plot: stacked phase times of every timed step (the memory timeline is in memory/plots).

Usage: ``plot_step_breakdown(result.history, "run/step_time_breakdown.png")`` (rows without ``perf/step_time``,
i.e. steps the PhaseTimer did not sample, are skipped).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from vlmfast.common.safe_files import library_output

__all__ = ["plot_step_breakdown"]

# phase -> colour; stacked bottom-up in step order, "other" (time no phase covered) on top
PHASE_COLOURS = {
    "data_wait": "tab:red",
    "h2d": "tab:orange",
    "forward": "tab:blue",
    "backward": "tab:green",
    "optimizer": "tab:purple",
    "comm": "tab:brown",
    "other": "tab:gray",
}


def plot_step_breakdown(history: Iterable[Mapping[str, Any]], path: str | Path,
                        title: str = "Step time breakdown") -> Path:
    """Write a PNG of stacked per-phase milliseconds against the step and return its path."""
    from matplotlib.figure import Figure  # no pyplot: no global backend switch, no figure registry

    # Steps the profiler left out of its statistics (traced, FLOPs counted) ran slower: not drawn either.
    rows = [row for row in history if "perf/step_time" in row and not (row.get("perf/traced")
                                                                       or row.get("perf/excluded"))]
    if not rows:
        raise ValueError("plot_step_breakdown: no timed steps in the history (profile.timing off, or fewer steps "
                         "than profile.every_steps)")
    steps = [row["step"] for row in rows]
    fig = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    bottom = [0.0] * len(rows)
    width = 0.8 * min((b - a for a, b in itertools.pairwise(steps)), default=1)
    for phase, colour in PHASE_COLOURS.items():
        values = [1e3 * row.get(f"perf/{phase}_time", 0.0) for row in rows]
        if any(values):
            ax.bar(steps, values, width=width, bottom=bottom, color=colour, label=phase)
            bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    ax.set(title=title, xlabel="optimizer step", ylabel="time (ms)")
    ax.set_xlim(steps[0] - width, steps[-1] + width)  # the axis ends at the last timed step
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.grid(alpha=0.3, axis="y")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")  # beside the bars, never on one
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with library_output(path, what="step-time plot") as tmp:  # matplotlib writes by name: a folder of our own
        fig.savefig(tmp, format="png")
    return path
