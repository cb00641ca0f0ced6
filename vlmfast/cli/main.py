"""The `vlmfast` command.

Usage::

    vlmfast train                          # the built-in tiny VLM on generated data, with a speed/memory report
    vlmfast train run.yaml --set precision=bf16 --set optimizer.lr=3e-4
    vlmfast find-batch-size run.yaml       # the largest micro-batch that fits, all state restored
    vlmfast estimate-memory --model llava-1.5-7b --gpu-gb 24   # will it fit, and the cheapest changes
    vlmfast spec --defaults > run.yaml     # a commented template of every field
    vlmfast spec --demo > run.yaml         # the same, with the demo's values (`vlmfast train` with no config)
    vlmfast spec --schema                  # the JSON schema
    vlmfast spec --check run.yaml          # validate a spec without running anything
    vlmfast doctor run.yaml                # profile a few steps: what is slow and which flag to turn on next
    vlmfast shards write images/ shards/ --max-count 1000   # a folder or JSONL -> WebDataset tar shards
    vlmfast bench --quick                  # vlmfast vs a hand-written loop, Accelerate, the HF Trainer, Fabric
    vlmfast export ckpt/step_00000600 out/ --merge   # a checkpoint's model (LoRA: adapters or merged) for HF
    vlmfast --version
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence
from typing import Any

from vlmfast import __version__
from vlmfast.cli.jobs import (  # torch-free: argparse, yaml
    DEFAULT_TASK,
    DEMO_SPEC,
    add_job_arguments,
    build_spec,
    fields_changed_from_demo,
    run_task,
)

__all__ = ["main"]

# The sub-commands registered by other modules: name -> (the help `vlmfast --help` lists, "module:registrar").
# A registrar's module (and its package) may import torch, so only the command being run imports its registrar:
# `vlmfast --help` and `vlmfast train --help` import neither torch nor the trainer. The help must equal the one the
# registrar gives its own parser (tests/test_cli.py checks it).
LAZY_COMMANDS: dict[str, tuple[str, str]] = {
    "estimate-memory": ("will a training run fit on a GPU, and which spec changes make it fit",
                        "vlmfast.memory.estimate_cli:add_estimate_memory_parser"),
    "doctor": ("profile a few steps of the job and print what is slow, ranked, with the spec change to try",
               "vlmfast.profiling.doctor_cli:add_doctor_command"),
    "shards": ("WebDataset tar shards for fast streaming training data", "vlmfast.data.shards_cli:add_shards_command"),
    "bench": ("train the same VLM with a hand-written loop, vlmfast (each strategy, best), Accelerate, the HF Trainer "
              "and Fabric; tables, charts, memory headroom", "vlmfast.bench.cli:add_bench_command"),
    "export": ("write a checkpoint's model as a Hugging Face folder: a LoRA run's adapters (or --merge: the merged "
               "model), save_pretrained, or model.safetensors", "vlmfast.cli.export:add_export_command"),
}


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `vlmfast` console script."""
    argv = sys.argv[1:] if argv is None else argv
    parser = _parser(argv)
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except KeyboardInterrupt:  # Ctrl-C outside fit()'s own guard (set-up: probes, autotune, resume, fingerprint)
        if os.environ.get("VLMFAST_TRACEBACK"):
            raise
        print("vlmfast: interrupted (Ctrl-C); set VLMFAST_TRACEBACK=1 to see where", file=sys.stderr)
        return 130
    except Exception as exc:  # a clear one-line error for every known bad input, no traceback
        from vlmfast.checkpoints.store import CheckpointError
        from vlmfast.spec import SpecError

        known = (SpecError, ValueError, FileNotFoundError, CheckpointError)
        if isinstance(exc, known) and not os.environ.get("VLMFAST_TRACEBACK"):
            print(f"vlmfast: error: {exc}\n(set VLMFAST_TRACEBACK=1 for the traceback)", file=sys.stderr)
            return 2
        raise


