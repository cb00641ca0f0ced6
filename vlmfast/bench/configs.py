"""The named configurations of ``vlmfast bench``: the starting point, vlmfast one strategy at a time, vlmfast's best
combination, and Accelerate, the Hugging Face Trainer and Lightning Fabric at equal settings and at their best.

"Equal settings" means exactly the starting point's: fp32, eager attention, right-padded batches in the data set's
order, no torch.compile, no DataLoader workers. Those rows measure what each tool costs by itself. The "best" rows
switch on everything the tool has an equivalent flag for, chosen per device type below, with the reason.

Usage::

    configs = build_configs("cpu")                         # in run order
    [c.name for c in configs if skip_reason(c, device) is None]
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Any

import torch

from vlmfast.bench.runners import (
    RunResult,
    Settings,
    accelerate_loop,
    fabric_loop,
    hand_written,
    hf_trainer,
    vlmfast_run,
)
from vlmfast.bench.workload import SIZES

__all__ = ["BEST_REASONS", "RUNNERS", "BenchConfig", "best_spec", "build_configs", "skip_reason"]

Runner = Callable[[Any, Settings, torch.device], RunResult]
RUNNERS: dict[str, Runner] = {"hand-written": hand_written, "vlmfast": vlmfast_run, "accelerate": accelerate_loop,
                              "hf-trainer": hf_trainer, "fabric": fabric_loop}
REQUIRES = {"accelerate": "accelerate", "hf-trainer": "transformers", "fabric": "lightning_fabric"}
START = "start"


@dataclass(frozen=True)
class BenchConfig:
    """One row of the comparison: who trains (``contender``), with what (``settings``), and why it is there."""

    name: str
    contender: str
    settings: Settings
    role: str  # start | equal | strategy | best
    description: str
    strategy: str | None = None  # for role "strategy": the one thing switched on
    cuda_only: bool = False

    def run(self, workload: Any, device: torch.device) -> RunResult:
        return RUNNERS[self.contender](workload, self.settings, device)


# Packing row budget per device. CPU: 73 tokens, the tiny VLM's longest sequence (9 image + 64 text tokens):
# short rows keep the dense document mask and eager attention cheap (rows of 96, 132 and 264 tokens measured
# slower). CUDA (the ~150M model, 196 image tokens per sample): rows of 1024 tokens, four samples each.
PACK_TOKENS = {"cpu": 73, "cuda": 1024}


# `bench --quick` proves that every row runs, in seconds: compile with dynamo's eager backend, which captures the graph
# and compiles nothing (a cold inductor cache cost ~450 s on the 2-core CPU; aot_eager still 22 s of tracing for the
# 3 batch shapes), and a short worker autotuning.
QUICK_COMPILE_BACKEND = "eager"


def _packing(device_type: str, size: str | None) -> dict[str, Any]:
    """The packing section for a device type and benchmark size: the size's row budget where it sets one, and no
    added image placeholders for multi-image data (they are in its input_ids already)."""
    bench = SIZES.get(size) if size else None
    pack = {"enabled": True, "max_tokens": (bench and bench.pack_tokens) or PACK_TOKENS[device_type]}
    return {**pack, "image_tokens": 0} if bench and bench.data in ("multi-image", "processor") else pack


def _strategies(device_type: str, quick: bool = False,
                size: str | None = None) -> dict[str, tuple[dict[str, Any], str]]:
    """vlmfast spec overrides that switch on one strategy each, with the row's description."""
    compile_backend = QUICK_COMPILE_BACKEND if quick else "inductor"
    packing = _packing(device_type, size)
    return {
        "bf16": ({"precision": "bf16"}, "bf16 autocast"),
        "tf32": ({"tf32": True}, "TF32 matmuls (CUDA)"),
        "sdpa": ({"attention": {"backend": "sdpa"}}, "attention backend: eager -> SDPA"),
        "packing": ({"packing": packing}, f"sequence packing into rows of {packing['max_tokens']} tokens"),
        # The same rows packed on the device from the padded micro-batch, where the language model takes its
        # embeddings: any family, at the price of the padded vision / merge work and the gather and scatter.
        "packing_embeddings": ({"packing": {**packing, "level": "embeddings"}},
                               f"packing by embeddings (each micro-batch, at the language model) into rows of "
                               f"{packing['max_tokens']} tokens"),
        # shuffle: the grouped batches in random order (windows sorted by length, batches shuffled); unshuffled,
        # one window holds the whole short epoch and the run trains longest-first, which hurts the loss.
        "group_by_length": ({"data": {"group_by_length": "length", "shuffle": True}},
                            "batches of similar caption length"),
        "compile": ({"compile": {"enabled": True, "backend": compile_backend, "scope": "blocks"}},
                    f"torch.compile (each repeated block, {compile_backend}"
                    + (": --quick compiles nothing)" if quick else ")")),
        "workers": ({"data": {"num_workers": "auto", "autotune_budget_s": 0.5 if quick else 3.0}},
                    "DataLoader workers: auto (measured)"),
        "prefetch": ({"data": {"device_prefetch": True}}, "next batch loaded (and copied) in the background"),
        "checkpointing": ({"activation_checkpointing": {"enabled": True}},
                          "activation checkpointing (memory for compute; see headroom)"),
    }


