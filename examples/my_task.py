"""Your model and data as a ``--task`` for the vlmfast CLI (train, doctor, find-batch-size).

``build()`` returns ``(model, train_dataset, collate_fn)``. Here: the built-in tiny VLM, with a dataset that also
reports each sample's length (without rendering its image), which ``data.group_by_length`` needs.

Usage:
    PYTHONPATH=examples vlmfast train examples/configs/packing_grouping.yaml --task my_task:build
    PYTHONPATH=examples vlmfast doctor examples/configs/profile_doctor.yaml --task my_task:build
    python examples/my_task.py --steps 5
"""

from __future__ import annotations

import argparse
import sys
from functools import cached_property
from pathlib import Path

from vlmfast.models import ShapesCaptionDataset, TinyVLM, VLMCollator, build_tiny_vlm_task


class ShapesWithLengths(ShapesCaptionDataset):
    """The built-in shapes captions, plus ``lengths`` (caption tokens per sample) for length grouping."""

    @cached_property
    def lengths(self) -> list[int]:
        return [len(self.caption_ids(i)) for i in range(len(self))]


def build(seed: int = 0, num_samples: int = 4096) -> tuple[TinyVLM, ShapesWithLengths, VLMCollator]:
    """The (model, train_dataset, collate_fn) triple `vlmfast ... --task my_task:build` trains."""
    model, _, collate = build_tiny_vlm_task(seed=seed, num_samples=1)
    return model, ShapesWithLengths(num_samples=num_samples, seed=seed), collate


def main(steps: int = 5, config: str | None = None) -> int:
    """Run `vlmfast train CONFIG --task my_task:build` in this process for `steps` steps; returns its exit code."""
    from vlmfast.cli.main import main as vlmfast

    here = str(Path(__file__).resolve().parent)
    if here not in sys.path:
        sys.path.insert(0, here)  # what PYTHONPATH=examples does
    config = config or str(Path(here) / "configs" / "packing_grouping.yaml")
    return vlmfast(["train", config, "--task", "my_task:build", "--set", f"max_steps={steps}",
                    "--set", f"scheduler.warmup_steps={steps // 10}", "--set", "log.progress=off"])


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--config", help="spec file (default: examples/configs/packing_grouping.yaml)")
    args = parser.parse_args()
    raise SystemExit(main(args.steps, args.config))
