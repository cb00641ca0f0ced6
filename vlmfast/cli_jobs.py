"""What every job-running sub-command of `vlmfast` shares: the job arguments, the spec they build, the task loader.

Usage::

    from vlmfast.cli_jobs import DEFAULT_TASK, add_job_arguments, build_spec, load_task
    add_job_arguments(subparsers.add_parser("mycommand"))
    spec = build_spec(args.config, args.set); task = load_task(args.task)

`vlmfast train`, `find-batch-size` (``vlmfast.cli``) and `doctor` (``vlmfast.profiling.doctor_cli``) use it; it
imports neither, so the sub-commands never import the command that registers them.
"""

from __future__ import annotations

import argparse
import importlib
import json
from collections.abc import Callable
from typing import Any

import yaml

__all__ = ["DEFAULT_TASK", "DEMO_SPEC", "add_job_arguments", "build_spec", "load_task"]

# The built-in demo: enough steps on CPU for the loss to drop well below what a text-only model can reach.
DEMO_SPEC: dict[str, Any] = {
    "max_steps": 600,
    "batch_size": 16,
    "optimizer": {"lr": 1e-3, "weight_decay": 0.01},
    "scheduler": {"name": "cosine", "warmup_steps": 20, "min_lr_ratio": 0.1},
    "grad_clip": 1.0,
    "log": {"progress": "auto"},
}
DEFAULT_TASK = "vlmfast.models:build_tiny_vlm_task"


def add_job_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the job arguments (CONFIG, --set, --task, --samples) to a sub-command's parser.

    Usage: ``add_job_arguments(subparsers.add_parser("train"))``
    """
    parser.add_argument("config", nargs="?", help="spec file (.yaml/.yml/.json); default: the built-in demo spec")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a spec field, dotted for sections, e.g. --set optimizer.lr=3e-4")
    parser.add_argument("--task", default=DEFAULT_TASK,
                        help="module:function returning (model, train_dataset, collate_fn); default: the tiny VLM")
    parser.add_argument("--samples", type=int, default=4096, help="generated samples for the built-in task")


def build_spec(config: str | None, overrides: list[str]) -> Any:
    """The spec from a file (or the demo spec) with --set overrides applied; validated before any work.

    Usage: ``build_spec("run.yaml", ["precision=bf16", "optimizer.lr=3e-4"])``
    """
    from pydantic import ValidationError

    from vlmfast.spec import SpecError, TrainSpec, format_validation_error

    data = TrainSpec.from_file(config).to_dict() if config else json.loads(json.dumps(DEMO_SPEC))
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
