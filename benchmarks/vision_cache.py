"""Epoch-2 samples/s of the tiny VLM with a frozen vision tower, with and without ``vision_cache``.

Each run trains the built-in VLM (a bigger vision tower than the default, so that it takes a share of the step like
a real VLM's: 36 image tokens, 4 ViT blocks of width 192) for two epochs with the tower and projector frozen, through
``OptimizedTrainer``. Without the cache the tower runs every step; with it, epoch 1 fills a fresh store and epoch 2
reads it. Runs alternate (plain, cached, cached, plain, ...); for each run the median epoch-2 step time is taken,
and the speed-up is the median of the paired per-round ratios (each round's two runs saw the same machine load).

The tower's forward share is measured in the plain runs (forward hooks around ``get_image_features``, i.e. tower +
projector, CPU wall time: synchronous there), and the result says which part of it the cache removed:
``(1 - cached step / plain step) / tower share`` (goal: >= 90 %). Losses of the two arms are compared too.

Usage::

    python benchmarks/vision_cache.py --threads 1                  # CPU, ~4 min
    python benchmarks/vision_cache.py --rounds 3 --samples 64      # quicker
"""

from __future__ import annotations

import argparse
import tempfile
import time
from typing import Any

import torch
from _common import median, write_result
from torch.utils.data import Dataset

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.models.shapes import build_tiny_vlm_task
from vlmfast.models.tiny_vlm import TinyVLMConfig

CONFIG = dict(image_size=96, patch_size=16, vision_dim=192, vision_layers=4, vision_heads=4)


class Rendered(Dataset):
    """The shapes dataset rendered once, so data loading is the same small cost in both arms."""

    def __init__(self, samples: int, image_size: int) -> None:
        _, dataset, _ = build_tiny_vlm_task(num_samples=samples)
        dataset.min_image_size = dataset.max_image_size = image_size  # no resize in the collate function
        self.samples = [dataset[i] for i in range(samples)]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.samples[index]


