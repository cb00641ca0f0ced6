"""Loader cost of micro-batches of samples: the batch collated whole (before) vs. as a SampleBatch (now).

The loader now collates each micro-batch from its samples (in the workers) and hands the samples over too, so a
micro-batch can be collated again after the OOM fallback changes the size. This measures what that costs on the
loader side: seconds per ``next(loader)`` for the built-in tiny VLM (its own collator) and for the zoo's Qwen2-VL
(its real processor), with ``num_workers`` 0 and 2: whole-batch collation vs. samples with micro-batches of 16 (the
default: one micro-batch) and of 4 (batch 16). Rounds are interleaved; figures are medians over rounds.

Usage::

    python benchmarks/micro_batches.py --rounds 5 --batches 20 --threads 1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

import torch
from _common import median, write_result

from vlmfast.data.loader import ResumableLoader
from vlmfast.models import build_tiny_vlm_task
from vlmfast.spec import DataSpec


def datasets() -> dict[str, tuple[Any, Any]]:
    """name -> (samples, collate_fn)."""
    _, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=256)
    out = {"tiny_vlm": (dataset, collate)}
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    try:
        import transformers
        from zoo import build_case

        transformers.logging.set_verbosity_error()
        case = build_case("qwen2_vl")
        out["qwen2_vl"] = ([case.samples[i % len(case.samples)] for i in range(256)], case.collate_fn)
    except ImportError:
        pass
    return out


def seconds_per_batch(data: Any, collate: Any, workers: int, micro_batch_size: int | None, batches: int) -> float:
    spec = DataSpec(num_workers=workers, shuffle=False, persistent_workers=workers > 0)
    loader = ResumableLoader(data, 16, spec, seed=0, collate_fn=collate, micro_batch_size=micro_batch_size)
    next(loader)  # workers started, first batch in
    start = time.perf_counter()
    for _ in range(batches):
        next(loader)
    return (time.perf_counter() - start) / batches


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, default=20)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {}
    for name, (data, collate) in datasets().items():
        for workers in (0, 2):
            variants = {"whole": None, "samples_mbs16": 16, "samples_mbs4": 4}
            times: dict[str, list[float]] = {k: [] for k in variants}
            for _ in range(args.rounds):
                for key, size in variants.items():
                    times[key].append(seconds_per_batch(data, collate, workers, size, args.batches))
            row = {k: median(v) * 1e3 for k, v in times.items()}
            row.update({f"ratio_{k}": row[k] / row["whole"] for k in variants if k != "whole"})
            result[f"{name}/workers={workers}"] = row
            print(f"{name:10s} workers={workers}: ms/batch whole {row['whole']:.2f}, samples at mbs 16 "
                  f"{row['samples_mbs16']:.2f} (x{row['ratio_samples_mbs16']:.2f}), at mbs 4 {row['samples_mbs4']:.2f} "
                  f"(x{row['ratio_samples_mbs4']:.2f})", flush=True)
    write_result("micro_batches", torch.device("cpu"), result, args.out)


if __name__ == "__main__":
    main()
