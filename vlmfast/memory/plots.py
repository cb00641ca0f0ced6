"""The memory timeline plot: allocated / reserved / peak memory (or the process RSS on CPU) against the step.

Usage: ``plot_memory_timeline(monitor.timeline, "run/memory_timeline.png")`` (``result.history`` works too: rows
without ``mem/*`` metrics are skipped).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from vlmfast.common.safe_files import library_output

# metric -> (label, line style); the order is the drawing order: peak first, wide and pale, so a current-memory
# line that reaches the peak (as it does under a leak) stays visible on top of it
SERIES = {
    "mem/peak_gb": ("peak", {"color": "tab:red", "linewidth": 4, "alpha": 0.3}),
    "mem/reserved_gb": ("reserved (CUDA cache)", {"color": "tab:orange", "linestyle": "--", "linewidth": 1.5}),
    "mem/allocated_gb": ("allocated", {"color": "tab:blue", "linewidth": 1.5}),
    "mem/rss_gb": ("process RSS", {"color": "tab:blue", "linewidth": 1.5}),
}


def plot_memory_timeline(timeline: Iterable[Mapping[str, Any]], path: str | Path, title: str = "Memory timeline",
                         events: Sequence[tuple[int, str]] = ()) -> Path:
    """Write a PNG of memory (GiB) against the step and return its path; `events` draws labelled vertical lines."""
    # Figure without pyplot: no global backend switch (a notebook keeps its own) and no figure registry to close.
    from matplotlib.figure import Figure

    rows = [row for row in timeline if any(key in row for key in SERIES)]
    fig = Figure(figsize=(8, 4.5), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for key, (label, style) in SERIES.items():
        points = [(row["step"], row[key]) for row in rows if key in row]
        if points:
            label = "peak RSS" if key == "mem/peak_gb" and any("mem/rss_gb" in row for row in rows) else label
            ax.plot(*zip(*points, strict=True), label=label, **style)
    for index, (step, label) in enumerate(events):
        ax.axvline(step, color="tab:purple", alpha=0.6, linewidth=1, label=label if index == 0 else None)
    ax.set(title=title, xlabel="optimizer step", ylabel="memory (GiB)")
    ax.set_ylim(bottom=0)  # from zero, so a growth reads at its true proportion
    ax.grid(alpha=0.3)
    if rows or events:
        ax.legend(loc="lower right")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with library_output(path, what="memory plot") as tmp:  # matplotlib writes by name: a folder of our own
        fig.savefig(tmp, format="png")
    return path
