"""Tokens/s of padded vs packed batches on a skewed length distribution, at equal real tokens.

The same samples (a tiny VLM, one image each, captions whose lengths follow a long-tailed log-normal like
instruction data: many short, a few long) are trained on twice: padded to the longest sample of each batch, and
packed into rows of ``--max-tokens`` by best-fit decreasing. Both see exactly the same real tokens (and give the same
gradient, see tests/test_packing.py); only the padding differs. Runs alternate (padded, packed, packed, padded, ...)
and the speed-up is the median of the paired ratios.

Usage::

    python benchmarks/packing.py                      # CPU
    python benchmarks/packing.py --batches 8 --batch-size 32 --repeats 5 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from _common import median, write_result

from vlmfast.common.utils import resolve_device
from vlmfast.data.packing import PackingCollator, count_packed_tokens
from vlmfast.models import TinyVLM, TinyVLMConfig, VLMCollator


def skewed_samples(n: int, max_len: int, vocab: int, seed: int) -> list[dict]:
    """Images plus captions of log-normal length (median ~48 tokens, long tail up to max_len)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.exp(torch.randn(n, generator=g) * 0.9 + 3.9).clamp(8, max_len).long()
    return [{"image": torch.randint(0, 256, (3, 48, 48), generator=g, dtype=torch.uint8),
             "input_ids": torch.randint(3, vocab, (int(length),), generator=g)} for length in lengths]


def train_pass(model, batches, device) -> float:
    """Seconds for forward+backward+AdamW over the batches (after one warm-up batch)."""
    model = copy.deepcopy(model).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    times = []
    for batch in [batches[0], *batches]:
        batch = {k: v.to(device) for k, v in batch.items()}
        start = time.perf_counter()
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return sum(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--max-len", type=int, default=500, help="longest caption (tokens)")
    parser.add_argument("--max-tokens", type=int, default=512, help="packing budget per row (image tokens included)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    config = TinyVLMConfig(text_dim=128, text_layers=2, max_text_len=args.max_len)
    torch.manual_seed(0)
    model = TinyVLM(config)
    samples = skewed_samples(args.batches * args.batch_size, args.max_len, config.vocab_size, seed=0)
    chunks = [samples[i : i + args.batch_size] for i in range(0, len(samples), args.batch_size)]
    padded = [VLMCollator()(chunk) for chunk in chunks]
    pack = PackingCollator(max_tokens=args.max_tokens, collate_fn=VLMCollator(), image_tokens=config.num_image_tokens)
    packed = [pack(chunk) for chunk in chunks]
    # Real tokens: image tokens + caption tokens, identical for both layouts.
    real = sum(int(b["attention_mask"].sum()) + config.num_image_tokens * b["input_ids"].shape[0] for b in padded)
    assert real == sum(count_packed_tokens(b) for b in packed), "padded and packed must carry the same tokens"
    slots = {"padded": sum(b["input_ids"].numel() + config.num_image_tokens * b["input_ids"].shape[0]
                           for b in padded),
             "packed": sum(b["input_ids"].numel() for b in packed)}
    runs: dict[str, list[float]] = {"padded": [], "packed": []}
    for repeat in range(args.repeats):
        for name in (["padded", "packed"] if repeat % 2 == 0 else ["packed", "padded"]):
            runs[name].append(train_pass(model, padded if name == "padded" else packed, device))
            print(f"repeat {repeat} {name:>6}: {real / runs[name][-1]:,.0f} real tokens/s", flush=True)
    ratios = [pd / pk for pd, pk in zip(runs["padded"], runs["packed"], strict=True)]
    speedup = median(ratios)
    result = {
        "benchmark": "packing",
        "model": f"tiny VLM, text_dim {config.text_dim}, {config.text_layers} text layers, 9 image tokens/sample",
        "lengths": "caption tokens ~ exp(N(3.9, 0.9)) clipped to [8, max_len]",
        "batches": args.batches, "batch_size": args.batch_size, "max_tokens": args.max_tokens,
        "repeats": args.repeats, "torch_threads": torch.get_num_threads(),
        "real_tokens": real, "token_slots": slots, "padding_fraction": {k: 1 - real / v for k, v in slots.items()},
        "rows": {"padded": sum(b["input_ids"].shape[0] for b in padded),
                 "packed": sum(b["input_ids"].shape[0] for b in packed)},
        "real_tokens_per_s": {name: real / median(values) for name, values in runs.items()},
        "run_seconds": runs, "paired_ratios": ratios, "speedup": speedup,
        "target": 1.5, "meets_target": speedup >= 1.5,
    }
    path = write_result("packing", device, result, args.out)
    print(f"packing speed-up {speedup:.2f}x at equal real tokens (target >= 1.5x), written to {path}")


if __name__ == "__main__":
    main()
