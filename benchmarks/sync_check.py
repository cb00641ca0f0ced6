"""Host-device syncs per optimizer step of the tiny VLM under OptimizedTrainer, per configuration.

On CUDA the counter sees real device tensors and also runs under ``torch.cuda.set_sync_debug_mode("warn")``, whose
warnings (syncs inside torch's own kernels, stream waits, synchronous copies) are counted separately; on CPU the
accelerator is simulated by tagging (see vlmfast/profiling/host_syncs.py). The budget of issue 18: 1 read per step in
the default path, at most 2 with packing, device prefetch, the token budget or the OOM fallback; on CUDA for the
larger of vlmfast's reads and torch's own count; the chunked cross-entropy adds one read per micro-batch (the
count of tokens it keeps).

Usage::

    python benchmarks/sync_check.py                       # every configuration, on the GPU when there is one
    python benchmarks/sync_check.py --steps 3 --configs default packing --out /tmp/syncs.json
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import torch
from _common import write_result

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.common.utils import resolve_device
from vlmfast.models import build_tiny_vlm_task
from vlmfast.testing import count_host_syncs

CONFIGS: dict[str, tuple[dict[str, Any], int]] = {  # name -> (spec overrides, budget per step)
    "default": ({"grad_clip": 1.0}, 1),
    "packing": ({"packing": {"enabled": True, "max_tokens": 256}}, 2),
    "device_prefetch": ({"data": {"device_prefetch": True}}, 2),
    "oom_fallback": ({"oom": {"enabled": True}}, 2),
    "bf16": ({"precision": "bf16"}, 1),
    "token_budget": ({"micro_batch_tokens": 512}, 2),
    # the chunked loss reads how many tokens it keeps (a nonzero) once per micro-batch: 1 + 2 here
    "chunked_ce": ({"linear_cross_entropy": {"enabled": True}}, 3),
}


def count(name: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    overrides, budget = CONFIGS[name]
    model, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=args.steps * args.batch_size)
    spec = TrainSpec(**{"max_steps": args.steps, "batch_size": args.batch_size,
                        "micro_batch_size": args.batch_size // 2, "device": str(device), "seed": 0,
                        "log": {"progress": "off"}, **overrides})
    start = time.perf_counter()
    with count_host_syncs(device=device) as syncs:
        OptimizedTrainer(model, dataset, spec, collate_fn=collate, callbacks=[syncs]).fit()
    steady = syncs.per_step[1:] or syncs.per_step
    # On CUDA torch's sync debug mode sees every sync, vlmfast's reads and torch's own kernels' (nonzero, copies to
    # the host, stream waits): the budget holds for the larger of the two counts.
    torch_steady = syncs.torch_per_step[1:] or syncs.torch_per_step
    worst = max([*steady, *torch_steady])
    return {"budget_per_step": budget, "per_step": syncs.per_step, "steady_max": max(steady),
            "torch_per_step": syncs.torch_per_step, "torch_steady_max": max(torch_steady, default=0),
            "within_budget": worst <= budget, "cuda_sync_warnings": syncs.cuda_warnings,
            "async_host_copies": len(syncs.async_host_copies), "report": syncs.report().splitlines(),
            "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(CONFIGS))
    parser.add_argument("--device", default="auto")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = resolve_device(args.device)
    results = {}
    for name in args.configs:
        if name == "bf16" and device.type == "cpu":
            continue  # the same path as default on CPU
        results[name] = count(name, args, device)
        r = results[name]
        torch_count = r["torch_per_step"] if device.type == "cuda" else "n/a (CUDA only)"
        print(f"{name}: {r['per_step']} host reads per step, torch's sync debug mode {torch_count} "
              f"(budget {r['budget_per_step']}: {'within' if r['within_budget'] else 'OVER'})", flush=True)
    path = write_result("sync_check", device, {"steps": args.steps, "batch_size": args.batch_size,
                                               "configs": results}, args.out)
    print(f"written: {path}")


if __name__ == "__main__":
    main()
