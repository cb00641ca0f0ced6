"""Attention forward+backward: eager vs each SDPA kernel vs flex vs flash-attn, sequence 256 to 8192.

For each sequence length the variants run interleaved (eager, sdpa-flash, sdpa-math, ..., then again in reverse),
each timed as the median of its repetitions; the speed-up is eager's median over the variant's. Memory: on CUDA the
peak allocated bytes of the pass; on CPU (no allocator statistics) the bytes the pass keeps for backward, which is
where attention's O(T^2) score matrix shows up. Variants that cannot run here (or raise any exception) are listed
with the reason.
``--packed N`` packs N documents of equal length into each row (per-document ``position_ids``): attention must stay
inside each document, which SDPA does with a varlen kernel (CUDA, fp16/bf16) or a dense mask, flex with a block mask
and flash-attn with its varlen kernel.

Usage::

    python benchmarks/attention.py                                   # CPU: fp32, lengths 256..4096
    python benchmarks/attention.py --lengths 256 1024 2048 4096 8192 --dtype bf16   # on a GPU
    python benchmarks/attention.py --dtype bf16 --packed 4            # packed rows of 4 documents
"""

from __future__ import annotations

import argparse
import time

import torch
from _common import median, write_result

import vlmfast.attention
from vlmfast.attention.backends import BACKENDS, AttentionInputs
from vlmfast.common.utils import resolve_device
from vlmfast.strategies.activation_checkpointing import saved_tensor_bytes

# name -> (vlmfast backend, SDPA kernel restriction)
VARIANTS = {
    "eager": ("eager", None),
    "sdpa-flash": ("sdpa", ["flash"]),
    "sdpa-efficient": ("sdpa", ["efficient"]),
    "sdpa-cudnn": ("sdpa", ["cudnn"]),
    "sdpa-math": ("sdpa", ["math"]),
    "flex": ("flex", None),
    "flash_attn": ("flash_attn", None),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def make_inputs(args, seq_len: int, device: torch.device) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, seq_len, args.head_dim)
    return [torch.randn(shape, generator=g).to(device, DTYPES[args.dtype]).requires_grad_() for _ in range(3)]


PACKED: dict[str, torch.Tensor] = {}  # {"position_ids": ...} with --packed: every call passes the same tensor


def step(qkv: list[torch.Tensor], backend: str, kernels: list[str] | None) -> None:
    out = vlmfast.attention(*qkv, causal=True, backend=backend, sdpa_kernels=kernels, **PACKED)
    out.sum().backward()
    for x in qkv:
        x.grad = None


def why_not(backend: str, kernels: list[str] | None, qkv: list[torch.Tensor]) -> str | None:
    from vlmfast.attention.documents import PackedDocuments

    documents = PackedDocuments.from_position_ids(PACKED["position_ids"]) if PACKED else None
    inputs = AttentionInputs(causal=True, sdpa_kernels=tuple(kernels) if kernels else None, documents=documents)
    reason = BACKENDS[backend].unavailable_reason(qkv[0], inputs)
    if reason is None:
        try:  # a forward and backward, as timed: torch refuses a kernel that cannot take these inputs ("No
            step(qkv, backend, kernels)  # available kernel"), and a torch release may lack a keyword (TypeError)
        except Exception as exc:
            reason = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:200]}"
    return reason


def packed_positions(args, seq_len: int, device: torch.device) -> torch.Tensor:
    """[batch, T] positions restarting at each of `args.packed` equal documents (the last one takes the rest)."""
    length = seq_len // args.packed
    positions = torch.arange(seq_len) - (torch.arange(seq_len) // length).clamp(max=args.packed - 1) * length
    return positions.expand(args.batch, -1).to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def timed(qkv, backend, kernels, device, repeats: int) -> list[float]:
    times = []
    for _ in range(repeats):
        sync(device)
        start = time.perf_counter()
        step(qkv, backend, kernels)
        sync(device)
        times.append(time.perf_counter() - start)
    return times


def memory(qkv, backend, kernels, device) -> dict[str, int]:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        step(qkv, backend, kernels)
        return {"peak_bytes_above_inputs": torch.cuda.max_memory_allocated(device) - base}
    saved = saved_tensor_bytes(lambda: vlmfast.attention(*qkv, causal=True, backend=backend, sdpa_kernels=kernels,
                                                         **PACKED))
    return {"saved_for_backward_bytes": saved}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048, 4096])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--dtype", choices=list(DTYPES), default="fp32")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved rounds (each round: every variant)")
    parser.add_argument("--reps-per-round", type=int, default=2)
    parser.add_argument("--device", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (1: less CPU jitter)")
    parser.add_argument("--packed", type=int, default=0, help="documents per row (0: one unpacked sequence)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    results, skipped = {}, {}
    for seq_len in args.lengths:
        qkv = make_inputs(args, seq_len, device)
        PACKED.clear()
        if args.packed:
            PACKED["position_ids"] = packed_positions(args, seq_len, device)
        runnable = {}
        for name, (backend, kernels) in VARIANTS.items():
            reason = why_not(backend, kernels, qkv)
            if reason:
                skipped[name] = reason
            else:
                runnable[name] = (backend, kernels)
        times: dict[str, list[float]] = {name: [] for name in runnable}
        for rnd in range(args.repeats):
            order = list(runnable) if rnd % 2 == 0 else list(reversed(runnable))
            for name in order:
                times[name] += timed(qkv, *runnable[name], device, args.reps_per_round)
        row = {}
        for name, (backend, kernels) in runnable.items():
            row[name] = {"median_s": median(times[name]), **memory(qkv, backend, kernels, device)}
        for name in row:
            row[name]["speedup_vs_eager"] = row["eager"]["median_s"] / row[name]["median_s"]
        results[str(seq_len)] = row
        print(f"T={seq_len}: " + ", ".join(f"{n} {r['median_s'] * 1e3:.1f} ms ({r['speedup_vs_eager']:.2f}x)"
                                           for n, r in row.items()), flush=True)
        del qkv
    result = {
        "benchmark": "attention",
        "what": "causal self-attention forward+backward, median per variant, interleaved rounds",
        "torch_threads": torch.get_num_threads(), "batch": args.batch, "heads": args.heads,
        "head_dim": args.head_dim, "dtype": args.dtype, "packed_documents_per_row": args.packed,
        "repeats": args.repeats, "reps_per_round": args.reps_per_round,
        "results": results, "not_run": skipped,
    }
    print(f"not run here: {skipped}")
    name = f"attention_packed{args.packed}" if args.packed else "attention"
    print(f"written to {write_result(name, device, result, args.out)}")


if __name__ == "__main__":
    main()
