"""WebDataset shards: writing, read-back in pairs, rank/worker splitting, resampled epochs (bad ones: tests/faults)."""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

pytest.importorskip("webdataset")

from vlmfast.data.shards import (
    ShardDataset,
    write_shards,
)
from vlmfast.data.shards_cli import add_shards_command

N = 24


def make_folder(folder: Path, n: int = N) -> Path:
    """Solid-colour images whose grey level encodes the index, captioned 'sample i' (PNG and JPEG alternate)."""
    folder.mkdir(parents=True)
    for i in range(n):
        image = np.full((6 + i % 5, 7 + i % 3, 3), 8 * i, dtype=np.uint8)
        Image.fromarray(image).save(folder / f"img_{i}.{'png' if i % 2 else 'jpg'}")
        (folder / f"img_{i}.txt").write_text(f"sample {i}")
    return folder


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    report = write_shards(make_folder(tmp_path / "src"), tmp_path / "shards", max_count=4, progress=False)
    assert len(report.shards) == N // 4 and report.samples == N
    return tmp_path / "shards"


def caption_index(sample: dict) -> int:
    return int(sample["text"].split()[1])


def test_shards_read_back_complete_and_in_the_right_pairs(shards: Path):
    samples = list(ShardDataset(shards, seed=0))
    assert sorted(caption_index(s) for s in samples) == list(range(N))
    for sample in samples:
        i = caption_index(sample)
        assert sample["image"].dtype == torch.uint8 and sample["image"].shape == (3, 6 + i % 5, 7 + i % 3)
        assert abs(sample["image"].float().mean().item() - 8 * i) <= 2  # JPEG is lossy, solid colours nearly exact
    assert not list(shards.glob("*.part"))  # every shard was renamed into place


def test_every_sample_once_per_epoch_with_two_ranks_and_two_workers(shards: Path):
    orders = []
    for epoch in (0, 1):
        seen = []
        for rank in (0, 1):
            dataset = ShardDataset(shards, seed=7, rank=rank, world_size=2)
            dataset.set_epoch(epoch)
            seen += [caption_index(s) for s in DataLoader(dataset, batch_size=None, num_workers=2)]
        assert sorted(seen) == list(range(N)), f"epoch {epoch}: {collections.Counter(seen)}"
        orders.append(seen)
    assert orders[0] != orders[1]  # the seeded shard shuffle changes with the epoch


def test_resampled_gives_equal_batch_counts_across_ranks_where_plain_splitting_does_not(tmp_path: Path):
    # Uneven shards: 7 + 1 + 7 + 1 samples. Split by rank, rank 0 gets 14 samples and rank 1 gets 2.
    src = make_folder(tmp_path / "src", 16)
    for i, shard in enumerate((range(0, 7), range(7, 8), range(8, 15), range(15, 16))):
        part = tmp_path / f"part{i}"
        part.mkdir()
        for j in shard:
            for f in src.glob(f"img_{j}.*"):
                f.rename(part / f.name)
        write_shards(part, tmp_path / "shards", pattern=f"s{i}-%03d.tar", overwrite=True, progress=False)

    def batches_per_rank(**kwargs) -> list[int]:
        counts = []
        for rank in (0, 1):
            dataset = ShardDataset(tmp_path / "shards", rank=rank, world_size=2, shuffle_shards=False, **kwargs)
            loader = DataLoader(dataset, batch_size=2, num_workers=2, drop_last=True, collate_fn=list)
            counts.append(len(list(loader)))
        return counts

    plain = batches_per_rank()
    assert plain[0] != plain[1]  # what makes a DDP run hang at the end of an epoch
    assert batches_per_rank(resampled=True, samples_per_epoch=10, batch_size=2) == [5, 5]


def run_cli(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="vlmfast")
    add_shards_command(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(list(argv))
    return args.run(args)


def test_cli_writes_shards_from_a_jsonl_and_refuses_incomplete_input(tmp_path: Path, capsys):
    src = make_folder(tmp_path / "images", 6)
    lines = [{"image": f"images/img_{i}.{'png' if i % 2 else 'jpg'}", "text": f"sample {i}"} for i in range(6)]
    jsonl = tmp_path / "data.jsonl"
    jsonl.write_text("\n".join(json.dumps(line) for line in [*lines, {"image": "images/gone.png", "text": "x"}]))

    with pytest.raises(ValueError, match=r"data.jsonl:7: image .*gone.png not found"):
        run_cli("shards", "write", str(jsonl), str(tmp_path / "out"))
    assert not list((tmp_path / "out").glob("*.tar")) if (tmp_path / "out").exists() else True

    assert run_cli("shards", "write", str(jsonl), str(tmp_path / "out"), "--max-count", "4", "--skip-missing",
                   "--max-size", "10M") == 0
    assert "wrote 6 samples to 2 shard(s)" in capsys.readouterr().out
    assert sorted(caption_index(s) for s in ShardDataset(tmp_path / "out")) == list(range(6))
    with pytest.raises(ValueError, match=r"already holds 2 \.tar"):
        run_cli("shards", "write", str(src), str(tmp_path / "out"))
