"""Epoch-2 samples/s of the tiny VLM with a frozen vision tower, with and without ``vision_cache``.

Two ``OptimizedTrainer``s train the built-in VLM (a bigger vision tower than the default, so that it takes a share of
the step like a real VLM's: 36 image tokens, 4 ViT blocks of width 192) on the same data, tower and projector frozen:
one plain, one with ``vision_cache`` (a fresh store per round). They take their optimizer steps in turn (plain,
cached, cached, plain, ...) through the trainer's own ``train_step`` / ``optimizer_step``, so the two steps of a
pair run under the same machine load. Epoch 1 fills the cache; each pair of epoch-2 steps gives a ratio, and the
speed-up is the median of those ratios over all rounds.

The tower's forward share is measured in the plain trainer (a wrapper around ``get_image_features``, i.e. tower +
projector; on CPU the call is synchronous), and the result says which part of it the cache removed:
``(1 - cached step / plain step) / tower share`` (goal: >= 90 %). Losses of the two trainers are compared too.

Two clocks: wall time, and the training thread's CPU time (``time.thread_time``), which other processes on a shared
machine inflate less (with one torch thread the compute runs on the training thread).

Usage::

    python benchmarks/vision_cache.py --threads 1                  # CPU, ~3 min
    python benchmarks/vision_cache.py --rounds 1 --samples 64      # quicker
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from typing import Any

import torch
from _common import median, write_result
from torch.utils.data import Dataset

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.models import build_tiny_vlm_task
from vlmfast.models.tiny_vlm import TinyVLMConfig

CONFIG = dict(image_size=96, patch_size=16, vision_dim=192, vision_layers=4, vision_heads=4)


class Rendered(Dataset):
    """The shapes dataset rendered once, so data loading is the same small cost for both trainers."""

    def __init__(self, samples: int, image_size: int) -> None:
        _, dataset, _ = build_tiny_vlm_task(num_samples=samples)
        dataset.min_image_size = dataset.max_image_size = image_size  # the collate function's resize is a no-op
        self.samples = [dataset[i] for i in range(samples)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.samples[index]


class TowerClock:
    """Wall and thread CPU time inside ``get_image_features`` (tower + projector) since the last ``take``."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.wall = self.cpu = 0.0
        original = model.get_image_features

        def timed(*args: Any, **kwargs: Any) -> Any:
            wall, cpu = time.perf_counter(), time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.wall += time.perf_counter() - wall
                self.cpu += time.thread_time() - cpu

        model.get_image_features = timed  # the plain trainer only (the cache stands in for this method itself)

    def take(self) -> tuple[float, float]:
        out = (self.wall, self.cpu)
        self.wall = self.cpu = 0.0
        return out


def build(cached: bool, dataset: Dataset, args: argparse.Namespace) -> tuple[OptimizedTrainer, TowerClock | None]:
    model, _, collate = build_tiny_vlm_task(num_samples=len(dataset), config=TinyVLMConfig(**CONFIG))
    clock = None if cached else TowerClock(model)
    spec = TrainSpec(max_steps=10**6, batch_size=args.batch_size, device="cpu", seed=0, log={"progress": "off"},
                     optimizer={"freeze": ["vision_tower", "multi_modal_projector"]},
                     vision_cache={"enabled": cached, "dir": tempfile.mkdtemp(prefix="vision-cache-bench-")})
    trainer = OptimizedTrainer(model, dataset, spec, collate_fn=collate)
    trainer.model.train()
    return trainer, clock


def step(trainer: OptimizedTrainer) -> tuple[float, float, float]:
    """One optimizer step through the trainer's own step API: (wall s, thread CPU s, loss); data loading included."""
    wall, cpu = time.perf_counter(), time.thread_time()
    batch = next(trainer.loader)
    loss, plan = trainer.train_step(batch, trainer.micro_batching.micro_batch_size)
    done = trainer.optimizer_step(loss, plan)
    trainer.state.step = done.number
    return time.perf_counter() - wall, time.thread_time() - cpu, done.values["loss"]


