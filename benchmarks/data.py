"""Data-loading benchmark: a loader-bound tiny-VLM run (real JPEG/PNG decode + resize) before and after tuning.

Image files are generated on the fly with PIL (shapes scenes, half JPEG, half PNG) and read back by a plain
map-style dataset that decodes with PIL; the collator resizes and normalises (as VLMCollator does). Variants:

- ``default``: the DataLoader as most loops start: ``num_workers 0`` (decode and resize in the training process);
- ``tuned``: ``num_workers: auto`` (measured at start, within the budget), ``persistent_workers``,
  ``prefetch_factor 4``, ``device_prefetch``;
- ``tuned_draft``: the tuned settings, JPEGs decoded in PIL's draft mode at the smallest DCT scale that is still
  >= the model's 48 px (``decode_image(data, draft_size=48)``; PNGs decode in full as before);
- ``tuned_shards``: the tuned settings reading the same files from WebDataset shards (``ShardDataset``, full decode).

Runs are interleaved (default, tuned, tuned_shards, then reversed, ...); each run drops its warm-up steps; the
figures are medians over repeats of each run's data-wait share (time in ``next(loader)`` / step time) and
samples/s. The worker autotune happens before the first step and is reported separately.

Usage::

    python benchmarks/data.py                       # CPU (or the GPU when there is one)
    python benchmarks/data.py --steps 60 --repeats 5 --images 512 --threads 1
"""

from __future__ import annotations

import argparse
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

import torch
from _common import median, write_result
from torch.utils.data import Dataset

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.common.utils import resolve_device
from vlmfast.data.prefetch import device_batches
from vlmfast.data.shards import CaptionTokens, ShardDataset, decode_image, write_shards
from vlmfast.models import ShapesCaptionDataset, ShapesTokenizer, TinyVLM, VLMCollator


class ImageFileDataset(Dataset):
    """Image files + captions: every access reads and decodes the file (what a real VLM dataset does)."""

    def __init__(self, items: list[tuple[Path, str]], draft_size: int | None = None) -> None:
        self.items = items
        self.draft_size = draft_size
        self.tokenizer = ShapesTokenizer()

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict[str, Any]:
        path, caption = self.items[index]
        image = decode_image(path.read_bytes(), self.draft_size)
        return {"image": image, "input_ids": torch.tensor(self.tokenizer.encode(caption))}


def generate_files(folder: Path, count: int, min_size: int, max_size: int) -> list[tuple[Path, str]]:
    """Shapes scenes rendered at min_size..max_size px, saved alternately as JPEG (quality 90) and PNG."""
    from PIL import Image

    scenes = ShapesCaptionDataset(num_samples=count, seed=0, min_image_size=min_size, max_image_size=max_size)
    items = []
    for i in range(count):
        path = folder / f"img_{i:05d}.{'jpg' if i % 2 == 0 else 'png'}"
        Image.fromarray(scenes[i]["image"].permute(1, 2, 0).numpy()).save(path, quality=90)
        caption = scenes.scene(i).caption()
        path.with_suffix(".txt").write_text(caption)
        items.append((path, caption))
    return items


DATA_SETTINGS = {
    "default": {},
    "tuned": {"num_workers": "auto", "persistent_workers": True, "prefetch_factor": 4, "device_prefetch": True},
}


