"""The `vlmfast` command.

Usage::

    vlmfast train                          # the built-in tiny VLM on generated data, with a speed/memory report
    vlmfast train run.yaml --set precision=bf16 --set optimizer.lr=3e-4
    vlmfast find-batch-size run.yaml       # the largest micro-batch that fits, all state restored
    vlmfast estimate-memory --model llava-1.5-7b --gpu-gb 24   # will it fit, and the cheapest changes
    vlmfast spec --defaults > run.yaml     # a commented template of every field
    vlmfast spec --schema                  # the JSON schema
    vlmfast spec --check run.yaml          # validate a spec without running anything
    vlmfast doctor run.yaml                # profile a few steps: what is slow and which flag to turn on next
    vlmfast shards write images/ shards/ --max-count 1000   # a folder or JSONL -> WebDataset tar shards
    vlmfast bench --quick                  # vlmfast vs a hand-written loop, Accelerate, the HF Trainer, Fabric
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import yaml

from vlmfast.cli_jobs import DEFAULT_TASK, add_job_arguments, build_spec, run_task

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `vlmfast` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except Exception as exc:  # a clear one-line error for every known bad input, no traceback
        from vlmfast.checkpoint import CheckpointError
        from vlmfast.spec import SpecError

        known = (SpecError, ValueError, FileNotFoundError, CheckpointError)
        if isinstance(exc, known) and not os.environ.get("VLMFAST_TRACEBACK"):
            print(f"vlmfast: error: {exc}\n(set VLMFAST_TRACEBACK=1 for the traceback)", file=sys.stderr)
            return 2
        raise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlmfast", description="Fast, OOM-proof VLM training.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model (default: the built-in tiny VLM on generated data)")
    add_job_arguments(train)
    train.set_defaults(run=_cmd_train)

    finder = sub.add_parser("find-batch-size", help="binary-search the largest micro-batch that fits (forward, "
                            "backward and optimizer step), state restored afterwards")
    add_job_arguments(finder)
    finder.add_argument("--margin", type=float, default=0.9, help="safety margin (fraction of device memory)")
    finder.set_defaults(run=_cmd_find_batch_size)

    from vlmfast.bench.cli import add_bench_command
    from vlmfast.data.shards_cli import add_shards_command
    from vlmfast.memory.estimate_cli import add_estimate_memory_parser
    from vlmfast.profiling.doctor_cli import add_doctor_command

    add_estimate_memory_parser(sub)
    add_doctor_command(sub)
    add_shards_command(sub)
    add_bench_command(sub)

    spec = sub.add_parser("spec", help="print the spec schema or a commented defaults template, or check a file")
    group = spec.add_mutually_exclusive_group(required=True)
    group.add_argument("--schema", action="store_true", help="the JSON schema of the spec")
    group.add_argument("--defaults", action="store_true", help="a commented YAML template with every default")
    group.add_argument("--check", metavar="FILE", help="validate a spec file and print it resolved")
    spec.set_defaults(run=_cmd_spec)
    return parser


def _cmd_spec(args: argparse.Namespace) -> int:
    from vlmfast.spec import TrainSpec, defaults_yaml

    if args.schema:
        print(json.dumps(TrainSpec.model_json_schema(), indent=2))
    elif args.defaults:
        print(defaults_yaml(), end="")
    else:
        spec = TrainSpec.from_file(args.check)
        print(yaml.safe_dump(spec.to_dict(), sort_keys=False), end="")
        print(f"# {args.check}: valid", file=sys.stderr)
        _warn_about_folders(spec)
    return 0


def _warn_about_folders(spec: Any) -> None:
    """`spec --check` validates anywhere; folders that would fail on this machine are said as warnings."""
    from vlmfast.save_dir import check_output_dirs
    from vlmfast.spec import SpecError

    try:
        check_output_dirs(spec)
    except SpecError as exc:
        print(f"# warning (on this machine): {exc}", file=sys.stderr)


def _build_trainer(args: argparse.Namespace) -> tuple[Any, float | None]:
    """The trainer for the job the arguments name, and the text-only baseline for the built-in task."""
    spec = build_spec(args.config, args.set, builtin_task=args.task == DEFAULT_TASK)  # fails before any work
    job = run_task(args.task, spec.seed, args.samples)
    eval_data, baseline = _builtin_eval(spec.seed) if args.task == DEFAULT_TASK else (None, None)
    return job.trainer(spec, eval_data), baseline


def _cmd_find_batch_size(args: argparse.Namespace) -> int:
    trainer, _ = _build_trainer(args)
    search = trainer.find_micro_batch_size(safety_margin=args.margin)
    if trainer.is_main_process:
        print(search.to_text())
    return 0


def _cmd_train(args: argparse.Namespace) -> int:
    trainer, baseline = _build_trainer(args)
    result = trainer.fit()
    if not trainer.is_main_process:  # one copy of every message
        return 130 if result.interrupted else 0
    if result.interrupted:
        print(f"interrupted by {result.interrupted}; checkpoint: {result.checkpoint}", file=sys.stderr)
        return 130
    if baseline is not None and result.eval_loss is not None:
        verdict = "below" if result.eval_loss < baseline else "NOT below"
        print(f"held-out loss {result.eval_loss:.4f} vs text-only baseline {baseline:.4f}: {verdict} the best a "
              "model that ignores the image can do", file=sys.stderr)
    return 0


def _builtin_eval(seed: int) -> tuple[Any, float]:
    from vlmfast.models import ShapesCaptionDataset, text_only_baseline_loss

    held_out = ShapesCaptionDataset(num_samples=256, seed=seed + 10_000)
    return held_out, text_only_baseline_loss(held_out)


if __name__ == "__main__":
    raise SystemExit(main())
