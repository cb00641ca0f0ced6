"""Gradient communication per DDP step: bytes each rank all-reduces and step time, no hook vs fp16 vs PowerSGD.

Runs one process per GPU with NCCL when there are GPUs (then bf16 too), else 2 gloo processes on the CPU. Bytes
are counted by vlmfast's CommCounter (the payload each rank hands to all-reduce, per step, once PowerSGD has
started); step time is the median over the steps after the first compressed one (which allocates P, Q and the
error buffers), pooled over interleaved repeats. Models: the built-in tiny VLM and a ~100M-parameter stack of
square nn.Linear layers.

Usage::

    python benchmarks/comm.py                          # 2 gloo processes on CPU, or NCCL on every GPU
    python benchmarks/comm.py --big-steps 8 --big-width 4096 --big-layers 6 --out /tmp/comm.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from _common import median, write_result
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from vlmfast.engines.comm_hooks import batched_powersgd_supported, count_bytes
from vlmfast.models import build_tiny_vlm_task

VARIANTS: dict[str, dict[str, Any]] = {
    "none": {},
    "fp16": {"hook": "fp16"},
    "powersgd_r1": {"hook": "powersgd", "rank": 1},
    "powersgd_r2": {"hook": "powersgd", "rank": 2},
    "powersgd_r4": {"hook": "powersgd", "rank": 4},
}
NCCL_ONLY = {"bf16": {"hook": "bf16"}}  # DDP refuses bf16 hooks without NCCL
BATCHED = {"batched_powersgd_r1": {"hook": "batched_powersgd", "rank": 1}}  # broken in some torch versions


def variants(backend: str) -> dict[str, dict[str, Any]]:
    """The hooks to compare on this backend and torch."""
    chosen = dict(VARIANTS)
    if backend == "nccl":
        chosen.update(NCCL_ONLY)
    if batched_powersgd_supported():
        chosen.update(BATCHED)
    return chosen


# ---- models: the module and its loss on one fixed batch for this rank ------------------------------------------
Loss = Callable[[nn.Module], torch.Tensor]


def tiny_vlm(args: argparse.Namespace, rank: int, device: torch.device) -> tuple[nn.Module, Loss]:
    model, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=args.batch_size * 2)
    batch = collate([dataset[rank * args.batch_size + i] for i in range(args.batch_size)])
    batch = {k: v.to(device) for k, v in batch.items()}
    return model, lambda m: m(**batch).loss


def linear_stack(args: argparse.Namespace, rank: int, device: torch.device) -> tuple[nn.Module, Loss]:
    layers: list[nn.Module] = []
    for _ in range(args.big_layers):
        layers += [nn.Linear(args.big_width, args.big_width), nn.ReLU()]
    model = nn.Sequential(*layers[:-1])
    x = torch.randn(args.big_batch, args.big_width, generator=torch.Generator().manual_seed(rank)).to(device)
    return model, lambda m: m(x).pow(2).mean()


MODELS = {"tiny_vlm": tiny_vlm, "linear_stack": linear_stack}


# ---- one process ------------------------------------------------------------------------------------------------
def run_variant(model_name: str, options: dict[str, Any], args, rank: int, device: torch.device) -> dict[str, Any]:
    """Train `steps` SGD steps with one hook; per-step bytes and times."""
    torch.manual_seed(0)
    model, loss_fn = MODELS[model_name](args, rank, device)
    ddp = DistributedDataParallel(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    if "powersgd" in options.get("hook", ""):
        options = {**options, "start_iter": args.start_iter}
    counter = count_bytes(ddp, **options)
    optimizer = torch.optim.SGD(ddp.parameters(), lr=args.lr)  # stateless: keeps the 100M model's memory small
    steps = args.steps if model_name == "tiny_vlm" else args.big_steps
    sent, times, losses = [], [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss = loss_fn(ddp)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
        sent.append(counter.take())
        losses.append(loss.item())
    return {"params": sum(p.numel() for p in model.parameters()), "bytes_per_step": sent, "step_s": times,
            "loss_first": losses[0], "loss_last": losses[-1]}


def worker(rank: int, world: int, backend: str, rendezvous: str, args: argparse.Namespace, out: str) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.distributed.init_process_group(backend, init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    torch.set_num_threads(args.threads)
    try:
        results: dict[str, dict[str, Any]] = {}
        for repeat in range(args.repeats):
            # Alternate the order between repeats so drift on a shared machine hits every hook alike.
            order = list(variants(backend).items())[:: 1 if repeat % 2 == 0 else -1]
            for model_name in MODELS:
                for name, options in order:
                    run = run_variant(model_name, options, args, rank, device)
                    key = f"{model_name}/{name}"
                    if key in results:  # same bytes every repeat: keep the first run, pool the step times
                        results[key]["step_s"] += run["step_s"]
                    else:
                        results[key] = run
                    if rank == 0:
                        print(f"repeat {repeat} {key:>32}: {run['bytes_per_step'][-1]:>12,} bytes/step, median "
                              f"{median(run['step_s'][args.start_iter + 1:] or run['step_s']) * 1e3:8.1f} ms",
                              flush=True)
        if rank == 0:
            Path(out).write_text(json.dumps(results))
    finally:
        torch.distributed.destroy_process_group()


# ---- summary ----------------------------------------------------------------------------------------------------
def summarise(raw: dict[str, dict[str, Any]], start_iter: int) -> dict[str, dict[str, Any]]:
    """Steady-state bytes (last step), plain-phase bytes, median step time after the first compressed step."""
    table = {}
    for key, run in raw.items():
        model_name = key.split("/")[0]
        baseline = raw[f"{model_name}/none"]["bytes_per_step"][-1]
        steps = len(run["bytes_per_step"])
        timed = [t for i, t in enumerate(run["step_s"]) if i % steps > start_iter]  # per repeat, after the first
        table[key] = {
            "params": run["params"],
            "bytes_per_step": run["bytes_per_step"][-1],
            "bytes_per_step_before_start_iter": run["bytes_per_step"][0],
            "vs_no_hook": run["bytes_per_step"][-1] / baseline,
            "median_step_s": median(timed),
            "timed_steps": len(timed),
            "loss_first": run["loss_first"],
            "loss_last": run["loss_last"],
        }
    return table


def print_table(table: dict[str, dict[str, Any]]) -> None:
    print(f"\n| {'model / hook':<34} | {'bytes/step/rank':>15} | {'vs none':>8} | {'step ms':>9} |")
    print(f"|{'-' * 36}|{'-' * 17}|{'-' * 10}|{'-' * 11}|")
    for key, row in table.items():
        print(f"| {key:<34} | {row['bytes_per_step']:>15,} | {row['vs_no_hook']:>7.4f}x |"
              f" {row['median_step_s'] * 1e3:>9.1f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="steps per hook on the tiny VLM")
    parser.add_argument("--big-steps", type=int, default=6, help="steps per hook on the ~100M linear stack")
    parser.add_argument("--start-iter", type=int, default=2, help="PowerSGD's plain all-reduce steps (>= 2)")
    parser.add_argument("--batch-size", type=int, default=16, help="tiny VLM samples per rank")
    parser.add_argument("--big-width", type=int, default=4096)
    parser.add_argument("--big-layers", type=int, default=6, help="6 x Linear(4096, 4096) = 100.7M parameters")
    parser.add_argument("--big-batch", type=int, default=8)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--repeats", type=int, default=2, help="runs per hook, interleaved; step times pooled")
    parser.add_argument("--world-size", type=int, default=None,
                        help="processes (default: one per GPU with NCCL, else 2 gloo processes)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per process (CPU: cores / procs)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    gpus = torch.cuda.device_count()
    backend = "nccl" if gpus else "gloo"
    world = args.world_size or (gpus if gpus else 2)
    args.threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "rank0.json"
        torch.multiprocessing.spawn(worker, args=(world, backend, str(Path(tmp) / "rdzv"), args, str(out)),
                                    nprocs=world)
        raw = json.loads(out.read_text())
    table = summarise(raw, args.start_iter)
    print_table(table)
    torch.set_num_threads(args.threads)  # so the environment block reports the workers' thread count
    device = torch.device("cuda", 0) if gpus else torch.device("cpu")
    result = {
        "benchmark": "comm",
        "what": "bytes each rank all-reduces per DDP step (payload, counted by vlmfast CommCounter) and step time",
        "backend": backend, "world_size": world, "threads_per_process": args.threads,
        "start_iter": args.start_iter, "steps": {"tiny_vlm": args.steps, "linear_stack": args.big_steps},
        "repeats": args.repeats,
        "linear_stack": f"{args.big_layers} x Linear({args.big_width}, {args.big_width}), batch {args.big_batch}",
        "tiny_vlm_batch_per_rank": args.batch_size, "optimizer": f"SGD lr {args.lr}",
        "batched_powersgd": "included" if batched_powersgd_supported() else
        f"skipped: torch {torch.__version__}'s batched_powerSGD_hook fails (vlmfast refuses it)",
        "results": table,
        "raw": raw,
    }
    path = write_result("comm", device, result, args.out)
    print(f"written to {path}")


if __name__ == "__main__":
    main()
