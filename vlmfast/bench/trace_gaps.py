"""Where the device idles: a torch.profiler Chrome trace reduced to a small JSON (busy fraction per step, the longest
idle gaps and what the host was doing then).

A GPU lease brings back at most 8 files of 16 MiB, and a trace of a 1B-model step runs to hundreds of MB; the
questions it answers fit in a few KB. Per profiled step (the ``ProfilerStep#N`` spans torch.profiler's schedule
writes on the host): its length, the time the device ran something (kernels, copies, memsets, their union), the
busy fraction; then the longest gaps between device activity inside the steps, each with the host events that
overlapped it most (operators, Python functions, CUDA runtime calls: a ``cudaStreamSynchronize`` there is the host
waiting; a ``DataLoader`` or ``fork`` frame is the host not launching). A trace without device events (a CPU run)
reads the top-level operators of the steps' thread as the "device": the gaps are then the host time between
operators, the same question asked of a CPU step.

Usage::

    summary = reduce_trace("profiler/trace_steps_10-12.json", gaps=8)
    summary["busy_fraction"], summary["steps"][0]["busy_fraction"], summary["longest_gaps"][0]["host"]

    python -m vlmfast.bench.trace_gaps profiler/trace_steps_10-12.json --out gaps.json
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = ["DEVICE_CATEGORIES", "main", "reduce_trace"]

DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_CATEGORIES = ("cpu_op", "python_function", "user_annotation", "cuda_runtime", "cuda_driver")
_STEP = "ProfilerStep#"
Interval = tuple[float, float]


def _merge(intervals: Iterable[Interval]) -> list[Interval]:
    merged: list[list[float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return [(a, b) for a, b in merged]


def _clip(intervals: Sequence[Interval], window: Interval) -> list[Interval]:
    lo, hi = window
    return [(max(a, lo), min(b, hi)) for a, b in intervals if b > lo and a < hi]


def _span(event: Mapping[str, Any]) -> Interval:
    start = float(event["ts"])
    return start, start + float(event.get("dur", 0.0))


def _device_events(complete: Sequence[Mapping[str, Any]], steps: Sequence[Mapping[str, Any]]
                   ) -> tuple[list[Interval], str]:
    """Device activity; without any (a CPU trace), the outermost operators on the steps' thread."""
    device = [_span(e) for e in complete if e.get("cat") in DEVICE_CATEGORIES]
    if device:
        return device, "device (kernels, copies, memsets)"
    threads = {(s.get("pid"), s.get("tid")) for s in steps}
    ops = [_span(e) for e in complete if e.get("cat") == "cpu_op" and (e.get("pid"), e.get("tid")) in threads]
    return ops, "host operators of the step's thread (no device events in this trace)"


def _host_during(gap: Interval, host: Sequence[Mapping[str, Any]], limit: int = 3) -> list[dict[str, Any]]:
    """The host events that overlap `gap` most, with how much."""
    found = []
    for event in host:
        start, end = _span(event)
        overlap = min(end, gap[1]) - max(start, gap[0])
        if overlap > 0:
            found.append({"name": event.get("name", "?"), "category": event.get("cat"), "thread": event.get("tid"),
                          "overlap_ms": overlap / 1e3})
    found.sort(key=lambda row: row["overlap_ms"], reverse=True)
    return found[:limit]


def reduce_trace(trace: str | Path | Mapping[str, Any], gaps: int = 5) -> dict[str, Any]:
    """Busy fraction per profiled step and the `gaps` longest device-idle gaps with the host's events then.

    Usage: see the module docstring. Times in the result are in milliseconds.
    """
    data = json.loads(Path(trace).read_text()) if isinstance(trace, (str, Path)) else trace
    events = data["traceEvents"] if isinstance(data, Mapping) else data
    complete = [e for e in events if e.get("ph") == "X" and "ts" in e]
    # the host's step spans (a CUDA trace also has the steps' GPU-side copies, category gpu_user_annotation)
    steps = sorted((e for e in complete if str(e.get("name", "")).startswith(_STEP)
                    and e.get("cat") != "gpu_user_annotation"), key=lambda e: float(e["ts"]))
    if not steps:
        raise ValueError("reduce_trace: no ProfilerStep#N spans in the trace; record it with torch.profiler's "
                         "schedule and call prof.step() once per training step")
    busy_all, clock = _device_events(complete, steps)
    busy = _merge(busy_all)
    host = [e for e in complete if e.get("cat") in HOST_CATEGORIES and not str(e.get("name", "")).startswith(_STEP)]
    rows, idle = [], []
    for step in steps:
        window = _span(step)
        inside = _clip(busy, window)
        busy_us = sum(b - a for a, b in inside)
        length = window[1] - window[0]
        rows.append({"step": step["name"], "ms": length / 1e3, "busy_ms": busy_us / 1e3,
                     "busy_fraction": busy_us / length if length > 0 else None})
        edges = [window[0], *[x for pair in inside for x in pair], window[1]]
        for start, end in zip(edges[::2], edges[1::2], strict=True):
            if end > start:
                idle.append((end - start, start, step["name"], window[0]))
    idle.sort(reverse=True)
    host_spans = _merge(_span(e) for e in host)
    longest = [{"step": name, "at_ms": (start - step_start) / 1e3, "ms": length / 1e3,
                "host": _host_during((start, start + length), host),
                # no recorded host event: Python between operators (the loop, data loading); with_stack names it
                "host_unrecorded_ms": (length - sum(b - a for a, b in _clip(host_spans, (start, start + length))))
                / 1e3} for length, start, name, step_start in idle[:gaps]]
    total = sum(r["ms"] for r in rows)
    return {"clock": clock, "steps": rows, "busy_fraction": sum(r["busy_ms"] for r in rows) / total if total else None,
            "idle_ms_per_step": (total - sum(r["busy_ms"] for r in rows)) / len(rows), "longest_gaps": longest}


def main(argv: list[str] | None = None) -> int:
    """``python -m vlmfast.bench.trace_gaps TRACE.json [--gaps 8] [--out gaps.json]``"""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace")
    parser.add_argument("--gaps", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    text = json.dumps(reduce_trace(args.trace, gaps=args.gaps), indent=2) + "\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
