"""Ranks never desynchronise: whatever each rank's data, every rank runs the same micro-batches and collectives.

Two gloo ranks; rank 1's first micro-batch has no loss token (an image-and-prompt-only sample), which a loop that
skips such micro-batches would turn into a different number of backward passes (and of reductions) per rank.
Under DDP with `sync_each_micro_batch`, ZeRO-2, ZeRO-3 and FSDP2 every backward reduces, so a skip hangs or
mismatches. The run must finish, leave identical parameters on both ranks, and equal one process with the global
batch.
"""

from __future__ import annotations

import pytest
import torch
from conftest import TinyCausalLM, TokenDataset, spawn_two_ranks

from vlmfast import OptimizedTrainer, TrainSpec


class PromptOnlySamples(TokenDataset):
    """Samples 1 and 3 carry no loss token: with rank-strided shards they are rank 1's first micro-batch."""

    def __init__(self) -> None:
        super().__init__(64)
        self.batch["labels"][[1, 3]] = -100


def spec(batch_size: int, **overrides) -> dict:
    return {"max_steps": 3, "batch_size": batch_size, "micro_batch_size": batch_size // 2,
            "optimizer": {"name": "sgd", "lr": 0.5}, "data": {"shuffle": False}, "log": {"progress": "off"},
            **overrides}


def _worker(overrides: dict) -> dict:
    torch.manual_seed(0)
    trainer = OptimizedTrainer(TinyCausalLM(), PromptOnlySamples(), TrainSpec(**spec(4, **overrides)))
    result = trainer.fit()
    module = trainer.engine.module
    if overrides.get("deepspeed", {}).get("zero_stage") == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            params = {n: p.detach().float().clone() for n, p in module.named_parameters()}
    else:
        params = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
                  for n, p in module.named_parameters()}
    return {"params": params, "losses": [m["loss"] for m in result.history]}


def one_process() -> dict:
    torch.manual_seed(0)
    trainer = OptimizedTrainer(TinyCausalLM(), PromptOnlySamples(), TrainSpec(**spec(8)))
    result = trainer.fit()
    return {"params": {n: p.detach().float().clone() for n, p in trainer.model.named_parameters()},
            "losses": [m["loss"] for m in result.history]}


ENGINES = {
    "ddp-sync-each": {"ddp": {"sync_each_micro_batch": True}},
    "zero2": {"engine": "deepspeed", "deepspeed": {"zero_stage": 2}},
    "zero3": {"engine": "deepspeed", "deepspeed": {"zero_stage": 3}},
    "fsdp2": {"engine": "fsdp"},
}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("engine", list(ENGINES))
def test_a_zero_token_micro_batch_on_one_rank_keeps_ranks_in_step(tmp_path, engine):
    if ENGINES[engine].get("engine") == "deepspeed":
        pytest.importorskip("deepspeed")
    ranks = spawn_two_ranks(_worker, tmp_path, engine, ENGINES[engine])
    reference = one_process()
    for name, value in reference["params"].items():
        torch.testing.assert_close(ranks[0]["params"][name], ranks[1]["params"][name], rtol=0, atol=0)
        torch.testing.assert_close(ranks[0]["params"][name], value, rtol=1e-5, atol=1e-6)
    assert ranks[0]["losses"] == pytest.approx(reference["losses"], rel=1e-5)
