"""Micro-batches by token budget against the fixed micro-batch size that fits the longest sample, on CPU.

Usage::

    python benchmarks/token_budget.py                 # tiny VLM, long-tailed batches (8-512 text tokens, 0-8 images)
    python benchmarks/token_budget.py --rounds 2 --batches 2 --out /tmp/tokens.json   # a quick look

The data is the seed's VLM length distribution scaled down by 16: text log-normal in 8..512 tokens (median ~43),
0 to 8 images of 9 tokens each (``vlmfast.models.long_tail``), collated into padded rows with the images laid out per
row. The budget is ``--tokens`` (default 2048) per micro-batch; the fixed micro-batch size is the largest that keeps
the longest possible sample within the same budget (``tokens // longest cost``), split from the padded batch as
``micro_batch_size`` does. Both run forward + backward of every micro-batch of ``--batches`` optimizer batches of
``--batch-size`` samples, then an SGD step; rounds interleave the two (fixed, tokens, fixed, ...), medians reported.

Reported per variant: real tokens/s (attention-mask tokens, image placeholders included, over the wall time),
micro-batches per step, and the peak bytes saved for backward by any micro-batch, next to the budget's share: what
N tokens of text keep (text costs the most per token: an image costs its placeholders plus 9 patches, and keeps
less than that many text tokens would).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, write_result

from vlmfast.hooks import TokenBudget, accumulate_gradients, saved_tensor_bytes
from vlmfast.models.long_tail import collate_per_row_images, long_tailed_samples
from vlmfast.models.tiny_vlm import TinyVLM, TinyVLMConfig
from vlmfast.strategies.token_budget import image_token_cost


def _batches(args: argparse.Namespace) -> list[tuple[list[dict[str, Any]], dict[str, torch.Tensor]]]:
    out = []
    for i in range(args.batches):
        samples = long_tailed_samples(args.batch_size, max_text=args.max_text, seed=100 + i)
        out.append((samples, collate_per_row_images(samples)))
    return out


def _step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: dict[str, torch.Tensor], size: Any) -> None:
    accumulate_gradients(model, batch, size)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _peak_saved(model: torch.nn.Module, micro_batches: list[dict[str, torch.Tensor]]) -> int:
    return max(saved_tensor_bytes(lambda mb=mb: model(**mb).loss) for mb in micro_batches)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048, help="micro_batch_tokens")
    parser.add_argument("--max-text", type=int, default=512)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--batches", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    config = TinyVLMConfig(vocab_size=64, max_text_len=args.max_text + 8 * 9)
    model = TinyVLM(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    per_image = image_token_cost(model)  # the placeholders are in input_ids; the vision tower's 9 patches are not
    longest = args.max_text + 8 * 9 + 8 * per_image  # the costliest sample the distribution can produce
    fixed = max(args.tokens // longest, 1)
    budget = TokenBudget(args.tokens, image_tokens=per_image)
    batches = _batches(args)
    real_tokens = sum(int(b["attention_mask"].sum()) for _, b in batches)

    # Memory: each variant's costliest micro-batch, and the budget's share.
    from vlmfast.data.batch import split_batch

    saved: dict[str, list[int]] = {"fixed": [], "tokens": []}
    for _, batch in batches:
        saved["fixed"].append(_peak_saved(model, split_batch(batch, fixed)))
        saved["tokens"].append(_peak_saved(model, budget.split(batch)))
    # The budget's share: what N tokens of text keep (rows of at most max_text tokens, N in all).
    rows = -(-args.tokens // args.max_text)
    text = [{"input_ids": torch.randint(3, 64, (args.tokens // rows,)), "images": torch.zeros(0, 3, 48, 48)}
            for _ in range(rows)]
    text_batch = collate_per_row_images([{**t, "labels": t["input_ids"]} for t in text])
    share = saved_tensor_bytes(lambda: model(**text_batch).loss)

    times: dict[str, list[float]] = {"fixed": [], "tokens": []}
    micro_batches = {"fixed": sum(len(split_batch(b, fixed)) for _, b in batches) / len(batches),
                     "tokens": sum(len(budget.split(b)) for _, b in batches) / len(batches)}
    _step(model, optimizer, batches[0][1], budget)  # warm-up (allocator, kernels)
    for round_ in range(args.rounds):
        for variant, size in (("fixed", fixed), ("tokens", budget)):
            start = time.perf_counter()
            for _, b in batches:
                _step(model, optimizer, b, size)
            times[variant].append(time.perf_counter() - start)
            print(f"round {round_ + 1} {variant}: {times[variant][-1]:.2f} s", flush=True)
    summary: dict[str, Any] = {
        variant: {"real_tokens_per_s": real_tokens / median(times[variant]),
                  "seconds_per_round": median(times[variant]),
                  "micro_batches_per_step": micro_batches[variant],
                  "peak_saved_mb_per_micro_batch": max(saved[variant]) / 2**20}
        for variant in times}
    summary["fixed"]["micro_batch_size"] = fixed
    summary["budget_share_saved_mb"] = share / 2**20
    summary["tokens_peak_over_share_per_batch"] = [t / share for t in saved["tokens"]]
    summary["speedup"] = summary["tokens"]["real_tokens_per_s"] / summary["fixed"]["real_tokens_per_s"]
    summary["load_average_1m"] = psutil.getloadavg()[0]
    cfg = {k: getattr(args, k) for k in ("tokens", "max_text", "batch_size", "batches", "rounds", "threads")}
    cfg.update(longest_cost=longest, image_tokens_charged=per_image, real_tokens_per_round=real_tokens)
    path = write_result("token_budget", torch.device("cpu"), {"config": cfg, "summary": summary, "times": times},
                        args.out)
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
