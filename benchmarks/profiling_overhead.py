"""What the default profiling costs: a 40-step run of the default demo spec with the default `profile` and `memory`
sections against the same run with profiling off (no phase timing, no FLOPs, no leak check), and the default demo's
data wait.

Runs alternate (default, off, off, default, ...) so drift hits both alike; each run's time is the time of ``fit()``
without its first step (lazy initialisation, the same for both), as wall clock and as this process's CPU time (one
torch thread, no loader workers: on a machine other jobs share, CPU time is the steadier measure of the work);
the overhead is the median over repeats of the paired ratio. The data wait is the report's figure (sum of per-step
data time / sum of step time) of the default runs.

Usage::

    python benchmarks/profiling_overhead.py                     # 40 steps, 7 pairs, 1 torch thread
    python benchmarks/profiling_overhead.py --steps 40 --repeats 9 --threads 2
"""

from __future__ import annotations

import argparse
import copy
import os
import time

import torch
from _common import median, write_result

from vlmfast import Callback, OptimizedTrainer, TrainSpec
from vlmfast.cli.jobs import DEMO_SPEC, DEMO_TASK_SPEC
from vlmfast.models import build_tiny_vlm_task

OFF = {"profile": {"timing": False, "mfu": False}, "memory": {"leak_check": False}}


class StepClock(Callback):
    """Wall and CPU time from the end of the first step to the end of the last one."""

    def __init__(self) -> None:
        self.stamps: list[tuple[float, float]] = []

    def on_step_end(self, trainer, metrics) -> None:
        self.stamps.append((time.perf_counter(), time.process_time()))


def run(spec: dict, steps: int, samples: int) -> tuple[tuple[float, float], float, dict]:
    """(wall, CPU) seconds for steps 2..N, the run's data-wait share, and the report's extra lines."""
    model, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=samples)
    clock = StepClock()
    trainer = OptimizedTrainer(model, dataset, TrainSpec(**{**spec, "max_steps": steps}), collate_fn=collate,
                               callbacks=[clock])
    result = trainer.fit()
    (wall0, cpu0), (wall1, cpu1) = clock.stamps[0], clock.stamps[-1]
    return (wall1 - wall0, cpu1 - cpu0), result.report.data_wait_ratio, result.report.extra


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--samples", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    default = {**copy.deepcopy(DEMO_SPEC), **copy.deepcopy(DEMO_TASK_SPEC), "log": {"progress": "off"}}
    off = {**default, **OFF}
    run(default, 3, args.samples)  # warm the process (imports, allocator) before any measured run
    ratios: dict[str, list[float]] = {"wall": [], "cpu": []}
    waits: list[float] = []
    times: dict[str, list[tuple[float, float]]] = {"default": [], "off": []}
    for repeat in range(args.repeats):
        order = [("default", default), ("off", off)] if repeat % 2 == 0 else [("off", off), ("default", default)]
        measured = {}
        for name, spec in order:
            seconds, wait, _ = run(spec, args.steps, args.samples)
            measured[name] = seconds
            times[name].append(seconds)
            if name == "default":
                waits.append(wait)
        for i, clock in enumerate(("wall", "cpu")):
            ratios[clock].append(measured["default"][i] / measured["off"][i])
        print(f"pair {repeat + 1}: wall {measured['default'][0]:.3f} vs {measured['off'][0]:.3f} s "
              f"({ratios['wall'][-1] - 1:+.2%}), CPU {measured['default'][1]:.3f} vs {measured['off'][1]:.3f} s "
              f"({ratios['cpu'][-1] - 1:+.2%}), data wait {waits[-1]:.1%}", flush=True)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    result = {"steps": args.steps, "repeats": args.repeats, "threads": args.threads, "load_average_1min": load,
              "overhead_wall": median(ratios["wall"]) - 1, "overhead_cpu": median(ratios["cpu"]) - 1,
              "ratios": ratios, "seconds_wall_cpu": times,
              "data_wait_ratio": median(waits), "data_wait_ratios": waits}
    print(f"profiling overhead (median of paired ratios): wall {result['overhead_wall']:+.2%}, CPU time "
          f"{result['overhead_cpu']:+.2%}; default demo data wait: {result['data_wait_ratio']:.1%} "
          f"(load average {load})")
    print(write_result("profiling_overhead", torch.device("cpu"), result, args.out))


if __name__ == "__main__":
    main()
