"""Corrupt WebDataset shards: a truncated tar, an undecodable image are skipped and counted (no sleeps); past
`max_bad_fraction` an error names the shard. Needs the optional webdataset package (skipped without it).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torch.utils.data import DataLoader

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.data.bad_samples import TooManyBadSamplesError
from vlmfast.models import ShapesCaptionDataset, ShapesTokenizer, TinyVLM, TinyVLMConfig, VLMCollator

pytest.importorskip("webdataset")
from vlmfast.data.shards import CaptionTokens, ShardDataset, write_shards


def image_folder(folder: Path, n: int, broken: tuple[int, ...] = ()) -> Path:
    """Solid-colour images captioned 'sample i' (PNG and JPEG alternate); `broken` ones are not images."""
    folder.mkdir(parents=True)
    for i in range(n):
        path = folder / f"img_{i}.{'png' if i % 2 else 'jpg'}"
        Image.fromarray(np.full((6 + i % 5, 7 + i % 3, 3), 8 * i, dtype=np.uint8)).save(path)
        if i in broken:
            path.write_bytes(b"not an image")
        (folder / f"img_{i}.txt").write_text(f"sample {i}")
    return folder


def test_truncated_tar_and_undecodable_image_are_skipped_counted_and_the_run_finishes(tmp_path: Path, monkeypatch):
    dataset = ShapesCaptionDataset(num_samples=40, seed=0)
    src = tmp_path / "src"
    src.mkdir()
    for i in range(40):
        Image.fromarray(dataset[i]["image"].permute(1, 2, 0).numpy()).save(src / f"s{i}.png")
        (src / f"s{i}.txt").write_text(dataset.scene(i).caption())
    (src / "s3.png").write_bytes(b"\x89PNG\r\n\x1a\n this is not an image")
    report = write_shards(src, tmp_path / "shards", max_count=10, progress=False)
    broken = report.shards[1]
    broken.write_bytes(broken.read_bytes()[: broken.stat().st_size // 2])  # cut mid-sample

    sleeps = []
    monkeypatch.setattr(time, "sleep", lambda s: sleeps.append(s))
    shards = ShardDataset(tmp_path / "shards", to_sample=CaptionTokens(ShapesTokenizer()), max_bad_fraction=0.2)
    config = TinyVLMConfig(vision_dim=16, vision_layers=1, text_dim=32, text_layers=1, vision_heads=2, text_heads=2)
    spec = TrainSpec(max_steps=20, batch_size=2, device="cpu", log={"progress": "off"}, memory={"leak_check": False})
    result = OptimizedTrainer(TinyVLM(config), shards, spec, collate_fn=VLMCollator(image_size=48)).fit()

    assert len(result.history) == 20 and all(np.isfinite(m["loss"]) for m in result.history)
    counts = shards.counts()
    assert counts["bad"] >= 2  # the undecodable image + at least one error from the truncated shard
    assert counts["samples"] >= 40  # more than one epoch: every shard was read
    assert sleeps == []  # never webdataset's warn_and_continue 0.5 s per bad sample


def test_too_many_bad_samples_stop_with_the_shard_named(tmp_path: Path):
    write_shards(
        image_folder(tmp_path / "src", 8, broken=(0, 2, 4, 6)), tmp_path / "shards", max_count=4, progress=False
    )
    loader = DataLoader(ShardDataset(tmp_path / "shards", max_bad_fraction=0.01), batch_size=None, num_workers=2)
    with pytest.raises(TooManyBadSamplesError, match=r"(?s)above max_bad_fraction.*shard-00000\d\.tar"):
        list(loader)


def test_bad_samples_in_shards_are_counted_across_workers(tmp_path: Path):
    write_shards(image_folder(tmp_path / "src", 16, broken=(1, 9)), tmp_path / "shards", max_count=4, progress=False)
    dataset = ShardDataset(tmp_path / "shards", max_bad_fraction=0.5)
    assert len(list(DataLoader(dataset, batch_size=None, num_workers=2))) == 14
    assert dataset.counts() == {"samples": 14, "bad": 2}