# The best vlmfast combination per device type, and why (measured with `vlmfast bench`, docs/benchmarks.md).
BEST: dict[str, list[str]] = {
    "cpu": ["packing"],
    "cuda": ["bf16", "tf32", "sdpa", "compile", "workers", "prefetch"],
}
# Additions for a benchmark size: gpu-1b's samples are 1,000-2,024 tokens, so a padded batch of 10 is ~25 % padding
# that packing into rows of 2,048 removes (the tiny gpu size's 196 image tokens leave ~10 %); to be measured there.
BEST_FOR_SIZE: dict[tuple[str, str | None], list[str]] = {("cuda", "gpu-1b"): ["packing"]}
BEST_REASONS: dict[str, str] = {
    "cpu": "measured on the shared 2-core CPU, 1 torch thread: packing removes most padding with the same gradient "
           "(same eval loss), 1.04-1.16x in 5-7-round runs. Not in the set, each measured alone: length grouping "
           "(as fast or faster, but batches of similar scenes train worse in a short run: eval loss +6 %), the "
           "prefetch thread and workers (0.86-0.95x: this tiny model's step is Python-bound, and a loader thread "
           "or worker processes take the GIL or the second core from it), bf16 (CPU autocast is slower), SDPA "
           "(+3 % padded, slower on packed rows' masks), compile (5-40 s of compiling per run for a gain inside the "
           "noise; 1.09x in benchmarks/compile.py).",
    "cuda": "not yet measured on a GPU (no GPU in the session that wrote this): bf16 autocast + TF32 for the tensor "
            "cores, SDPA attention (its flash kernel in bf16), torch.compile, DataLoader workers auto "
            "and device prefetch (the 224 px image pipeline must keep up with a fast step). Packing and length "
            "grouping are measured alone: 196 image tokens per sample leave ~10 % padding to remove, and grouping "
            "trains worse in short runs. Re-check against the strategy rows of the first GPU run.",
}


def best_set(device_type: str, without: Collection[str] = (), size: str | None = None) -> list[str]:
    """The strategies of the best configuration on `device_type` (with the benchmark `size`'s own additions, e.g.
    packing for gpu-1b's long samples on a GPU), less `without` (e.g. compile, for a short lease)."""
    unknown = set(without) - set(_strategies(device_type))
    if unknown:
        raise ValueError(f"unknown strategy(ies) {sorted(unknown)} in --without; choose from "
                         f"{sorted(_strategies(device_type))}")
    extra = [name for name in BEST_FOR_SIZE.get((device_type, size), []) if name not in BEST[device_type]]
    return [name for name in BEST[device_type] + extra if name not in without]


def best_spec(device_type: str, without: Collection[str] = (), quick: bool = False,
              size: str | None = None) -> dict[str, Any]:
    """The spec overrides of vlmfast's best configuration on `device_type` ("cpu" or "cuda"), less `without`, for
    the benchmark `size` (its packing budget; default: the device type's)."""
    from vlmfast.bench.runners import _deep_merge

    spec: dict[str, Any] = {}
    strategies = _strategies(device_type, quick, size)
    best = best_set(device_type, without, size)
    for name in best:
        spec = _deep_merge(spec, strategies[name][0])
    if "sdpa" in best:
        spec["attention"] = {"backend": "auto"}  # what users get: flash-attn where installed, else SDPA
    return spec


