"""What every job-running sub-command of `vlmfast` shares: the job arguments, the spec they build, the task loader.

Usage::

    from vlmfast.cli.jobs import add_job_arguments, build_spec, run_task
    add_job_arguments(subparsers.add_parser("mycommand"))
    spec = build_spec(args.config, args.set); job = run_task(args.task, spec.seed, args.samples)

`vlmfast train`, `find-batch-size` (``vlmfast.cli.main``) and `doctor` (``vlmfast.profiling.doctor_cli``) use it; it
imports neither, so the sub-commands never import the command that registers them.
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULT_TASK", "DEMO_SPEC", "DEMO_TASK_SPEC", "TaskJob", "add_job_arguments", "build_spec",
           "demo_spec_dict", "fields_changed_from_demo", "load_task", "run_task", "task_job"]

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
# The fields that decide what the demo learns (not how fast): a spec that changes them may miss the demo's image check
DEMO_OUTCOME_FIELDS = ("max_steps", "batch_size", "seed", "optimizer", "scheduler", "grad_clip")


def demo_spec_dict() -> dict[str, Any]:
    """The spec `vlmfast train` runs with no config on the built-in task, as a plain dict (a fresh copy)."""
    return json.loads(json.dumps({**DEMO_SPEC, **DEMO_TASK_SPEC}))


def fields_changed_from_demo(spec: Any) -> list[str]:
    """Of :data:`DEMO_OUTCOME_FIELDS`, the dotted fields whose value in `spec` is not the demo's, as 'field value
    (demo: value)'. Usage: ``fields_changed_from_demo(trainer.spec)  # ['max_steps 100 (demo: 600)']``"""
    from vlmfast.spec import TrainSpec

    def flat(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in data.items():
            out.update(flat(value, f"{prefix}{key}.") if isinstance(value, dict) else {f"{prefix}{key}": value})
        return out

    demo = flat(TrainSpec.model_validate(demo_spec_dict()).to_dict())
    mine = flat(spec.to_dict())
    return [f"{key} {mine.get(key)} (demo: {demo[key]})" for key in demo
            if key.split(".")[0] in DEMO_OUTCOME_FIELDS and mine.get(key) != demo[key]]


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the job arguments (CONFIG, --set, --task, --samples) to a sub-command's parser.

    Usage: ``add_job_arguments(subparsers.add_parser("train"))``
    """
    parser.add_argument("config", nargs="?", help="spec file (.yaml/.yml/.json); default: the built-in demo spec")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec field, dotted for sections, e.g. --set optimizer.lr=3e-4")
    parser.add_argument("--task", default=DEFAULT_TASK,
                        help="module:function returning (model, train_dataset, collate_fn[, loss_fn]) or a dict with "
                        "model, train_data and optionally collate_fn, loss_fn, eval_data, processor; default: the tiny "
                        "VLM")
    parser.add_argument("--samples", type=int, default=4096, help="generated samples for the built-in task")


def build_spec(config: str | None, overrides: list[str], builtin_task: bool = False) -> Any:
    """The spec from a file (or the demo spec) with --set overrides applied; validated before any work.

    Usage: ``build_spec("run.yaml", ["precision=bf16", "optimizer.lr=3e-4"])``
    """
    from pydantic import ValidationError

    from vlmfast.spec import SpecError, TrainSpec, format_validation_error

    data = TrainSpec.from_file(config).to_dict() if config else json.loads(json.dumps(DEMO_SPEC))
    if builtin_task and not config:
        data.update(json.loads(json.dumps(DEMO_TASK_SPEC)))
    apply_overrides(data, overrides)
    try:
        return TrainSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(f"invalid spec\n{format_validation_error(exc)}") from exc


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> None:
    """Apply ``--set KEY=VALUE`` items (dotted keys, YAML values) to a spec dict, in place."""
    from vlmfast.common.sections import SpecError
    from vlmfast.spec import parse_spec_text

    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep:
            raise SpecError(f"--set {item!r}: expected KEY=VALUE, e.g. --set precision=bf16")
        _set_dotted(data, key.strip(), parse_spec_text(raw, f"--set {item!r}"))  # as safe as a spec file


def _set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    from vlmfast.spec import SpecError

    *parents, leaf = dotted.split(".")
    for depth, part in enumerate(parents):
        data = data.setdefault(part, {})
        if not isinstance(data, dict):
            where = ".".join(parents[: depth + 1])
            raise SpecError(f"--set {dotted}: '{where}' is a value, not a section; use --set {where}=VALUE")
    data[leaf] = value


def load_task(target: str) -> Callable[..., Any]:
    """The task function ``module:function`` names; a clear ValueError when it cannot be loaded.

    Usage: ``model, dataset, collate = load_task("mypkg.jobs:build")()``
    """
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
    processor: Any = None  # saved next to the model by `vlmfast export` (a processor or tokenizer)

    def trainer(self, spec: Any, eval_data: Any = None) -> Any:
        """The OptimizedTrainer for this job (eval_data: the task's own, else `eval_data`)."""
        from vlmfast.train.loop import OptimizedTrainer

        return OptimizedTrainer(self.model, self.train_data, spec, loss_fn=self.loss_fn, collate_fn=self.collate_fn,
                                eval_data=self.eval_data if self.eval_data is not None else eval_data)


TASK_SHAPE = ("(model, train_dataset, collate_fn), (model, train_dataset, collate_fn, loss_fn) with "
              "loss_fn(model, batch) -> loss | (loss_sum, n_items), or a dict with keys model, train_data and "
              "optionally collate_fn, loss_fn, eval_data, processor")


def task_job(result: Any, target: str) -> TaskJob:
    """Check what the task function returned and name what is wrong (see TASK_SHAPE)."""
    from torch import nn

    keys = ("model", "train_data", "collate_fn", "loss_fn", "eval_data", "processor")
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
    task = load_task(target)
    result = task(seed=seed, num_samples=samples) if target == DEFAULT_TASK else task()
    return task_job(result, target)