def one_round(dataset: Dataset, args: argparse.Namespace, pairs: list[dict[str, float]]) -> dict[str, Any]:
    (plain, clock), (cached, _) = build(False, dataset, args), build(True, dataset, args)
    steps_per_epoch = len(dataset) // args.batch_size
    losses: dict[str, list[float]] = {"plain": [], "cached": []}
    for i in range(2 * steps_per_epoch):
        order = [("plain", plain), ("cached", cached)][:: 1 if i % 2 == 0 else -1]
        times = {}
        for name, trainer in order:
            if name == "plain":
                clock.take()
            times[name] = step(trainer)
            losses[name].append(times[name][2])
        tower_wall, tower_cpu = clock.take()
        if i >= steps_per_epoch:  # epoch 2
            pairs.append({"plain_wall": times["plain"][0], "plain_cpu": times["plain"][1],
                          "cached_wall": times["cached"][0], "cached_cpu": times["cached"][1],
                          "tower_wall": tower_wall, "tower_cpu": tower_cpu})
    vision = next(s for s in cached.strategies if s.name == "vision_cache")
    cache, stats = vision.cache, vision.cache.stats
    out = {"max_abs_loss_difference": max(abs(a - b) for a, b in zip(losses["plain"], losses["cached"], strict=True)),
           "hit_rate": stats.hit_rate, "hits": stats.hits, "misses": stats.misses,
           "entries": cache.entries(), "bytes_on_disk": cache.bytes_on_disk(),
           "tower_ms_per_image": 1e3 * stats.tower_seconds_per_image, "seconds_saved": stats.seconds_saved,
           "cache_overhead_ms_per_image": 1e3 * stats.overhead_seconds / max(stats.hits + stats.misses, 1),
           "report_line": vision.describe()}
    cache.remove()
    return out


def summarise(pairs: list[dict[str, float]], clock: str, batch_size: int) -> dict[str, Any]:
    plain, cached = [p[f"plain_{clock}"] for p in pairs], [p[f"cached_{clock}"] for p in pairs]
    ratio = median([p / c for p, c in zip(plain, cached, strict=True)])
    share = median([p[f"tower_{clock}"] / p[f"plain_{clock}"] for p in pairs])
    reduction = 1 - 1 / ratio
    return {"epoch2_samples_per_s": {"plain": batch_size / median(plain), "cached": batch_size / median(cached)},
            "epoch2_step_ms": {"plain": 1e3 * median(plain), "cached": 1e3 * median(cached)},
            "speedup_median_of_paired_ratios": ratio, "tower_forward_share_of_step": share,
            "step_time_reduction": reduction, "share_of_tower_time_removed": reduction / share}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=3, help="fresh trainers and cache per round")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", default=None, help="result JSON (default: benchmarks/results/cpu/vision_cache.json)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dataset = Rendered(args.samples, CONFIG["image_size"])
    load = [os.getloadavg()[0]]
    pairs: list[dict[str, float]] = []
    rounds = []
    for index in range(args.rounds):
        rounds.append(one_round(dataset, args, pairs))
        print(f"round {index + 1}: {rounds[-1]['report_line']}")
    load.append(os.getloadavg()[0])
    summary = {clock: summarise(pairs, clock, args.batch_size) for clock in ("wall", "cpu")}
    result = {
        "benchmark": "vision_cache",
        "model": f"tiny VLM {CONFIG}, text_dim 128, 2 text layers; vision tower and projector frozen",
        "samples": args.samples, "batch_size": args.batch_size, "rounds": args.rounds,
        "epoch2_step_pairs": len(pairs), "torch_threads": torch.get_num_threads(),
        "load_average_1min_at_start_and_end": load,
        "method": "two trainers step in turn (order alternating per pair); epoch-2 pairs over all rounds; medians "
                  "and the median of per-pair ratios; wall = perf_counter, cpu = the training thread's CPU time",
        **summary,
        "max_abs_loss_difference": max(r["max_abs_loss_difference"] for r in rounds),
        "cached_rounds": rounds,
        "pairs": pairs,
    }
    path = write_result("vision_cache", torch.device("cpu"), result, args.out)
    for clock, r in summary.items():
        print(f"{clock}: epoch-2 samples/s plain {r['epoch2_samples_per_s']['plain']:.1f}, cached "
              f"{r['epoch2_samples_per_s']['cached']:.1f} (x{r['speedup_median_of_paired_ratios']:.2f}); tower "
              f"share {r['tower_forward_share_of_step']:.0%}, step time -{r['step_time_reduction']:.0%} = "
              f"{r['share_of_tower_time_removed']:.0%} of the tower's time")
    print(f"max |loss difference| {result['max_abs_loss_difference']:.2e}; load average {load}\n-> {path}")


if __name__ == "__main__":
    main()
