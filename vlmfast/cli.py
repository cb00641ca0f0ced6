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
import importlib
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml

# The built-in demo: enough steps on CPU for the loss to drop well below what a text-only model can reach.
DEMO_SPEC: dict[str, Any] = {
    "max_steps": 600,
    "batch_size": 16,
    "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
    "scheduler": {"name": "cosine", "warmup_steps": 20, "min_lr_ratio": 0.1},
    "grad_clip": 1.0,
    "log": {"progress": "auto"},
}
# The built-in task with no config (the demo) also renders the next batch's images in a background thread while
# the step computes (CPU too): its data wait fell from ~10 % to ~4 % of the step time on the 2-core machine
# (benchmarks/profiling_overhead.py). Not for --task jobs on the demo spec: their data may not be worth a thread.
DEMO_TASK_SPEC: dict[str, Any] = {"data": {"device_prefetch": True}}
DEFAULT_TASK = "vlmfast.models:build_tiny_vlm_task"


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `vlmfast` console script."""
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        return args.run(args)
    except Exception as exc:  # a clear one-line error for every known bad input, no traceback
        from vlmfast.spec import SpecError

        if isinstance(exc, (SpecError, ValueError, FileNotFoundError)) and not os.environ.get("VLMFAST_TRACEBACK"):
            print(f"vlmfast: error: {exc}\n(set VLMFAST_TRACEBACK=1 for the traceback)", file=sys.stderr)
            return 2
        raise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vlmfast", description="Fast, OOM-proof VLM training.")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="train a model (default: the built-in tiny VLM on generated data)")
    _add_job_arguments(train)
    train.set_defaults(run=_cmd_train)

    finder = sub.add_parser("find-batch-size", help="binary-search the largest micro-batch that fits (forward, "
                            "backward and optimizer step), state restored afterwards")
    _add_job_arguments(finder)
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


def _add_job_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", nargs="?", help="spec file (.yaml/.yml/.json); default: the built-in demo spec")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec field, dotted for sections, e.g. --set optimizer.lr=3e-4")
    parser.add_argument("--task", default=DEFAULT_TASK,
                        help="module:function returning (model, train_dataset, collate_fn[, loss_fn]) or a dict with "
                        "model, train_data and optionally collate_fn, loss_fn, eval_data; default: the tiny VLM")
    parser.add_argument("--samples", type=int, default=4096, help="generated samples for the built-in task")


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
    return 0


def build_spec(config: str | None, overrides: list[str], builtin_task: bool = False) -> Any:
    """The spec from a file (or the demo spec) with --set overrides applied; validated before any work."""
    from pydantic import ValidationError

    from vlmfast.spec import SpecError, TrainSpec, format_validation_error

    data = TrainSpec.from_file(config).to_dict() if config else json.loads(json.dumps(DEMO_SPEC))
    if builtin_task and not config:
        data.update(json.loads(json.dumps(DEMO_TASK_SPEC)))
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SpecError(f"--set {item!r}: expected KEY=VALUE, e.g. --set precision=bf16")
        _set_dotted(data, key.strip(), yaml.safe_load(raw))
    try:
        return TrainSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(f"invalid spec\n{format_validation_error(exc)}") from exc


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    from vlmfast.spec import SpecError

    *parents, leaf = dotted.split(".")
    for depth, part in enumerate(parents):
        data = data.setdefault(part, {})
        if not isinstance(data, dict):
            where = ".".join(parents[: depth + 1])
            raise SpecError(f"--set {dotted}: '{where}' is a value, not a section; use --set {where}=VALUE")
    data[leaf] = value


def _load_task(target: str) -> Callable[..., Any]:
    module_name, _, attr = target.partition(":")
    if not attr:
        raise ValueError(f"--task {target!r}: expected module:function, e.g. {DEFAULT_TASK}")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"--task {target!r}: cannot load it ({exc}); is the module on PYTHONPATH?") from exc


@dataclass
class TaskJob:
    """What a ``--task module:function`` returns, checked: the trainer's model, data and optional loss_fn."""

    model: Any
    train_data: Any
    collate_fn: Any = None
    loss_fn: Any = None
    eval_data: Any = None

    def trainer(self, spec: Any, eval_data: Any = None) -> Any:
        """The OptimizedTrainer for this job (eval_data: the task's own, else `eval_data`)."""
        from vlmfast.train.loop import OptimizedTrainer

        return OptimizedTrainer(self.model, self.train_data, spec, loss_fn=self.loss_fn, collate_fn=self.collate_fn,
                                eval_data=self.eval_data if self.eval_data is not None else eval_data)


TASK_SHAPE = ("(model, train_dataset, collate_fn), (model, train_dataset, collate_fn, loss_fn) with "
              "loss_fn(model, batch) -> loss | (loss_sum, n_items), or a dict with keys model, train_data and "
              "optionally collate_fn, loss_fn, eval_data")


def task_job(result: Any, target: str) -> TaskJob:
    """Check what the task function returned and name what is wrong (see TASK_SHAPE)."""
    from torch import nn

    keys = ("model", "train_data", "collate_fn", "loss_fn", "eval_data")
    if isinstance(result, dict):
        unknown = sorted(set(result) - set(keys))
        missing = [key for key in keys[:2] if key not in result]
        if unknown or missing:
            raise ValueError(f"--task {target} returned a dict with keys {sorted(result)}: "
                             + (f"missing {missing}" if missing else f"unknown {unknown}") + f"; expected {TASK_SHAPE}")
        job = TaskJob(**result)
    elif isinstance(result, (tuple, list)) and len(result) in (3, 4):
        job = TaskJob(*result)
    else:
        what = (f"a {type(result).__name__} of {len(result)} item(s) ({', '.join(type(v).__name__ for v in result)})"
                if isinstance(result, (tuple, list)) else f"a {type(result).__name__}")
        raise ValueError(f"--task {target} returned {what}; expected {TASK_SHAPE}")
    if not isinstance(job.model, nn.Module):
        raise ValueError(f"--task {target}: the model (first item) is a {type(job.model).__name__}, not a "
                         f"torch.nn.Module; expected {TASK_SHAPE}")
    for name in ("collate_fn", "loss_fn"):
        value = getattr(job, name)
        if value is not None and not callable(value):
            raise ValueError(f"--task {target}: {name} is a {type(value).__name__}, not a function (or None); "
                             f"expected {TASK_SHAPE}")
    return job


def run_task(target: str, seed: int, samples: int) -> TaskJob:
    """Call the ``--task`` function (the built-in one gets the seed and sample count) and check its result."""
    task = _load_task(target)
    result = task(seed=seed, num_samples=samples) if target == DEFAULT_TASK else task()
    return task_job(result, target)


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
