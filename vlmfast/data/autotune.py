"""`num_workers: auto`: time a few batches at candidate worker counts and keep the fewest that keep up.

Each candidate gets an equal share of the time budget. The first batch of a candidate pays for worker start-up and
is timed apart; the rate is the mean time per batch after it. Counts are bounded by the CPUs this process may use
and by the memory a worker may need. The choice:

- 0 workers when a batch loads in under `negligible_s` in the training process (workers would only add overhead);
- with the step's time known (`step_s`: the trainer estimates it before any worker starts), the fewest workers whose
  rate is at least `margin` x the step rate: the step never waits, and every worker more would only compete with
  the training process for CPU and memory (16 workers on an H200 host where 4 kept up: issue 33). Candidates are
  measured in increasing order and the search stops at the first that keeps up, so no more are ever started;
- otherwise (step time unknown, or no count keeps up) the smallest worker count within `tolerance` of the best
  worker rate. Even one worker beats loading in the training process at the same rate, because it loads while the
  step computes.

Usage::

    choice = autotune_num_workers(lambda n: DataLoader(dataset, batch_size=16, num_workers=n), budget_s=10)
    choice = autotune_num_workers(make_loader, budget_s=10, step_s=0.150)   # the fewest that keep up with 150 ms
    choice.num_workers, choice.reason, choice.table      # also logged
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import psutil

log = logging.getLogger(__name__)

MIN_WORKER_BYTES = 256 * 2**20  # a Python worker with torch imported holds at least this much of its own


@dataclass
class WorkerTiming:
    """One candidate's measurement: start-up (first batch) and the steady per-batch time after it."""

    num_workers: int
    batches: int
    first_batch_s: float
    seconds_per_batch: float | None  # None: no batch after the first fitted in the candidate's share of the budget

    @property
    def batches_per_s(self) -> float:
        return 0.0 if not self.seconds_per_batch else 1.0 / self.seconds_per_batch


@dataclass
class AutotuneResult:
    """The chosen worker count, why, and the measurement table."""

    num_workers: int
    reason: str
    table: list[WorkerTiming] = field(default_factory=list)
    max_workers: int = 0
    bound_by: str = ""
    step_s: float | None = None  # the step time the choice kept up with (None: not known)

    def as_dict(self) -> dict[str, Any]:
        return {"num_workers": self.num_workers, "reason": self.reason, "max_workers": self.max_workers,
                "bound_by": self.bound_by, "step_s": self.step_s,
                "table": [vars(t) | {"batches_per_s": t.batches_per_s} for t in self.table]}


