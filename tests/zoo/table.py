"""The family x strategy table of docs/families.md, measured: each strategy's one SGD step against the plain one.

    .venv/bin/python tests/zoo/table.py > docs/families.md      # (from the repository root) ~1 min on 2 cores

Per zoo case, one SGD step (fp32, lr 0.1) of the 8 samples with micro-batches of 8 is the reference; each strategy
alone gives "exact" (its update within 1e-5 of the reference's norm) or "refused: <the reason vlmfast gave>".
Packing is compared the same way (one step on the packed rows: ids packed by the loader, or each micro-batch's
embeddings packed at the language model), the vision cache over two epochs with a frozen
tower. tests/test_zoo.py and tests/test_zoo_packing.py assert the same verdicts; this script writes them down.
"""

from __future__ import annotations

import copy
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the zoo and conftest

from vlmfast import OptimizedTrainer, TrainSpec
from zoo import VLM_CASES, ZOO, build_case

TOLERANCE = 1e-5
STRATEGIES = {
    "micro-batches of 3": {"micro_batch_size": 3},
    "OOM fallback (8 -> 2)": {"oom": {"enabled": True}},
    "token budget": {"micro_batch_tokens": None},  # 2 x the batch's width: several micro-batches
    "packing (ids)": {"packing": {"enabled": True}},
    "packing by embeddings": {"packing": {"enabled": True, "level": "embeddings"}},
    "chunked cross-entropy": {"linear_cross_entropy": {"enabled": True}},
    "activation checkpointing": {"activation_checkpointing": {"enabled": True}},
    "vision cache": {"vision_cache": {"enabled": True}},
}


def _spec(steps: int = 1, **extra: Any) -> TrainSpec:
    base = {"max_steps": steps, "batch_size": 8, "micro_batch_size": 8, "device": "cpu", "log": {"progress": "off"},
            "optimizer": {"name": "sgd", "lr": 0.1}, "memory": {"leak_check": False}}
    return TrainSpec(**{**base, **extra})


def _frozen_tower(model: torch.nn.Module, batch: Any) -> torch.nn.Module:
    """The tower and the projector frozen, both found by probing the model (not by their names)."""
    from vlmfast.common.image_path import find_image_modules

    found = find_image_modules(model, batches=[batch])
    for name, param in model.named_parameters():
        if name.startswith(tuple(f"{path}." for path in (found.tower, *found.projectors))):
            param.requires_grad_(False)  # and the rest as it was (a LoRA case's base stays frozen)
    return model


def _update(case: Any, spec: TrainSpec, frozen: bool = False) -> tuple[dict[str, torch.Tensor], Any]:
    from vlmfast.testing import simulated_oom

    model = copy.deepcopy(case.model)
    if frozen:
        _frozen_tower(model, case.collate_fn(case.samples))
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer = OptimizedTrainer(model, case.samples, spec, loss_fn=case.loss_fn, collate_fn=case.collate_fn)
    if spec.oom.enabled:
        with simulated_oom(3):  # more than 3 samples per micro-batch runs out of memory: 8 -> 4 -> 2
            trainer.fit()
    else:
        trainer.fit()
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}, trainer


def _off_by(update: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> float:
    names = sorted(reference)
    diff = torch.cat([(update[n] - reference[n]).flatten() for n in names]).double().norm()
    scale = torch.cat([reference[n].flatten() for n in names]).double().norm()
    return float(diff / scale)


def verdict(case: Any, name: str, reference: dict[str, torch.Tensor], two_epochs: dict[str, torch.Tensor]) -> str:
    """One cell: "exact", "off by X" (a defect), or "refused: <reason>"."""
    extra = copy.deepcopy(STRATEGIES[name])
    whole = case.collate_fn(case.samples)
    if name == "token budget":
        if not isinstance(whole, dict) or "input_ids" not in whole:
            return "refused: not a token sequence"
        extra["micro_batch_tokens"] = 2 * int(whole["input_ids"].shape[1])
    if name == "vision cache" and case.name not in VLM_CASES:
        return "n/a (no vision tower)"
    if name == "vision cache":
        extra["vision_cache"]["dir"] = tempfile.mkdtemp()
    try:
        if name == "vision cache":
            update, trainer = _update(case, _spec(2, **extra), frozen=True)
            cache = next(s for s in trainer.strategies if s.name == "vision_cache").cache
            off = _off_by(update, two_epochs)
            if cache.disabled is not None:
                return f"refused: {cache.disabled[:230]}"
            return "exact, hits" if off <= TOLERANCE else f"off by {off:.1e}"
        update, _ = _update(case, _spec(**extra))
    except (ValueError, ImportError) as refused:
        return f"refused: {str(refused).splitlines()[0][:140]}"
    off = _off_by(update, reference)
    return "exact" if off <= TOLERANCE else f"off by {off:.1e}"


def main() -> None:
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    import transformers

    transformers.logging.set_verbosity_error()
    print("# Every strategy on every family\n")
    print("Generated by `tests/zoo/table.py` (one SGD step, fp32, lr 0.1, of 8 samples with 0, 1 or 2 images each, "
          "inputs from each family's real processor; the vision cache over two epochs with the tower and projector "
          "frozen). *exact*: the update within 1e-5 of the plain step's norm; *refused*: vlmfast's own reason, given "
          f"before any step. transformers {transformers.__version__}, torch {torch.__version__}.\n")
    print("| family | " + " | ".join(STRATEGIES) + " |")
    print("|---" * (len(STRATEGIES) + 1) + "|")
    for name in ZOO:
        case = build_case(name)
        reference, _ = _update(case, _spec())
        two_epochs = _update(case, _spec(2), frozen=True)[0] if name in VLM_CASES else {}
        cells = [verdict(case, strategy, reference, two_epochs).replace("|", "/") for strategy in STRATEGIES]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
