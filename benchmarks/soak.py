"""Soak: thousands of steps of the tiny VLM on CPU; the process's memory must not grow and steps must not slow down.

One realistic run with the trainer as users get it: several epochs, a checkpoint every `--save-every` steps,
metrics.jsonl, the default memory monitor. `--history-steps` (default 100) is passed as `log.history_steps`, the
number of per-step metrics dicts `FitResult.history` (and the profiler) keep, so that the bound engages early; the
default of 10_000 bounds real runs the same way, at ~10 MiB.

After a 1500-step warm-up (glibc's heap and the first checkpoints settle by ~1200 steps) the process RSS is read
every `--sample-every` steps, after `malloc_trim(0)` returns freed heap pages (fragmentation is not memory the
process holds), and fitted with a least-squares line. Memory grows when the growth over the window (slope x steps)
beats the noise (2 residual std + 2 slope standard errors x steps) and the slope is above 0.1 MiB per 1000 steps.
Step time: the median of the first window after warm-up against the last one (a slowdown is above x1.10).

Usage::

    python benchmarks/soak.py                 # 5000 steps, batch 8, 1 torch thread (~1.5 min)
    python benchmarks/soak.py --steps 10000 --history-steps 10000
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import math
import sys
import tempfile
import time
from array import array
from typing import Any

import numpy as np
import psutil
import torch
from _common import median, write_result

from vlmfast import Callback, OptimizedTrainer, TrainSpec
from vlmfast.models import build_tiny_vlm_task

# glibc keeps freed heap pages (fragmentation, not live memory): returning them before each reading measures what the
# process holds. Without it, RSS rises ~0.3-0.8 MiB per 1000 steps in identical runs and levels off after ~6000.
_MALLOC_TRIM = (getattr(ctypes.CDLL(ctypes.util.find_library("c")), "malloc_trim", None)
                if sys.platform.startswith("linux") else None)
# Growth below this is not called growth even when it beats the (tiny, after trimming) noise: 0.1 MiB per 1000 steps
# is 100 MiB over a million steps.
FLOOR_MB_PER_1K_STEPS = 0.1


class Recorder(Callback):
    """Step times and losses every step (compact arrays: the recorder must not grow RSS itself), RSS every `every`."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.process = psutil.Process()
        self.rss: list[tuple[int, float]] = []
        self.step_times = array("d")
        self.losses = array("d")

    def on_step_end(self, trainer: OptimizedTrainer, metrics: dict[str, Any]) -> None:
        self.step_times.append(metrics["step_time"])
        self.losses.append(metrics["loss"])
        if metrics["step"] % self.every == 0:
            if _MALLOC_TRIM is not None:
                _MALLOC_TRIM(0)
            self.rss.append((metrics["step"], self.process.memory_info().rss / 2**20))


def fit_line(x: np.ndarray, y: np.ndarray) -> dict[str, float]:
    """Least-squares y = a + b x: slope b, its standard error, and the residual standard deviation."""
    slope, intercept = np.polyfit(x, y, 1)
    residuals = y - (intercept + slope * x)
    residual_std = float(np.sqrt(np.sum(residuals**2) / max(len(x) - 2, 1)))
    slope_se = residual_std / math.sqrt(float(np.sum((x - x.mean()) ** 2)))
    return {"slope": float(slope), "slope_se": slope_se, "residual_std": residual_std}


def rss_verdict(samples: list[tuple[int, float]], warmup: int) -> dict[str, Any]:
    """Growth over the measured window against the noise (2 residual std + 2 slope SE over the window)."""
    steps = np.array([s for s, _ in samples if s > warmup], dtype=float)
    rss = np.array([m for s, m in samples if s > warmup])
    line = fit_line(steps, rss)
    window = float(steps[-1] - steps[0])
    growth = line["slope"] * window
    noise = 2 * line["residual_std"] + 2 * line["slope_se"] * window
    return {
        "samples": len(steps),
        "first_mb": float(rss[0]),
        "last_mb": float(rss[-1]),
        "max_mb": float(rss.max()),
        "slope_mb_per_1k_steps": 1000 * line["slope"],
        "slope_se_mb_per_1k_steps": 1000 * line["slope_se"],
        "residual_std_mb": line["residual_std"],
        "growth_over_window_mb": growth,
        "noise_mb": noise,
        "within_noise": abs(growth) <= noise,
        "grows": abs(growth) > noise and 1000 * line["slope"] > FLOOR_MB_PER_1K_STEPS,
        "malloc_trim": _MALLOC_TRIM is not None,
    }


