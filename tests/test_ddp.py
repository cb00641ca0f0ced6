"""DDP on 2 CPU processes (gloo): the same training as one process with the same global batch."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import TinyCausalLM, TokenDataset, spawn_two_ranks

from vlmfast import OptimizedTrainer, TrainSpec


def spec(batch_size, micro_batch_size, **overrides):
    base = {"max_steps": 6, "batch_size": batch_size, "micro_batch_size": micro_batch_size,
            "optimizer": {"lr": 1e-2}, "log": {"progress": "off"}}
    base.update(overrides)
    return TrainSpec(**base)


def params(model):
    return {n: p.detach().clone() for n, p in getattr(model, "module", model).named_parameters()}


def _train(overrides: dict, model_kind: str) -> dict:
    torch.manual_seed(0)
    model = UnusedHead() if model_kind == "unused" else TinyCausalLM()
    trainer = OptimizedTrainer(model, TokenDataset(64), spec(4, 2, **overrides))
    try:
        result = trainer.fit()
    except RuntimeError as exc:
        return {"error": str(exc)}
    return {"params": params(trainer.model), "losses": [m["loss"] for m in result.history],
            "ddp": type(trainer.model).__name__}


def run_two_ranks(tmp_path, name, overrides=None, model_kind="tiny"):
    return spawn_two_ranks(_train, tmp_path, name, overrides or {}, model_kind)


def single_process(micro_batch_size=4):
    torch.manual_seed(0)
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(64), spec(8, micro_batch_size))
    result = trainer.fit()
    return params(trainer.model), [m["loss"] for m in result.history]


@pytest.mark.timeout(180)
def test_two_ranks_match_one_process_with_the_same_global_batch(tmp_path):
    ranks = run_two_ranks(tmp_path, "ddp")
    reference_params, reference_losses = single_process()
    assert [r["ddp"] for r in ranks] == ["DistributedDataParallel"] * 2  # wrapped by the trainer itself
    for rank in ranks:
        assert rank["losses"] == pytest.approx(reference_losses, rel=1e-5)  # the logged loss is the global one
        for name, value in reference_params.items():
            torch.testing.assert_close(rank["params"][name], value, rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(180)
def test_sync_each_micro_batch_gives_the_same_result(tmp_path):
    ranks = run_two_ranks(tmp_path, "sync", {"ddp": {"sync_each_micro_batch": True}})
    reference_params, _ = single_process()
    for name, value in reference_params.items():
        torch.testing.assert_close(ranks[0]["params"][name], value, rtol=1e-5, atol=1e-6)


class UnusedHead(TinyCausalLM):
    """A trainable module that forward never uses: DDP without find_unused_parameters waits for it."""

    def __init__(self) -> None:
        super().__init__()
        self.unused = torch.nn.Linear(4, 4)


@pytest.mark.timeout(180)
def test_unused_trainable_module_gets_the_fix_in_the_error(tmp_path):
    ranks = run_two_ranks(tmp_path, "unused", model_kind="unused")
    assert all("ddp.find_unused_parameters: true" in r.get("error", "") for r in ranks), ranks[0]
    fixed = run_two_ranks(tmp_path, "fixed", {"ddp": {"find_unused_parameters": True}}, model_kind="unused")
    assert all("params" in r for r in fixed)


@pytest.mark.timeout(180)
def test_only_rank_zero_writes_metrics_and_checkpoints(tmp_path):
    overrides = {"log": {"progress": "off", "dir": str(tmp_path / "logs")},
                 "save": {"dir": str(tmp_path / "ckpt"), "every_steps": 3}}
    run_two_ranks(tmp_path, "io", overrides)
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == list(range(1, 7))  # once, not twice
    checkpoints = sorted(p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.startswith("."))  # .lock
    assert checkpoints == ["step_00000003", "step_00000006"]


def test_nccl_presets_set_only_what_is_unset(monkeypatch):
    from vlmfast.engines import apply_nccl_presets

    for key in ("NCCL_IB_DISABLE", "NCCL_NET_GDR_LEVEL", "NCCL_P2P_LEVEL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NCCL_NET_GDR_LEVEL", "2")  # the user's own setting wins
    applied = apply_nccl_presets(["infiniband", "nvlink"])
    assert applied == {"NCCL_IB_DISABLE": "0", "NCCL_P2P_LEVEL": "NVL"}
    assert os.environ["NCCL_NET_GDR_LEVEL"] == "2"
    with pytest.raises(ValueError, match="nccl_presets"):
        TrainSpec(ddp={"nccl_presets": ["fast"]})


def test_environment_without_launcher_is_a_single_process(monkeypatch):
    from vlmfast.engines import distributed_env

    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "TORCHELASTIC_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    env = distributed_env()
    assert (env.rank, env.world_size, env.is_main, env.launcher) == (0, 1, True, "none")
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert (distributed_env().rank, distributed_env().world_size, distributed_env().launcher) == (3, 4, "torchrun")


@pytest.mark.timeout(180)
def test_comm_hook_from_the_spec_trains_and_keeps_ranks_identical(tmp_path):
    ranks = run_two_ranks(tmp_path, "fp16hook", {"ddp": {"comm_hook": "fp16"}})
    reference_params, _ = single_process()
    for name, value in ranks[0]["params"].items():
        assert torch.equal(ranks[1]["params"][name], value), name  # one model on both ranks
        torch.testing.assert_close(value, reference_params[name], rtol=1e-2, atol=1e-3)  # fp16 gradients
    assert ranks[0]["losses"][-1] < ranks[0]["losses"][0]


class UndeclaredLM(TinyCausalLM):
    """Says nothing about its labels: only the probe can tell that it shifts them."""

    loss_shifts_labels = None


def _train_with_rank_zero_too_short_to_probe() -> dict:
    # Rank 0's samples hold 2 positions (too few for the label probe), rank 1's hold 24.
    torch.manual_seed(0)
    data = TokenDataset(64)
    if os.environ["RANK"] == "0":
        data.batch = {k: v[:, :2] for k, v in data.batch.items()}
    trainer = OptimizedTrainer(UndeclaredLM(), data, spec(4, 2))
    result = trainer.fit()
    return {"conventions": trainer.accumulation.conventions, "steps": len(result.history)}


@pytest.mark.timeout(180)
def test_ranks_agree_on_one_label_verdict_when_one_rank_cannot_probe(tmp_path):
    """Seen under load on 2 ranks: rank 0's first samples could not be probed, it raised, rank 1 died in gloo."""
    ranks = spawn_two_ranks(_train_with_rank_zero_too_short_to_probe, tmp_path, "probe")
    assert [r["steps"] for r in ranks] == [6, 6]
    assert ranks[0]["conventions"] == ranks[1]["conventions"]
    assert ranks[0]["conventions"].shifts_labels and ranks[0]["conventions"].shift_source == "measured"