def run(variant: str, data: Any, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    settings = dict(DATA_SETTINGS["tuned" if variant.startswith("tuned") else "default"])
    if variant.startswith("tuned"):
        settings.update(autotune_budget_s=args.autotune_budget, autotune_max_workers=args.max_workers)
    spec = TrainSpec(max_steps=args.steps, batch_size=args.batch_size, device=str(device), seed=0,
                     log={"progress": "off"}, memory={"leak_check": False, "timeline_plot": False},
                     data={"shuffle": True, **settings})
    model = TinyVLM()
    trainer = OptimizedTrainer(model, data, spec, collate_fn=VLMCollator(image_size=model.config.image_size))
    if not hasattr(trainer.loader, "source"):  # the trainer does not wrap its loader itself yet: the same one line
        trainer.loader = device_batches(trainer.loader, spec.data, trainer.device)
    history = trainer.fit().history[args.warmup:]
    step_time = sum(m["step_time"] for m in history)
    resumable = getattr(trainer.loader, "source", trainer.loader)  # under a DevicePrefetcher once it is wired in
    return {"data_wait_share": sum(m["data_time"] for m in history) / step_time,
            "samples_per_s": sum(m["samples"] for m in history) / step_time,
            "num_workers": resumable.loader.num_workers,
            "autotune": resumable.autotune.as_dict() if resumable.autotune is not None else None}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=384)
    parser.add_argument("--min-size", type=int, default=160, help="smallest generated image side (px)")
    parser.add_argument("--max-size", type=int, default=256, help="largest generated image side (px)")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--autotune-budget", type=float, default=4.0)
    parser.add_argument("--max-workers", type=int, default=None)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--no-shards", action="store_true", help="skip the WebDataset variant")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    load_before = os.getloadavg()  # other processes on the machine compete with the workers for CPU
    with tempfile.TemporaryDirectory() as tmp:
        images = Path(tmp) / "images"
        images.mkdir()
        items = generate_files(images, args.images, args.min_size, args.max_size)
        target = TinyVLM().config.image_size
        sources: dict[str, Any] = {"default": ImageFileDataset(items), "tuned": ImageFileDataset(items),
                                   "tuned_draft": ImageFileDataset(items, draft_size=target)}
        if not args.no_shards:
            write_shards(images, Path(tmp) / "shards", max_count=max(1, args.images // 16),
                         progress=False)
            sources["tuned_shards"] = ShardDataset(Path(tmp) / "shards", to_sample=CaptionTokens(ShapesTokenizer()),
                                                   seed=0, shuffle_buffer=64)
        runs: dict[str, list[dict[str, Any]]] = {name: [] for name in sources}
        for repeat in range(args.repeats):
            order = list(sources) if repeat % 2 == 0 else list(reversed(sources))
            for name in order:
                runs[name].append(run(name, sources[name], args, device))
                last = runs[name][-1]
                print(f"repeat {repeat} {name:>12}: data wait {last['data_wait_share']:.1%} of step time, "
                      f"{last['samples_per_s']:.1f} samples/s, {last['num_workers']} workers", flush=True)
    summary = {name: {"data_wait_share": median([r["data_wait_share"] for r in values]),
                      "samples_per_s": median([r["samples_per_s"] for r in values]),
                      "num_workers": [r["num_workers"] for r in values]}
               for name, values in runs.items()}
    tuned_wait = summary["tuned"]["data_wait_share"]
    result = {
        "benchmark": "data",
        "model": "tiny VLM (built-in), fp32, batch of files decoded with PIL and resized to 48 px",
        "images": args.images, "image_sizes_px": [args.min_size, args.max_size], "formats": "half JPEG q90, half PNG",
        "steps_per_run": args.steps, "warmup_steps_dropped": args.warmup, "repeats": args.repeats,
        "batch_size": args.batch_size, "torch_threads": torch.get_num_threads(),
        "load_average_1_5_15min": {"before": load_before, "after": os.getloadavg()},
        "settings": DATA_SETTINGS,
        "median": summary,
        # Machine load drifts between repeats: the speed-up is the median of per-repeat ratios, not a ratio of medians.
        "paired_speedup_vs_default": {name: median([r["samples_per_s"] / d["samples_per_s"]
                                                    for r, d in zip(values, runs["default"], strict=True)])
                                      for name, values in runs.items() if name != "default"},
        "runs": runs,
        "target": "data wait < 5 % of step time with the tuned settings",
        "meets_target": tuned_wait < 0.05,
    }
    path = write_result("data", device, result, args.out)
    for name, figures in summary.items():
        print(f"{name:>12}: data wait {figures['data_wait_share']:.1%}, {figures['samples_per_s']:.1f} samples/s")
    print(f"tuned data wait {tuned_wait:.1%} (target < 5 %), written to {path}")


if __name__ == "__main__":
    main()