class TowerClock:
    """Wall time inside ``get_image_features`` (tower + projector) per step (CPU: synchronous, so exact)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.seconds = 0.0
        self._start = 0.0
        self._original = model.get_image_features

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return self._original(*args, **kwargs)
            finally:
                self.seconds += time.perf_counter() - start

        model.get_image_features = timed  # the plain arm only: the cached arm wraps this method itself

    def take(self) -> float:
        seconds, self.seconds = self.seconds, 0.0
        return seconds


def run(arm: str, dataset: Dataset, args: argparse.Namespace) -> dict[str, Any]:
    config = TinyVLMConfig(**CONFIG)
    model, _, collate = build_tiny_vlm_task(num_samples=len(dataset), config=config)
    steps_per_epoch = len(dataset) // args.batch_size
    cache_dir = tempfile.mkdtemp(prefix="vision-cache-bench-")
    clock = TowerClock(model) if arm == "plain" else None
    tower_seconds: list[float] = []

    class Tower:  # a callback: the tower time of each step
        def on_step_end(self, trainer: Any, metrics: dict[str, Any]) -> None:
            if clock is not None:
                tower_seconds.append(clock.take())

    spec = TrainSpec(max_steps=2 * steps_per_epoch, batch_size=args.batch_size, device="cpu", seed=0,
                     log={"progress": "off"}, optimizer={"freeze": ["vision_tower", "multi_modal_projector"]},
                     vision_cache={"enabled": arm == "cached", "dir": cache_dir})
    trainer = OptimizedTrainer(model, dataset, spec, collate_fn=collate, callbacks=[Tower()])
    result = trainer.fit()
    epoch2 = result.history[steps_per_epoch:]
    out = {"epoch2_step_s": median([h["step_time"] for h in epoch2]),
           "epoch1_step_s": median([h["step_time"] for h in result.history[1:steps_per_epoch]]),
           "losses": [h["loss"] for h in result.history]}
    out["epoch2_samples_per_s"] = args.batch_size / out["epoch2_step_s"]
    if clock is not None:
        out["tower_share"] = median([t / h["step_time"] for t, h in zip(tower_seconds[steps_per_epoch:], epoch2,
                                                                          strict=True)])
        out["tower_step_s"] = median(tower_seconds[steps_per_epoch:])
    else:
        cache = next(s for s in trainer.strategies if s.name == "vision_cache").cache
        stats = cache.stats
        out.update(hit_rate=stats.hit_rate, hits=stats.hits, misses=stats.misses, bytes_on_disk=cache.bytes_on_disk(),
                   entries=cache.entries(), seconds_saved=stats.seconds_saved,
                   cache_overhead_ms_per_image=1e3 * stats.overhead_seconds / max(stats.hits + stats.misses, 1),
                   tower_ms_per_image=1e3 * stats.tower_seconds_per_image, report_line=cache.describe())
        cache.remove()
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", default=None, help="result JSON (default: benchmarks/results/cpu/vision_cache.json)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dataset = Rendered(args.samples, CONFIG["image_size"])
    runs: dict[str, list[dict[str, Any]]] = {"plain": [], "cached": []}
    for round_index in range(args.rounds):
        order = ("plain", "cached") if round_index % 2 == 0 else ("cached", "plain")
        for arm in order:
            runs[arm].append(run(arm, dataset, args))
            print(f"round {round_index + 1} {arm:>6}: epoch-2 step {1e3 * runs[arm][-1]['epoch2_step_s']:.1f} ms")
    pairs = list(zip(runs["plain"], runs["cached"], strict=True))
    ratios = [p["epoch2_step_s"] / c["epoch2_step_s"] for p, c in pairs]
    plain_step, cached_step = (median([r["epoch2_step_s"] for r in runs[a]]) for a in ("plain", "cached"))
    share = median([r["tower_share"] for r in runs["plain"]])
    reduction = 1 - 1 / median(ratios)  # from the paired ratios: each round's two runs saw the same machine load
    removed_per_round = [(1 - c["epoch2_step_s"] / p["epoch2_step_s"]) / p["tower_share"] for p, c in pairs]
    loss_diff = max(abs(a - b) for p, c in zip(runs["plain"], runs["cached"], strict=True)
                    for a, b in zip(p["losses"], c["losses"], strict=True))
    result = {
        "benchmark": "vision_cache",
        "model": f"tiny VLM {CONFIG}, text_dim 128, 2 text layers; vision tower and projector frozen",
        "samples": args.samples, "batch_size": args.batch_size, "rounds": args.rounds,
        "torch_threads": torch.get_num_threads(),
        "epoch2_samples_per_s": {"plain": args.batch_size / plain_step, "cached": args.batch_size / cached_step},
        "epoch2_step_ms": {"plain": 1e3 * plain_step, "cached": 1e3 * cached_step},
        "speedup_median_of_paired_ratios": median(ratios),
        "tower_forward_share_of_step": share,
        "step_time_reduction": reduction,
        "share_of_tower_time_removed": reduction / share,
        "share_of_tower_time_removed_per_round": removed_per_round,
        "share_of_tower_time_removed_median_of_rounds": median(removed_per_round),
        "max_abs_loss_difference": loss_diff,
        "cached_run": {k: v for k, v in runs["cached"][len(runs["cached"]) // 2].items() if k != "losses"},
        "runs": {arm: [{k: v for k, v in r.items() if k not in ("losses", "report_line")} for r in rs]
                 for arm, rs in runs.items()},
    }
    path = write_result("vision_cache", torch.device("cpu"), result, args.out)
    print(f"epoch-2 samples/s: plain {result['epoch2_samples_per_s']['plain']:.1f}, cached "
          f"{result['epoch2_samples_per_s']['cached']:.1f} (x{median(ratios):.2f}); tower share {share:.0%}, step "
          f"time -{reduction:.0%} = {reduction / share:.0%} of the tower's time; max |loss diff| {loss_diff:.2e}")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
