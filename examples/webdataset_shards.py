"""A WebDataset shard pipeline: images + captions on disk -> tar shards -> training, with bad-sample counting.

1. writes `samples` generated shape images (PNG) with same-name .txt captions into WORKDIR/images/;
2. packs them into tar shards with ``vlmfast.data.shards.write_shards`` (``vlmfast shards write`` on the command line);
3. trains the tiny VLM from the shards with ``ShardDataset`` (split by rank, then by DataLoader worker; bad samples
   skipped and counted, past ``data.max_bad_sample_fraction`` the run stops).

Usage: python examples/webdataset_shards.py [--steps 50] [--workdir shards_demo] [--samples 512]
"""

from __future__ import annotations

import argparse
from pathlib import Path

from PIL import Image

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.data.shards import CaptionTokens, ShardDataset, write_shards
from vlmfast.models import ShapesCaptionDataset, ShapesTokenizer, build_tiny_vlm_task


def write_images(folder: Path, samples: int) -> None:
    """Generated shape scenes as PNG files with their captions as .txt files (the layout `shards write` reads)."""
    folder.mkdir(parents=True, exist_ok=True)
    dataset = ShapesCaptionDataset(num_samples=samples, seed=0)
    for i in range(samples):
        sample = dataset[i]
        Image.fromarray(sample["image"].permute(1, 2, 0).numpy()).save(folder / f"{i:06d}.png")
        (folder / f"{i:06d}.txt").write_text(dataset.tokenizer.decode(sample["input_ids"]))


def main(steps: int = 50, workdir: str = "shards_demo", samples: int = 512) -> float:
    """Write images and shards under `workdir` (once), then train `steps` steps from the shards; returns the loss."""
    root = Path(workdir)
    shards = root / "shards"
    if not any(shards.glob("*.tar")):
        write_images(root / "images", samples)
        report = write_shards(root / "images", shards, max_count=max(samples // 4, 1), progress=False)
        print(report.summary())                      # same as: vlmfast shards write images/ shards/ --max-count N
    dataset = ShardDataset(shards, to_sample=CaptionTokens(ShapesTokenizer()), seed=0, shuffle_buffer=64)
    model, _, collate = build_tiny_vlm_task(seed=0, num_samples=1)
    spec = TrainSpec(max_steps=steps, batch_size=16, optimizer={"lr": 2e-3}, data={"max_bad_sample_fraction": 0.01},
                     log={"progress": "off"})
    result = OptimizedTrainer(model, dataset, spec, collate_fn=collate).fit()
    print("samples read / bad:", dataset.counts())
    return result.history[-1]["loss"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--workdir", default="shards_demo")
    parser.add_argument("--samples", type=int, default=512)
    args = parser.parse_args()
    print(f"final loss {main(args.steps, args.workdir, args.samples):.4f}")
