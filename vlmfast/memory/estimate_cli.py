"""``vlmfast estimate-memory``: the estimate's table, its verdict and the cheapest fixes, from the command line.

Usage: ``vlmfast estimate-memory --model llava-1.5-7b --micro-batch-size 4 --gpu-gb 24``
"""

from __future__ import annotations

import argparse
from typing import Any

from vlmfast.common.utils import PRECISION_DTYPES
from vlmfast.memory.known_models import KNOWN_CONFIGS, TINY_VLM, estimate_from_hf_config
from vlmfast.memory.options import CHECKPOINT_SCOPES, OPTIMIZERS

__all__ = ["add_estimate_memory_parser", "run_estimate_memory"]


def add_estimate_memory_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``vlmfast estimate-memory`` on an argparse sub-parser set; its ``run`` default is the command.

    Usage: ``add_estimate_memory_parser(parser.add_subparsers(dest="command"))``
    """
    p = subparsers.add_parser(
        "estimate-memory", help="will a training run fit on a GPU, and which spec changes make it fit",
        description="Per-GPU memory by component (weights, gradients, optimizer states, activations measured on "
                    "the meta device) and the cheapest spec changes that make it fit. Sizes in GiB.")
    source = p.add_mutually_exclusive_group()
    source.add_argument("--model", choices=[*KNOWN_CONFIGS, TINY_VLM], default="llava-1.5-7b",
                        help="a known model (default: llava-1.5-7b)")
    source.add_argument("--hf-config", metavar="CONFIG.json", help="a Hugging Face config.json (or its folder)")
    p.add_argument("--precision", choices=sorted(PRECISION_DTYPES), default="bf16",
                   help="training precision (default bf16)")
    p.add_argument("--no-master-weights", dest="master_weights", action="store_false",
                   help="16-bit optimizer states, no fp32 master weights (the reference guide's accounting)")
    p.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw")
    p.add_argument("--micro-batch-size", type=int, default=1, help="samples per forward/backward")
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sample, image tokens included")
    p.add_argument("--world-size", type=int, default=1, help="data-parallel GPUs")
    p.add_argument("--zero-stage", type=int, choices=range(4), default=0, help="DeepSpeed ZeRO stage")
    p.add_argument("--offload-optimizer", action="store_true", help="ZeRO-Offload of optimizer states to host RAM")
    p.add_argument("--offload-params", action="store_true", help="ZeRO-3 offload of weights to host RAM")
    p.add_argument("--checkpointing", nargs="?", const="all", default=False, choices=CHECKPOINT_SCOPES,
                   help="activation checkpointing (optionally only 'language_model' or 'vision')")
    p.add_argument("--checkpoint-budget-gb", type=float, default=None, metavar="GIB",
                   help="activation_checkpointing.budget_gb: checkpoint only the blocks (and ops) needed to fit")
    p.add_argument("--linear-cross-entropy", action="store_true",
                   help="chunked linear cross-entropy: the loss keeps no [tokens, vocab] logits")
    p.add_argument("--micro-batch-tokens", type=int, default=None, metavar="N",
                   help="micro-batches by tokens: rows = N // seq-len (the longest sample)")
    p.add_argument("--freeze", action="append", default=[], metavar="MODULE",
                   help="freeze a component or module path, e.g. --freeze vision_tower (repeatable)")
    p.add_argument("--lora-r", type=int, default=None, metavar="R",
                   help="LoRA adapters of rank R (lora section, all-linear): only they get gradients and optimizer "
                        "states")
    p.add_argument("--lora-towers", nargs="+", choices=("language", "vision"), default=["language"],
                   help="where the adapters go (default: the language model)")
    p.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa",
                   help="sdpa: fused kernels (no L x L scores); eager: scores materialised per layer")
    p.add_argument("--gpu-gb", type=float, default=80.0, help="GPU memory in GiB (default 80)")
    p.add_argument("--vision-cache", type=int, default=None, metavar="IMAGES",
                   help="with vision_cache on: the disk its features take for this many distinct images")
    p.add_argument("--vision-cache-max-gb", type=float, default=None, metavar="GB",
                   help="vision_cache.max_gb, to say what share of the images fits")
    p.set_defaults(run=run_estimate_memory)
    return p


def run_estimate_memory(args: argparse.Namespace) -> int:
    """Print the table, the verdict and the cheapest fixes; exit status 0 if it fits, 1 if not.

    Usage: ``run_estimate_memory(parser.parse_args(["estimate-memory", "--gpu-gb", "24"]))``
    """
    est = estimate_from_hf_config(
        args.hf_config or args.model, attention=args.attention, precision=args.precision, optimizer=args.optimizer,
        micro_batch_size=args.micro_batch_size, seq_len=args.seq_len, world_size=args.world_size,
        zero_stage=args.zero_stage, offload_optimizer=args.offload_optimizer, offload_params=args.offload_params,
        activation_checkpointing=args.checkpointing, frozen=args.freeze, gpu_memory_gb=args.gpu_gb,
        master_weights=args.master_weights, checkpoint_budget_gb=args.checkpoint_budget_gb,
        linear_cross_entropy=args.linear_cross_entropy, micro_batch_tokens=args.micro_batch_tokens,
        lora_r=args.lora_r, lora_towers=tuple(args.lora_towers),
    )
    print(est.to_table())
    if args.vision_cache:
        print(_vision_cache_line(args))
    if est.fits():
        return 0
    print("\ncheapest changes that make it fit, in order:")
    for change in est.cheapest_fixes():
        print(f"  {change}")
    return 1


def _vision_cache_line(args: argparse.Namespace) -> str:
    """The vision cache's disk footprint: per-image features measured on the meta device (no GPU memory change:
    the frozen tower keeps no activations for backward, and its weights stay loaded)."""
    from vlmfast.features.footprint import cache_footprint
    from vlmfast.memory.known_models import build_estimate_model

    model = build_estimate_model(args.hf_config or args.model, attention=args.attention)
    if not any("vision" in f or "visual" in f for f in args.freeze):
        return "vision cache: needs a frozen vision tower (add --freeze vision_tower)"
    dtype_bytes = 4 if args.precision == "fp32" else 2
    footprint = cache_footprint(model, images=args.vision_cache, dtype_bytes=dtype_bytes, frozen=tuple(args.freeze))
    return footprint.to_text(args.vision_cache_max_gb)
