"""Training step time of the tiny VLM: eager vs torch.compile (whole model, and per repeated block).

Each variant owns a copy of the model and its AdamW and trains on the same pre-collated batches (caption lengths
vary from batch to batch, as in real data). Compilation and recompilation happen in the warm-up steps, which are
timed apart (``compile_s``). Then the variants take turns (eager, model, blocks, then the reverse order, ...) so drift
hits all alike; each turn reports its median step time and each speed-up is the median over turns of the paired
ratio eager / compiled.

Usage::

    python benchmarks/compile.py                          # inductor, CPU (or the GPU when there is one)
    python benchmarks/compile.py --steps 20 --repeats 5 --scopes model --backend aot_eager
"""

from __future__ import annotations

import argparse
import copy
import time

import torch
from _common import median, write_result

from vlmfast.common.utils import resolve_device
from vlmfast.data.batch import move_to_device
from vlmfast.models import build_tiny_vlm_task
from vlmfast.strategies.compile import compile_model


class Variant:
    """A model copy, its optimizer and a cursor over the shared batches."""

    def __init__(self, name: str, model: torch.nn.Module, device: torch.device, lr: float) -> None:
        self.name = name
        self.model = copy.deepcopy(model).to(device).train()
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=lr, fused=device.type in ("cuda", "cpu"))
        self.result = None
        self.cursor = 0

    def steps(self, batches: list[dict[str, torch.Tensor]], count: int, device: torch.device) -> list[float]:
        times = []
        for _ in range(count):
            batch = batches[self.cursor % len(batches)]
            self.cursor += 1
            start = time.perf_counter()
            loss = self.model(**batch).loss
            loss.backward()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            loss.item()  # the sync a training loop does for logging
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - start)
        return times


def graph_count() -> int:
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20, help="timed steps per variant per repeat")
    parser.add_argument("--warmup", type=int, default=8, help="untimed steps per variant first (compilation)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--batches", type=int, default=8, help="distinct batches cycled through")
    parser.add_argument("--scopes", default="model,blocks")
    parser.add_argument("--backend", default="inductor")
    parser.add_argument("--dynamic", choices=("auto", "true", "false"), default="auto")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    # The variants share code objects (the blocks' forward): room for all their graphs before dynamo gives up.
    torch._dynamo.config.recompile_limit = 64
    dynamic = {"auto": None, "true": True, "false": False}[args.dynamic]
    model, dataset, collate = build_tiny_vlm_task(seed=0)
    batches = [move_to_device(collate([dataset[i] for i in range(b * args.batch_size, (b + 1) * args.batch_size)]),
                              device) for b in range(args.batches)]
    variants = [Variant("eager", model, device, args.lr)]
    compile_s: dict[str, float] = {}
    graphs: dict[str, int] = {}
    for scope in args.scopes.split(","):
        variant = Variant(scope, model, device, args.lr)
        variant.result = compile_model(variant.model, scope=scope, backend=args.backend, dynamic=dynamic)
        variants.append(variant)
    for variant in variants:  # warm-up: compilation, recompilation for new lengths, allocator and AdamW state
        start, graphs_before = time.perf_counter(), graph_count()
        variant.steps(batches, args.warmup, device)
        compile_s[variant.name] = time.perf_counter() - start
        graphs[variant.name] = graph_count() - graphs_before
        print(f"{variant.name:>6}: warm-up {compile_s[variant.name]:.1f} s, {graphs[variant.name]} graphs", flush=True)
    graphs_before = graph_count()
    runs: dict[str, list[float]] = {v.name: [] for v in variants}
    for repeat in range(args.repeats):
        order = variants if repeat % 2 == 0 else list(reversed(variants))
        for variant in order:
            runs[variant.name].append(median(variant.steps(batches, args.steps, device)))
        print(f"repeat {repeat}: " + ", ".join(f"{n} {v[-1] * 1e3:.1f} ms" for n, v in runs.items()), flush=True)
    speedups = {name: median([e / c for e, c in zip(runs["eager"], values, strict=True)])
                for name, values in runs.items() if name != "eager"}
    result = {
        "benchmark": "compile",
        "model": "tiny VLM (built-in, default config), fp32, AdamW, batches of varying caption length",
        "backend": args.backend, "dynamic": args.dynamic, "batch_size": args.batch_size,
        "steps_per_repeat": args.steps, "warmup_steps": args.warmup, "repeats": args.repeats,
        "torch_threads": torch.get_num_threads(),
        "median_step_s": {name: median(values) for name, values in runs.items()},
        "run_medians_s": runs,
        "speedup_vs_eager": speedups,
        "warmup_s": compile_s,
        # The compiled variants share dynamo's cache (it lives on the code objects, e.g. the blocks' forward): a
        # later variant reuses graphs an earlier one built, so only the first compiled warm-up is compile time.
        "graphs_compiled_in_warmup": graphs,
        "graphs_compiled_while_timed": graph_count() - graphs_before,  # 0: the timed steps never recompiled
        "fallbacks": {v.name: v.result.fallbacks for v in variants if v.result is not None},
    }
    path = write_result("compile", device, result, args.out)
    print("speed-up vs eager: " + ", ".join(f"{n} x{s:.2f}" for n, s in speedups.items()) + f"; written to {path}")


if __name__ == "__main__":
    main()
