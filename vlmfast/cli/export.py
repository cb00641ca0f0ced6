"""`vlmfast export CHECKPOINT OUT`: a checkpoint's model in the formats the Hugging Face ecosystem loads.

The model is rebuilt as `vlmfast train` built it (``--task``, default the built-in tiny VLM) on the spec saved in
the checkpoint (``--set`` overrides it, e.g. ``--set device=cpu``), the checkpoint is loaded into a trainer as a
resume would load it (a LoRA checkpoint: the adapters onto the same base, checked by its fingerprint), and
``trainer.export(OUT, merge=...)`` writes (vlmfast.checkpoints.export): a LoRA run's adapter folder, or with
``--merge`` the merged model; a Hugging Face model's ``save_pretrained`` folder; else ``model.safetensors`` and
``vlmfast_export.json`` (what rebuilds the model). A task that returns a dict with a ``processor`` has it saved next
to the model. OUT is replaced as a whole, and only when it is new, empty or a previous export of the same kind
(``--overwrite``: whatever it holds).

Usage::

    vlmfast export ckpt/step_00000600 out/                          # the built-in tiny VLM's checkpoint
    vlmfast export ckpt/ out/merged --merge --task my_task:build     # a save.dir: its newest checkpoint

    add_export_command(subparsers)      # how vlmfast.cli.main registers it
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from vlmfast.cli.jobs import DEFAULT_TASK

__all__ = ["EXPORT_HELP", "add_export_command", "export_spec"]

EXPORT_HELP = ("write a checkpoint's model as a Hugging Face folder: a LoRA run's adapters (or --merge: the merged "
               "model), save_pretrained, or model.safetensors")

# What the export changes in the checkpoint's spec (before --set): it writes no checkpoint, resumes nothing by
# itself, exports only where it is told, logs nothing, and does not care whether the task's data is the run's. Whole
# sections are replaced, so whatever save.* or log.* the run had (save.every_steps, save.async, log.dir ...), any
# checkpoint that resumes also exports.
EXPORT_OVERRIDES: dict[str, Any] = {
    "save": {"resume": "never", "accept_data_change": True},
    "log": {"progress": "off"},
}


def add_export_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register `export` on the `vlmfast` sub-parsers."""
    parser = subparsers.add_parser("export", help=EXPORT_HELP)
    parser.add_argument("checkpoint", help="a checkpoint folder (save.dir/step_XXXXXXXX), or a save.dir (its newest "
                        "complete checkpoint)")
    parser.add_argument("out", help="the folder to write (created if missing)")
    parser.add_argument("--merge", action="store_true", help="a LoRA run: the merged model (adapters folded into the "
                        "base; loads with from_pretrained, no PEFT) instead of the adapter folder")
    parser.add_argument("--overwrite", action="store_true", help="replace OUT whatever it holds (default: an OUT "
                        "holding anything but a previous export of the same kind is refused)")
    parser.add_argument("--task", default=DEFAULT_TASK, help="module:function that builds the model the checkpoint "
                        "was trained on, as given to `vlmfast train --task`; default: the tiny VLM")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a field of the checkpoint's spec, e.g. --set device=cpu")
    parser.add_argument("--samples", type=int, default=4096, help="generated samples for the built-in task")
    parser.set_defaults(run=_cmd_export)
    return parser


def checkpoint_folder(checkpoint: str | Path) -> Path:
    """The checkpoint CHECKPOINT names: a checkpoint folder or its state file, or a save.dir's newest complete
    checkpoint; FileNotFoundError naming the path otherwise."""
    from vlmfast.checkpoints.store import STATE_FILE, latest_verified_checkpoint

    path = Path(checkpoint)
    if not path.exists():
        raise FileNotFoundError(f"export: checkpoint {path} does not exist: give a checkpoint folder "
                                "(save.dir/step_XXXXXXXX) or a save.dir")
    if path.is_dir() and not (path / STATE_FILE).is_file():
        latest = latest_verified_checkpoint(path)
        if latest is None:
            raise FileNotFoundError(f"export: {path} is neither a checkpoint folder (no {STATE_FILE}) nor a save.dir "
                                    "with a complete checkpoint (step_XXXXXXXX)")
        return latest
    return path


def export_spec(saved: dict[str, Any], overrides: list[str]) -> Any:
    """The checkpoint's saved spec with :data:`EXPORT_OVERRIDES`, then the --set overrides; validated."""
    from pydantic import ValidationError

    from vlmfast.cli.jobs import _set_dotted, apply_overrides
    from vlmfast.spec import SpecError, TrainSpec, format_validation_error

    data = json.loads(json.dumps(saved, default=str))  # a deep copy of plain values
    for key, value in EXPORT_OVERRIDES.items():
        _set_dotted(data, key, json.loads(json.dumps(value)))
    apply_overrides(data, overrides)
    try:
        return TrainSpec.model_validate(data)
    except ValidationError as exc:
        raise SpecError(f"export: the checkpoint's spec (with --set) is not valid here\n"
                        f"{format_validation_error(exc)}") from exc


def _cmd_export(args: argparse.Namespace) -> int:
    from vlmfast.checkpoints.export import check_export_target, export_kind
    from vlmfast.checkpoints.save_dir import check_output_dir
    from vlmfast.checkpoints.store import load_checkpoint
    from vlmfast.cli.jobs import run_task
    from vlmfast.spec import SpecError

    folder = checkpoint_folder(args.checkpoint)
    check_output_dir("export OUT", Path(args.out))  # before any work
    state = load_checkpoint(folder, map_location="cpu")
    if not isinstance(state, dict) or not isinstance(state.get("spec"), dict):
        raise SpecError(f"export: {folder} holds no saved spec: is it a checkpoint written by vlmfast?")
    spec = export_spec(state["spec"], args.set)
    job = run_task(args.task, spec.seed, args.samples)
    trainer = job.trainer(spec)
    trainer.task = args.task  # recorded in a plain module's vlmfast_export.json
    try:
        kind = export_kind(trainer.engine.module, args.merge, lora=spec.lora.enabled or None)
        check_export_target(args.out, kind, args.overwrite, what="export OUT")  # before the checkpoint is loaded
        try:  # as a resume loads it (vlmfast.train.save_resume.resume_run), from the state read once
            trainer.check_resumable(state)
            trainer.engine.load_shards(folder if folder.is_dir() else folder.parent)
            trainer.load_state_dict(state)
        except SpecError:
            raise
        except Exception as exc:
            raise SpecError(f"export: cannot load {folder} into the model --task {args.task} builds: "
                            f"{type(exc).__name__}: {exc}. Is it the task the checkpoint was trained with?") from exc
        path = trainer.export(args.out, merge=args.merge, processor=job.processor, overwrite=args.overwrite,
                              what="export OUT")
    finally:
        getattr(trainer.loader, "close", lambda: None)()  # loader workers, the prefetch thread
    if trainer.is_main_process:
        print(f"exported the model of step {trainer.state.step} ({folder}) to {path}")
    return 0