def _manual_workers(device_type: str) -> int:
    """Workers a careful user would give the other tools' best rows (they have no autotuning)."""
    cpus = os.cpu_count() or 1
    return min(8, cpus // 2) if device_type == "cuda" else 0


def build_configs(device_type: str, without: Collection[str] = (), quick: bool = False,
                  size: str | None = None) -> list[BenchConfig]:
    """Every configuration for a device type ("cpu" or "cuda"), in run order; the best rows (vlmfast's and the other
    tools') leave out the strategies in `without`; `quick` (``bench --quick``): compile rows use
    :data:`QUICK_COMPILE_BACKEND`; `size`: the benchmark size (:data:`vlmfast.bench.workload.SIZES`), whose data
    and packing budget the packing rows follow."""
    best = best_set(device_type, without)
    loop_best = Settings(precision="bf16" if "bf16" in best else "fp32", attention="sdpa" if "sdpa" in best else
                         "eager", compile="compile" in best, tf32="tf32" in best,
                         compile_backend=QUICK_COMPILE_BACKEND if quick else "inductor",
                         num_workers=_manual_workers(device_type) if "workers" in best else 0)
    what = (f"{loop_best.precision}, {loop_best.attention} attention, "
            f"compile {'per block' if loop_best.compile else 'off'}, {loop_best.num_workers} workers")
    configs = [
        BenchConfig(START, "hand-written", Settings(), "start", "hand-written loop: fp32, eager, padded"),
        BenchConfig("vlmfast", "vlmfast", Settings(), "equal", "OptimizedTrainer, starting point's settings"),
        BenchConfig("vlmfast-defaults", "vlmfast", Settings(spec={"profile": {"flops": "measured"},
                                                                  "memory": {"leak_warmup_steps": 20}}), "equal",
                    "same, with the defaults' start-up costs: FLOPs measured per new batch shape, leak census at "
                    "step 30"),
    ]
    for name, (spec, description) in _strategies(device_type, quick, size).items():
        configs.append(BenchConfig(f"vlmfast+{name}", "vlmfast", Settings(spec=spec), "strategy", description,
                                   strategy=name, cuda_only=name == "tf32"))
    configs += [
        BenchConfig("vlmfast-best", "vlmfast", Settings(spec=best_spec(device_type, without, quick, size)), "best",
                    "vlmfast: " + " + ".join(best_set(device_type, without, size))),
        BenchConfig("accelerate", "accelerate", Settings(), "equal", "Accelerate loop, starting point's settings"),
        BenchConfig("accelerate-best", "accelerate", loop_best, "best", f"Accelerate: {what}"),
        BenchConfig("hf-trainer", "hf-trainer", Settings(), "equal", "HF Trainer, starting point's settings"),
        BenchConfig("hf-best", "hf-trainer", replace(loop_best, group_by_length=True, auto_find_batch_size=True),
                    "best", f"HF Trainer: {what}, group_by_length, auto_find_batch_size"),
        BenchConfig("fabric", "fabric", Settings(), "equal", "Lightning Fabric loop, starting point's settings"),
        BenchConfig("fabric-best", "fabric", loop_best, "best", f"Fabric: {what}"),
    ]
    return configs


def skip_reason(config: BenchConfig, device: torch.device) -> str | None:
    """Why `config` cannot run here (a missing package, a CUDA-only strategy), or None."""
    if config.cuda_only and device.type != "cuda":
        return f"{config.strategy} is a CUDA feature (no {device.type} equivalent)"
    module = REQUIRES.get(config.contender)
    if module is not None and importlib.util.find_spec(module) is None:
        extra = {"transformers": "vlmfast[hf]", "lightning_fabric": "vlmfast[fabric]"}.get(module, module)
        return f"{module} is not installed (pip install {extra})"
    return None
