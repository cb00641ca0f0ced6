"""Interleaved, repeated runs of every configuration; per-run figures, medians and paired ratios.

Round r runs every configuration once, in order on even rounds and reversed on odd ones, so slow drift of the
machine (thermal, other jobs) hits all configurations alike. A run's first ``warmup`` steps are dropped (compilation,
allocator and worker start-up); its figures come from the timed steps: samples/s and real tokens/s over their
total time, step-time p50/p90, achieved TFLOP/s of the real tokens' model FLOPs, MFU against the device's bf16 dense
peak (none known on CPU). A configuration's figure is the median over rounds; ratios are paired (this round's run
against this round's starting point), then the median is taken. Quality: each row's eval loss (median, min, max
over rounds) against the starting point's (:mod:`vlmfast.bench.quality`); a row that trains worse beyond the noise
gets no quality-adjusted throughput, and a throughput target does not count it as ahead.

Usage::

    result = run_comparison(workload, build_configs("cpu"), repeats=5, device=torch.device("cpu"))
    result["summary"]["vlmfast-best"]["samples_per_s"], result["ratios"]["vlmfast-best"]["vs_start"]
"""

from __future__ import annotations

import contextlib
import io
import logging
import statistics
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch

from vlmfast.bench.configs import START, BenchConfig, skip_reason
from vlmfast.bench.quality import pair_verdict, quality_table, quality_text
from vlmfast.bench.runners import RunResult
from vlmfast.bench.workload import Workload
from vlmfast.common.tf32 import restore_tf32_state, tf32_state
from vlmfast.profiling import peak_tflops

__all__ = ["MUST_SHOW", "check_must_show", "run_comparison", "summarise_run"]

log = logging.getLogger(__name__)

# The targets: (what, config, compared with, measure, op, threshold, device types). Measures: "throughput"
# is the paired samples/s ratio (any two rows); "p50" the paired ratio of median step times, used where both rows
# train on identical batches (equal settings), since it is robust to the odd step another process slows down;
# "overhead" is 100 * (1 / p50 ratio - 1), in percent. A "throughput" target also needs the row's eval loss to be
# the same as the other row's or better (vlmfast.bench.quality): a row that trains worse is not ahead.
MUST_SHOW: list[tuple[str, str, str, str, str, float, tuple[str, ...]]] = [
    ("vlmfast overhead vs hand-written at equal settings (%)", "vlmfast", START, "overhead", "<=", 2.0,
     ("cpu", "cuda")),
    ("vlmfast-best vs starting point (samples/s)", "vlmfast-best", START, "throughput", ">", 1.0, ("cpu",)),
    ("vlmfast-best vs starting point (samples/s)", "vlmfast-best", START, "throughput", ">=", 3.0, ("cuda",)),
    ("vlmfast vs Accelerate, both at equal settings (step p50)", "vlmfast", "accelerate", "p50", ">=", 0.98,
     ("cpu", "cuda")),
    ("vlmfast vs HF Trainer, both at equal settings (step p50)", "vlmfast", "hf-trainer", "p50", ">=", 0.98,
     ("cpu", "cuda")),
    ("vlmfast-best vs Accelerate at equal settings (samples/s)", "vlmfast-best", "accelerate", "throughput", ">=",
     1.0, ("cpu",)),
    ("vlmfast-best vs HF Trainer at equal settings (samples/s)", "vlmfast-best", "hf-trainer", "throughput", ">=",
     1.0, ("cpu",)),
    ("vlmfast-best vs HF Trainer best (samples/s)", "vlmfast-best", "hf-best", "throughput", ">=", 1.15, ("cuda",)),
    ("vlmfast-best vs Accelerate best (samples/s)", "vlmfast-best", "accelerate-best", "throughput", ">=", 1.15,
     ("cuda",)),
    ("vlmfast-best vs Fabric best (samples/s)", "vlmfast-best", "fabric-best", "throughput", ">=", 1.15, ("cuda",)),
]