def _parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The `vlmfast` parser. With `argv`, only the sub-command it names gets its full arguments from its registrar
    (the others are listed by name and help, their modules not imported); without, every sub-command in full."""
    command = next((word for word in argv if not word.startswith("-")), None) if argv is not None else None
    parser = argparse.ArgumentParser(prog="vlmfast", description="Fast, OOM-proof VLM training.")
    parser.add_argument("--version", action="version", version=f"vlmfast {__version__}")  # torch-free, as --help
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model (default: the built-in tiny VLM on generated data)")
    add_job_arguments(train)
    train.set_defaults(run=_cmd_train)

    finder = sub.add_parser("find-batch-size", help="binary-search the largest micro-batch that fits (forward, "
                            "backward and optimizer step), state restored afterwards")
    add_job_arguments(finder)
    finder.add_argument("--margin", type=float, default=0.9, help="safety margin (fraction of device memory)")
    finder.set_defaults(run=_cmd_find_batch_size)

    for name, (help_text, registrar) in LAZY_COMMANDS.items():
        if argv is None or name == command:
            module, _, function = registrar.partition(":")
            getattr(importlib.import_module(module), function)(sub)
        else:  # listed only: never the command that runs
            sub.add_parser(name, help=help_text)

    spec = sub.add_parser("spec", help="print the spec schema or a commented defaults template, or check a file")
    group = spec.add_mutually_exclusive_group(required=True)
    group.add_argument("--schema", action="store_true", help="the JSON schema of the spec")
    group.add_argument("--defaults", action="store_true", help="a commented YAML template with every default")
    group.add_argument("--demo", action="store_true", help="the same template with the built-in demo's values (what "
                       "`vlmfast train` runs with no config): the starting point for changing one thing")
    group.add_argument("--check", metavar="FILE", help="validate a spec file and print it resolved")
    spec.set_defaults(run=_cmd_spec)
    return parser


def _cmd_spec(args: argparse.Namespace) -> int:
    import json

    import yaml

    from vlmfast.spec import TrainSpec, defaults_yaml

    if args.schema:
        print(json.dumps(TrainSpec.model_json_schema(), indent=2))
    elif args.defaults:
        print(defaults_yaml(), end="")
    elif args.demo:
        from vlmfast.cli.jobs import demo_spec_dict

        print("# the built-in demo's spec: `vlmfast train` with no config runs exactly this\n"
              + defaults_yaml(demo_spec_dict()), end="")
    else:
        spec = TrainSpec.from_file(args.check)
        print(yaml.safe_dump(spec.to_dict(), sort_keys=False), end="")
        print(f"# {args.check}: valid", file=sys.stderr)
        _warn_about_folders(spec)
    return 0


def _warn_about_folders(spec: Any) -> None:
    """`spec --check` validates anywhere; folders that would fail on this machine are said as warnings."""
    from vlmfast.checkpoints.save_dir import check_output_dirs
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
    trainer = job.trainer(spec, eval_data)
    trainer.task = args.task  # a plain module's export (save.export) records what built it
    return trainer, baseline


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
        saved = (f"checkpoint: {result.checkpoint}" if result.checkpoint is not None else "no checkpoint written"
                 + ("" if trainer.spec.save.dir else " (no save.dir)"))
        print(f"interrupted by {result.interrupted}; {saved}", file=sys.stderr)
        return 130
    if baseline is not None and result.eval_loss is not None:
        verdict = "below" if result.eval_loss < baseline else "NOT below"
        print(f"held-out loss {result.eval_loss:.4f} vs text-only baseline {baseline:.4f}: {verdict} the best a "
              "model that ignores the image can do", file=sys.stderr)
        if result.eval_loss >= baseline and (changed := fields_changed_from_demo(trainer.spec)):
            print(f"  this run's spec is not the demo's ({'; '.join(changed)}): the demo's {DEMO_SPEC['max_steps']} "
                  "steps are what reach the check; start from `vlmfast spec --demo > run.yaml`", file=sys.stderr)
    return 0


def _builtin_eval(seed: int) -> tuple[Any, float]:
    from vlmfast.models import ShapesCaptionDataset, text_only_baseline_loss

    held_out = ShapesCaptionDataset(num_samples=256, seed=seed + 10_000)
    return held_out, text_only_baseline_loss(held_out)


if __name__ == "__main__":
    raise SystemExit(main())
