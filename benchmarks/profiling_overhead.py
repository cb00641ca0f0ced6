"""What the default profiling costs: a 40-step run of the default demo spec with the default `profile` and `memory`
sections against the same run with profiling off (no phase timing, no FLOPs, no leak check), and the default demo's
data wait.

Runs alternate (default, off, off, default, ...) so drift hits both alike; each run's time is the wall time of
``fit()`` without its first step (lazy initialisation, the same for both); the overhead is the median over repeats
of the paired ratio. The data wait is the report's figure (sum of per-step data time / sum of step time) of the
default runs.

Usage::

    python benchmarks/profiling_overhead.py                     # 40 steps, 7 pairs, 1 torch thread
    python benchmarks/profiling_overhead.py --steps 40 --repeats 9 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from _common import median, write_result

from vlmfast import Callback, OptimizedTrainer, TrainSpec
from vlmfast.cli import DEMO_SPEC
from vlmfast.models import build_tiny_vlm_task

OFF = {"profile": {"timing": False, "mfu": False}, "memory": {"leak_check": False}}


class StepClock(Callback):
    """Time from the end of the first step to the end of the last one."""

    def __init__(self) -> None:
        self.stamps: list[float] = []

    def on_step_end(self, trainer, metrics) -> None:
        self.stamps.append(time.perf_counter())


def run(spec: dict, steps: int, samples: int) -> tuple[float, float, dict]:
    """Seconds for steps 2..N, the run's data-wait share, and the report's extra lines."""
    model, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=samples)
    clock = StepClock()
    trainer = OptimizedTrainer(model, dataset, TrainSpec(**{**spec, "max_steps": steps}), collate_fn=collate,
                               callbacks=[clock])
    result = trainer.fit()
    return clock.stamps[-1] - clock.stamps[0], result.report.data_wait_ratio, result.report.extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    default = {**copy.deepcopy(DEMO_SPEC), "log": {"progress": "off"}}
    off = {**default, **OFF}
    run(default, 3, args.samples)  # warm the process (imports, allocator) before any measured run
    ratios, waits, times = [], [], {"default": [], "off": []}
    for repeat in range(args.repeats):
        order = [("default", default), ("off", off)] if repeat % 2 == 0 else [("off", off), ("default", default)]
        measured = {}
        for name, spec in order:
            seconds, wait, _ = run(spec, args.steps, args.samples)
            measured[name] = seconds
            times[name].append(seconds)
            if name == "default":
                waits.append(wait)
        ratios.append(measured["default"] / measured["off"])
        print(f"pair {repeat + 1}: default {measured['default']:.3f} s, off {measured['off']:.3f} s, "
              f"overhead {ratios[-1] - 1:+.2%}, data wait {waits[-1]:.1%}", flush=True)
    result = {"steps": args.steps, "repeats": args.repeats, "threads": args.threads,
              "overhead": median(ratios) - 1, "ratios": ratios, "seconds": times,
              "data_wait_ratio": median(waits), "data_wait_ratios": waits}
    print(f"profiling overhead (median of paired ratios): {result['overhead']:+.2%}; "
          f"default demo data wait: {result['data_wait_ratio']:.1%}")
    print(write_result("profiling_overhead", torch.device("cpu"), result, args.out))


if __name__ == "__main__":
    main()
