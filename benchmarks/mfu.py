"""MFU and step-time breakdown of a VLM-shaped model, and what the phase timer itself costs.

Measures, in a plain loop driven by vlmfast.profiling.RunProfiler: model FLOPs per step (FlopCounterMode on the first
batch, and the analytic 6N + attention formula for comparison), achieved TFLOP/s, MFU against the device's peak at
the run's precision (table in vlmfast.profiling.flops; none on CPU), and the share of each phase. Then the overhead
of timing: runs with the timer off, timing every 10th step, and timing every step, alternated, median of medians.

Usage::

    python benchmarks/mfu.py                                  # the built-in tiny VLM (CPU or GPU)
    python benchmarks/mfu.py --size base --precision bf16     # ~150M-parameter VLM-like model (meant for a GPU)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import time

import torch
from _common import median, write_result

from vlmfast.common.utils import resolve_device
from vlmfast.data.batch import move_to_device
from vlmfast.models import TinyVLM, TinyVLMConfig, build_tiny_vlm_task
from vlmfast.profiling import RunProfiler, analytic_flops
from vlmfast.spec import ProfileSpec

SIZES = {
    "tiny": {},  # the default TinyVLMConfig
    # ViT-B/16-like tower on 224 px images (196 tokens) + a 12-layer 768-d decoder: ~150M parameters with the head
    "base": {"image_size": 224, "patch_size": 16, "vision_dim": 768, "vision_layers": 12, "vision_heads": 12,
             "text_dim": 768, "text_layers": 12, "text_heads": 12, "max_text_len": 64},
}


def run(model, batches, device, precision: str, profile: ProfileSpec | None, steps: int) -> tuple[float, dict]:
    """Train `steps` steps; returns the median step time and the profiler's summary (empty without profiler)."""
    model = copy.deepcopy(model).to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda" or None)
    profiler = RunProfiler(profile, model, device, precision=precision) if profile else None
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    times = []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        if profiler:
            profiler.begin_step(step)
        host = batches[step % len(batches)]
        batch = move_to_device(host, device)
        with profiler.count_flops(host) if profiler else contextlib.nullcontext():
            with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
                loss = model(**batch).loss
            loss.backward()
        if profiler:
            profiler.add_flops(host)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if profiler:
            profiler.end_step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    summary = {}
    if profiler:
        profiler.finish()
        summary = dict(profiler.summary)
        summary["measured_flops_per_step"] = profiler.flops.flops(batches[0])
    return median(times[3:]), summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="tiny")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device("auto")
    torch.manual_seed(0)
    config = TinyVLMConfig(**SIZES[args.size])
    _, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=args.batch_size * 8)
    if args.size != "tiny":  # same captions, images resized to the bigger tower's resolution
        def collate_big(samples, inner=collate):
            batch = inner(samples)
            batch["pixel_values"] = torch.nn.functional.interpolate(batch["pixel_values"], size=config.image_size)
            return batch
        collate = collate_big
    model = TinyVLM(config)
    batches = [collate([dataset[i] for i in range(k * args.batch_size, (k + 1) * args.batch_size)]) for k in range(8)]

    _, summary = run(model, batches, device, args.precision, ProfileSpec(every_steps=1, warmup_steps=3), args.steps)
    overhead: dict[str, list[float]] = {"off": [], "every_10": [], "every_1": []}
    for _ in range(args.repeats):
        overhead["off"].append(run(model, batches, device, args.precision, None, args.steps)[0])
        for every in (10, 1):
            spec = ProfileSpec(every_steps=every, warmup_steps=3)
            overhead[f"every_{every}"].append(run(model, batches, device, args.precision, spec, args.steps)[0])
    off = median(overhead["off"])
    params = sum(p.numel() for p in model.parameters())
    result = {
        "benchmark": "mfu",
        "model": f"TinyVLM size={args.size} ({params / 1e6:.1f}M parameters), {args.precision}",
        "batch_size": args.batch_size,
        "steps": args.steps,
        "measured_flops_per_step": summary.get("measured_flops_per_step"),
        "analytic_flops_per_step": analytic_flops(model, batches[0]),
        "tflops": summary.get("perf/tflops"),
        "mfu": summary.get("perf/mfu"),
        "peak_tflops": summary.get("perf/peak_tflops"),
        "step_time_p50_s": summary.get("perf/step_time_p50"),
        "shares": {k.removeprefix("perf/").removesuffix("_share"): v for k, v in summary.items()
                   if k.endswith("_share")},
        "timer_overhead": {key: {"median_step_s": median(v), "vs_off": median(v) / off - 1}
                           for key, v in overhead.items()},
    }
    print(write_result(f"mfu_{args.size}", device, result, args.out))
    print({k: v for k, v in result.items() if k != "shares"})


if __name__ == "__main__":
    main()