def max_worker_count(limit: int | None = None) -> tuple[int, str]:
    """The most workers worth trying: usable CPUs, lowered so that each worker fits in half the free memory."""
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    per_worker = max(psutil.Process().memory_info().rss // 4, MIN_WORKER_BYTES)  # forked: most pages are shared
    by_memory = max(1, int(psutil.virtual_memory().available * 0.5 // per_worker))
    bounds = {"cpu count": cpus, "memory": by_memory}
    if limit is not None:
        bounds["autotune_max_workers"] = limit
    name = min(bounds, key=bounds.__getitem__)
    return bounds[name], name


def candidate_counts(max_workers: int) -> list[int]:
    """0, 1, 2, 4, ... up to `max_workers`, which is always included."""
    counts, n = [0], 1
    while n < max_workers:
        counts.append(n)
        n *= 2
    return [*counts, max_workers] if max_workers > 0 else counts


def time_batches(batches: Iterable[Any], budget_s: float, max_batches: int = 50) -> tuple[int, float, float | None]:
    """(batches read, first-batch seconds, mean seconds per later batch) within `budget_s`.

    A mean over the window, not a median of gaps: with several workers, batches arrive in bursts (gaps alternate
    between ~0 and a full batch time), and only the mean is the rate the training step sees.
    """
    start = time.perf_counter()
    stamps = [start]
    for index, _ in enumerate(batches):
        stamps.append(time.perf_counter())
        if index + 1 >= max_batches or stamps[-1] - start >= budget_s:
            break
    if len(stamps) < 3:
        return len(stamps) - 1, stamps[1] - start if len(stamps) > 1 else float("inf"), None
    return len(stamps) - 1, stamps[1] - start, (stamps[-1] - stamps[1]) / (len(stamps) - 2)


def autotune_num_workers(
    make_loader: Callable[[int], Iterable[Any]],
    budget_s: float = 10.0,
    max_workers: int | None = None,
    tolerance: float = 0.1,
    negligible_s: float = 0.001,
    step_s: float | None = None,
    margin: float = 1.5,
) -> AutotuneResult:
    """Measure `make_loader(n)` for candidate worker counts n and choose (see the module docstring)."""
    limit, bound_by = max_worker_count(max_workers)
    candidates = candidate_counts(limit)
    share = budget_s / len(candidates)
    table: list[WorkerTiming] = []
    for count in candidates:
        loader = make_loader(count)
        iterator = iter(loader)
        try:
            batches, first, per_batch = time_batches(iterator, share)
        finally:
            _shutdown(iterator)
        table.append(WorkerTiming(count, batches, first, per_batch))
        if step_s and count > 0 and _keeps_up(table[-1], step_s, margin):
            break  # the fewest that keep up: more would only be forked to compete with the step
    result = _choose_for_step(table, step_s, margin, negligible_s) if step_s else None
    result = result or _choose(table, tolerance, negligible_s)
    result.max_workers, result.bound_by, result.step_s = limit, bound_by, step_s
    log.info("num_workers auto: %s\n%s", result.reason, format_table(table))
    return result


def _keeps_up(timing: WorkerTiming, step_s: float, margin: float) -> bool:
    return timing.seconds_per_batch is not None and timing.batches_per_s >= margin / step_s


def _choose_for_step(table: list[WorkerTiming], step_s: float, margin: float,
                     negligible_s: float) -> AutotuneResult | None:
    """The fewest workers keeping up with `step_s` (with `margin`); None when none does (the caller falls back)."""
    in_process = table[0]
    if in_process.seconds_per_batch is not None and in_process.seconds_per_batch <= negligible_s:
        return None  # the negligible rule's 0 workers
    keeping_up = [t for t in table[1:] if _keeps_up(t, step_s, margin)]
    if not keeping_up:
        return None
    chosen = min(keeping_up, key=lambda t: t.num_workers)
    return AutotuneResult(
        chosen.num_workers, f"picked {chosen.num_workers} workers, the fewest that load {chosen.batches_per_s:.1f} "
        f"batches/s, at least {margin:g}x the step's {1 / step_s:.1f} steps/s ({step_s * 1e3:.0f} ms per step, "
        f"estimated before training); batches/s by workers: {_rates(table)}", table)


def _rates(table: list[WorkerTiming]) -> str:
    return ", ".join(f"{t.num_workers}: {t.batches_per_s:.1f}" for t in table if t.seconds_per_batch)


def _choose(table: list[WorkerTiming], tolerance: float, negligible_s: float) -> AutotuneResult:
    in_process = table[0]  # num_workers=0: every batch's loading time is added to the training step
    if in_process.seconds_per_batch is not None and in_process.seconds_per_batch <= negligible_s:
        return AutotuneResult(0, f"picked 0 workers: a batch loads in {in_process.seconds_per_batch * 1e3:.2f} ms in "
                              "the training process, too little for worker processes to pay off", table)
    measured = [t for t in table[1:] if t.seconds_per_batch]
    if not measured:
        return AutotuneResult(0, "no worker count read two batches within the budget: kept num_workers=0 "
                              "(raise data.autotune_budget_s)", table)
    # Any worker count beats 0 when loading is not negligible: workers load while the step computes.
    best = max(measured, key=lambda t: t.batches_per_s)
    chosen = min((t for t in measured if t.batches_per_s >= (1 - tolerance) * best.batches_per_s),
                 key=lambda t: t.num_workers)
    rates = _rates(table)
    why = "the fastest" if chosen is best else f"the fewest within {tolerance:.0%} of the fastest ({best.num_workers})"
    cost = f"{in_process.seconds_per_batch * 1e3:.1f} ms" if in_process.seconds_per_batch else "too long to measure"
    return AutotuneResult(chosen.num_workers, f"picked {chosen.num_workers} workers, {why}; in the training process a "
                          f"batch would cost {cost} of every step; batches/s by workers: {rates}", table)


def format_table(table: list[WorkerTiming]) -> str:
    lines = ["  workers  batches  first batch s  s/batch  batches/s"]
    for t in table:
        per = f"{t.seconds_per_batch:.4f}" if t.seconds_per_batch else "-"
        lines.append(f"  {t.num_workers:7d}  {t.batches:7d}  {t.first_batch_s:13.3f}  {per:>7}  {t.batches_per_s:9.1f}")
    return "\n".join(lines)


def _shutdown(iterator: Any) -> None:
    """Stop a DataLoader iterator's workers now rather than at garbage collection."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