def step_time_verdict(times: list[float], warmup: int, window: int) -> dict[str, Any]:
    """Median step time of the first and the last window after warm-up; a slowdown is last/first above 1.10."""
    measured = times[warmup:]
    first, last = median(measured[:window]), median(measured[-window:])
    line = fit_line(np.arange(len(measured), dtype=float), np.array(measured))
    return {
        "first_window_median_ms": 1e3 * first,
        "last_window_median_ms": 1e3 * last,
        "last_over_first": last / first,
        "trend_ms_per_1k_steps": 1e6 * line["slope"],
        "slowdown": last / first > 1.10,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5000)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--samples", type=int, default=2048, help="dataset size (epochs = steps x batch / samples)")
    parser.add_argument("--warmup", type=int, default=1500,
                        help="steps before memory and time are judged (the allocator settles by ~1200)")
    parser.add_argument("--sample-every", type=int, default=10)
    parser.add_argument("--save-every", type=int, default=500)
    parser.add_argument("--history-steps", type=int, default=100, help="log.history_steps (trainer default 10_000)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1: least jitter on CPU)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    model, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=args.samples)
    recorder = Recorder(args.sample_every)
    with tempfile.TemporaryDirectory() as tmp:
        spec = TrainSpec(
            max_steps=args.steps,
            batch_size=args.batch_size,
            device="cpu",
            optimizer={"lr": 1e-3},
            save={"dir": f"{tmp}/ckpt", "every_steps": args.save_every, "keep_last": 2},
            log={"dir": f"{tmp}/log", "progress": "off", "every_steps": 10, "history_steps": args.history_steps},
        )
        start = time.perf_counter()
        result = OptimizedTrainer(model, dataset, spec, collate_fn=collate, callbacks=[recorder]).fit()
        wall = time.perf_counter() - start
    window = max(50, (args.steps - args.warmup) // 10)
    rss = rss_verdict(recorder.rss, args.warmup)
    step_time = step_time_verdict(recorder.step_times, args.warmup, window)
    out = {
        "benchmark": "soak",
        "model": "tiny VLM (built-in), fp32, CPU; checkpoint every save_every steps, metrics.jsonl, memory monitor",
        "steps": args.steps,
        "batch_size": args.batch_size,
        "dataset_samples": args.samples,
        "epochs": args.steps * args.batch_size / args.samples,
        "warmup_steps": args.warmup,
        "save_every_steps": args.save_every,
        "history_steps": args.history_steps,
        "history_kept_at_end": len(result.history),
        "report_steps": result.report.steps,
        "wall_s": wall,
        "loss_first_last": [recorder.losses[0], recorder.losses[-1]],
        "memory_grows": rss["grows"],
        "slowdown": step_time["slowdown"],
        "rss": rss,
        "step_time": step_time,
        "rss_samples": recorder.rss,
    }
    path = write_result("soak", torch.device("cpu"), out, args.out)
    print(
        f"{args.steps} steps in {wall:.0f} s (history_steps {args.history_steps}, {len(result.history)} kept at the "
        f"end), written to {path}\nRSS {rss['first_mb']:.1f} -> {rss['last_mb']:.1f} MiB, slope "
        f"{rss['slope_mb_per_1k_steps']:+.2f} +- {rss['slope_se_mb_per_1k_steps']:.2f} MiB/1k steps, growth "
        f"{rss['growth_over_window_mb']:+.2f} MiB vs noise {rss['noise_mb']:.2f} MiB: "
        f"{'GROWS' if out['memory_grows'] else 'flat'}\nstep time {step_time['first_window_median_ms']:.1f} "
        f"-> {step_time['last_window_median_ms']:.1f} ms (x{step_time['last_over_first']:.2f}): "
        f"{'SLOWER' if out['slowdown'] else 'no slowdown'}"
    )


if __name__ == "__main__":
    main()