def summarise_run(result: RunResult, warmup: int, device: torch.device) -> dict[str, Any]:
    """The figures of one run over its timed steps (the first `warmup` steps dropped)."""
    times = result.step_times[warmup:]
    total = sum(times) or float("nan")
    ordered = sorted(times)
    flops = sum(result.flops[warmup:])
    tflops = flops / total / 1e12
    peak = peak_tflops(device, "bf16") if device.type == "cuda" else None
    tail = result.losses[-max(1, len(result.losses) // 5):]  # last 20% of steps: less noisy than the last one
    p50, p90 = _quantile(ordered, 0.5), _quantile(ordered, 0.9)
    return {
        "timed_steps": len(times), "time_s": total, "samples": sum(result.samples[warmup:]),
        "samples_per_s": sum(result.samples[warmup:]) / total, "tokens_per_s": sum(result.tokens[warmup:]) / total,
        "step_time_p50_s": p50, "step_time_p90_s": p90, "step_time_p90_over_p50": p90 / p50 if p50 > 0 else None,
        # every step kept (a list: the medians over rounds skip it): where a stall fell, not only how long the tail is
        "step_times_s": list(times), "warmup_step_times_s": result.step_times[:warmup],
        "slowest_step": warmup + max(range(len(times)), key=times.__getitem__) if times else None,
        "padding_fraction": 1 - sum(result.tokens) / max(1, sum(result.slots)),
        "tflops": tflops, "mfu": tflops / peak if peak else None,
        "peak_memory_gb": result.peak_memory_gb, "final_train_loss": statistics.fmean(tail) if tail else None,
        "eval_loss": result.eval_loss, "warmup_s": result.setup_s + sum(result.step_times[:warmup]),
        # what the warm-up steps cost above steady ones: torch.compile's compilation (at the first calls) with a
        # compile row, else allocator and worker start-up; kept apart from the timed steps' figures
        "warmup_excess_s": max(0.0, sum(result.step_times[:warmup]) - warmup * p50) if times else None,
        "samples_total": sum(result.samples), "tokens_total": sum(result.tokens),
    }


def _quantile(ordered: Sequence[float], q: float) -> float:
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


_TF32_AT_START = tf32_state()  # torch's defaults (or the user's settings) before any benchmark run


def _reset_process_state(threads: int) -> None:
    """What one run may leave behind for the next: TF32 settings (vlmfast's tf32 and transformers' TrainingArguments
    set them; restored through torch's new API only, see vlmfast.common.tf32), dynamo's caches (their
    recompile limit would silently send later compiled runs to eager), the thread count, cached CUDA memory."""
    restore_tf32_state(_TF32_AT_START)
    torch._dynamo.reset()
    torch.set_num_threads(threads)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _run_once(config: BenchConfig, workload: Workload, device: torch.device, threads: int) -> dict[str, Any]:
    _reset_process_state(threads)
    start = time.perf_counter()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # run reports
        result = config.run(workload, device)
    summary = summarise_run(result, workload.warmup, device)
    summary["wall_s"] = time.perf_counter() - start
    summary["details"] = result.details
    summary["memory_kind"] = result.memory_kind
    return summary


def run_comparison(workload: Workload, configs: Sequence[BenchConfig], repeats: int, device: torch.device,
                   progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Interleaved rounds over `configs`; returns per-run figures, medians, paired ratios and the must-shows."""
    threads = torch.get_num_threads()
    skipped = {c.name: reason for c in configs if (reason := skip_reason(c, device)) is not None}
    active = [c for c in configs if c.name not in skipped]
    runs: dict[str, list[dict[str, Any]]] = {c.name: [] for c in active}
    for repeat in range(repeats):
        order = active if repeat % 2 == 0 else list(reversed(active))
        for config in order:
            if config.name in skipped:
                continue
            try:
                runs[config.name].append(_run_once(config, workload, device, threads))
            except Exception as exc:  # one broken contender must not sink the others: it is reported as skipped
                skipped[config.name] = f"failed: {type(exc).__name__}: {exc}"
                log.debug("%s failed:\n%s", config.name, traceback.format_exc())
                progress(f"round {repeat} {config.name:>24}: FAILED ({type(exc).__name__}: {exc})")
                continue
            run = runs[config.name][-1]
            progress(f"round {repeat} {config.name:>24}: {run['samples_per_s']:8.1f} samples/s, p50 "
                     f"{run['step_time_p50_s'] * 1e3:7.2f} ms, eval loss {run['eval_loss']:.4f}")
    runs = {name: values for name, values in runs.items() if name not in skipped}
    summary = {name: _median_run(values) for name, values in runs.items()}
    for name, values in runs.items():  # the eval loss's spread over rounds: the noise of the quality verdict
        summary[name]["eval_loss_min"] = min(run["eval_loss"] for run in values)
        summary[name]["eval_loss_max"] = max(run["eval_loss"] for run in values)
    for values in runs.values():  # what a run switched on is the same every round: kept once, in the summary
        for run in values:
            run.pop("details", None)
    ratios = {name: _paired(runs, name) for name in runs}
    result = {"configs": [_describe(c, skipped.get(c.name)) for c in configs], "runs": runs, "summary": summary,
              "ratios": ratios, "skipped": skipped}
    return {**result, "quality": quality_table(result), "must_show": check_must_show(ratios, device.type, result)}


def _describe(config: BenchConfig, skipped: str | None) -> dict[str, Any]:
    settings = {k: v for k, v in vars(config.settings).items() if v not in (None, {}, False, 0) or k == "precision"}
    return {"name": config.name, "contender": config.contender, "role": config.role, "strategy": config.strategy,
            "description": config.description, "settings": settings, "skipped": skipped}


def _median_run(values: list[dict[str, Any]]) -> dict[str, Any]:
    keys = [k for k, v in values[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
    out = {k: statistics.median(run[k] for run in values) for k in keys if all(run[k] is not None for run in values)}
    out["details"] = values[-1]["details"]
    out["memory_kind"] = values[-1]["memory_kind"]
    out["repeats"] = len(values)
    return out


def _paired(runs: dict[str, list[dict[str, Any]]], name: str) -> dict[str, Any]:
    """Medians over rounds of this config against each other config in the same round: ``vs_X`` the samples/s
    ratio, ``p50_vs_X`` the median-step-time speed ratio (X's p50 / this p50); above 1 means this one is faster."""
    mine = runs[name]
    out: dict[str, Any] = {}
    for other, theirs in runs.items():
        pairs = list(zip(mine, theirs, strict=False))
        if pairs:
            out[f"vs_{other}"] = statistics.median(a["samples_per_s"] / b["samples_per_s"] for a, b in pairs)
            out[f"p50_vs_{other}"] = statistics.median(b["step_time_p50_s"] / a["step_time_p50_s"] for a, b in pairs)
    out["vs_start_pairs"] = [a["samples_per_s"] / b["samples_per_s"]
                             for a, b in zip(mine, runs.get(START, []), strict=False)]
    return out


def check_must_show(ratios: dict[str, Any], device_type: str,
                    result: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    """Each target of the issue that applies to this device: the measured figure and whether it is met.

    With `result` (summary and runs: the eval losses), a throughput target is met only when the row's quality is the
    same as the other row's or better (``quality``: the verdict's text); without it, on speed alone."""
    checks = []
    for what, mine, other, measure, op, threshold, devices in MUST_SHOW:
        if device_type not in devices:
            continue
        key = f"vs_{other}" if measure == "throughput" else f"p50_vs_{other}"
        value = ratios.get(mine, {}).get(key)
        if value is not None and measure == "overhead":
            value = 100 * (1 / value - 1)
        met = None if value is None else {"<=": value <= threshold, ">": value > threshold,
                                          ">=": value >= threshold}[op]
        check = {"what": what, "rule": f"{measure}({mine} vs {other}) {op} {threshold}", "value": value, "met": met}
        verdict = pair_verdict(result, mine, other) if result is not None and measure == "throughput" else None
        if verdict is not None:
            check["rule"] += f", eval loss not worse than {other}'s"
            check["quality"] = quality_text(verdict)
            if verdict["verdict"] == "worse" and met:
                check["met"] = False
        checks.append(check)
    return checks
