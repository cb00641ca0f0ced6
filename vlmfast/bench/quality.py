"""Quality-adjusted throughput: a row is called faster only when it trains as well as the row it is compared with.

Every row's eval loss (the same held-out samples, fp32, after the same number of samples) is its quality. Its
**spread** is max - min over the interleaved rounds. Two rows have the **same quality** when their median eval
losses differ by no more than the **noise**: the larger of the two spreads, and never less than
:data:`QUALITY_TOLERANCE` of the reference's loss (rows that see the same batches end at the same loss every round,
so a spread of 0 says nothing about how much two training orders can differ). Otherwise the row is **better** or
**worse** by the difference, in percent of the reference's loss. A row's **quality-adjusted** samples/s (and x start)
is its samples/s where its quality is the same as the starting point's or better, and none otherwise: speed bought
by training worse is not called faster.

Pure functions of the result dicts, so an old ``compare.json`` (no spread stored: it is computed from its ``runs``,
or taken as 0 where those are missing) renders the same way.

Usage::

    verdict = quality_verdict(1.12, 0.004, 1.05, 0.002)      # {"verdict": "worse", "delta": 0.0667, ...}
    table = quality_table(result)                             # per row vs the starting point
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = ["QUALITY_TOLERANCE", "eval_loss_spread", "pair_verdict", "quality_table", "quality_text", "quality_verdict"]

# The relative floor of the noise: eval losses of runs that differ only in their batch order (random orders of the
# cpu size) agreed within 1 %; length grouping's short-run effect (+5-7 %) is well outside it.
QUALITY_TOLERANCE = 0.01
START = "start"  # vlmfast.bench.configs.START (not imported: this module stays free of the runners' imports)


def eval_loss_spread(result: Mapping[str, Any], name: str) -> tuple[float, float] | None:
    """(min, max) of a row's eval loss over its rounds: from the summary when stored, else from the runs, else
    None (an old result without either)."""
    row = result.get("summary", {}).get(name, {})
    if row.get("eval_loss_min") is not None and row.get("eval_loss_max") is not None:
        return row["eval_loss_min"], row["eval_loss_max"]
    losses = [run["eval_loss"] for run in result.get("runs", {}).get(name, []) if run.get("eval_loss") is not None]
    return (min(losses), max(losses)) if losses else None


def quality_verdict(loss: float, spread: float, reference: float, reference_spread: float,
                    tolerance: float = QUALITY_TOLERANCE) -> dict[str, Any]:
    """One row's eval loss against a reference row's: ``verdict`` (same | better | worse), ``delta`` (relative
    difference, positive = higher loss) and ``noise`` (relative: the larger spread, at least `tolerance`)."""
    noise = max(spread, reference_spread, tolerance * abs(reference))
    difference = loss - reference
    verdict = "same" if abs(difference) <= noise else ("worse" if difference > 0 else "better")
    scale = abs(reference) or 1.0
    return {"verdict": verdict, "delta": difference / scale, "noise": noise / scale}


def _row_verdict(result: Mapping[str, Any], name: str, reference: str) -> dict[str, Any] | None:
    summary = result.get("summary", {})
    mine, theirs = summary.get(name, {}).get("eval_loss"), summary.get(reference, {}).get("eval_loss")
    if mine is None or theirs is None:
        return None
    return quality_verdict(mine, _width(eval_loss_spread(result, name)), theirs,
                           _width(eval_loss_spread(result, reference)))


def _width(spread: tuple[float, float] | None) -> float:
    return spread[1] - spread[0] if spread is not None else 0.0


def quality_table(result: Mapping[str, Any], reference: str = START) -> dict[str, dict[str, Any]]:
    """Per row with an eval loss: its verdict against `reference` plus ``credited`` (same or better),
    ``adjusted_samples_per_s`` and ``adjusted_vs_start`` (the row's figures where credited, else None)."""
    table = {}
    ratios = result.get("ratios", {})
    for name, row in result.get("summary", {}).items():
        verdict = _row_verdict(result, name, reference)
        if verdict is None:
            continue
        credited = verdict["verdict"] != "worse"
        table[name] = {**verdict, "credited": credited,
                       "adjusted_samples_per_s": row.get("samples_per_s") if credited else None,
                       "adjusted_vs_start": ratios.get(name, {}).get(f"vs_{reference}") if credited else None}
    return table


def pair_verdict(result: Mapping[str, Any], name: str, other: str) -> dict[str, Any] | None:
    """`name`'s quality against `other`'s (for targets that compare two rows' throughput), or None if unknown."""
    return _row_verdict(result, name, other)


def quality_text(verdict: Mapping[str, Any]) -> str:
    """``same (+0.3 %)``, ``worse: eval loss +6.1 %`` or ``better: eval loss -2.0 %`` (noise +-1.0 %)."""
    delta, noise = 100 * verdict["delta"], 100 * verdict["noise"]
    if verdict["verdict"] == "same":
        return f"same ({delta:+.1f} %, noise ±{noise:.1f} %)"
    return f"{verdict['verdict']}: eval loss {delta:+.1f} % (noise ±{noise:.1f} %)"
