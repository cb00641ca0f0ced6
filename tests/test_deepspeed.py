"""DeepSpeed ZeRO backend on 2 CPU processes (gloo): same training as the DDP path, trains the tiny VLM, resumes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from conftest import TinyCausalLM, TokenDataset, spawn_two_ranks

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.spec import SpecError

deepspeed = pytest.importorskip("deepspeed")
from vlmfast.engines.deepspeed import build_deepspeed_config  # noqa: E402


def _task(kind: str):
    torch.manual_seed(0)
    if kind == "vlm":
        from vlmfast.models import build_tiny_vlm_task

        return build_tiny_vlm_task(seed=0, num_samples=256)
    return TinyCausalLM(), TokenDataset(64), None


def _worker(spec: dict, kind: str) -> dict:
    model, data, collate = _task(kind)
    trainer = OptimizedTrainer(model, data, TrainSpec(**spec), collate_fn=collate)
    result = trainer.fit()
    params = {n: p.detach().float().clone() for n, p in trainer.model.module.named_parameters()}
    if spec.get("deepspeed", {}).get("zero_stage") == 3:  # sharded: gather the full weights to compare
        with deepspeed.zero.GatheredParameters(list(trainer.model.module.parameters())):
            params = {n: p.detach().float().clone() for n, p in trainer.model.module.named_parameters()}
    return {"params": params, "losses": [m["loss"] for m in result.history],
            "engine": type(trainer.model).__name__, "resumed_from": str(result.resumed_from),
            "strategies": result.report.strategies}


def run_two_ranks(tmp_path, name: str, spec: dict, kind: str = "lm") -> list[dict]:
    return spawn_two_ranks(_worker, tmp_path, name, spec, kind)


def base_spec(**overrides) -> dict:
    spec = {"max_steps": 6, "batch_size": 4, "micro_batch_size": 2, "optimizer": {"lr": 1e-2},
            "log": {"progress": "off"}}
    spec.update(overrides)
    return spec


@pytest.mark.timeout(240)
def test_zero2_gives_the_same_training_as_one_process_with_the_global_batch(tmp_path):
    ranks = run_two_ranks(tmp_path, "z2", base_spec(engine="deepspeed", deepspeed={"zero_stage": 2}, grad_clip=1.0))
    torch.manual_seed(0)
    single = OptimizedTrainer(TinyCausalLM(), TokenDataset(64),
                              TrainSpec(**base_spec(batch_size=8, micro_batch_size=4, grad_clip=1.0)))
    reference = single.fit()
    assert ranks[0]["engine"] == "DeepSpeedEngine"
    for rank in ranks:
        # The micro-batch split, token weighting and clipping are the DDP path's: same losses, same weights.
        assert rank["losses"] == pytest.approx([m["loss"] for m in reference.history], rel=1e-5)
        for name, value in single.model.named_parameters():
            torch.testing.assert_close(rank["params"][name], value.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stage", [2, 3])
def test_zero_trains_the_tiny_vlm_in_bf16_and_resumes_exactly(tmp_path, stage):
    common = dict(max_steps=8, batch_size=8, micro_batch_size=4, precision="bf16",
                  optimizer={"lr": 3e-3}, engine="deepspeed", deepspeed={"zero_stage": stage})
    full = run_two_ranks(tmp_path, "full", base_spec(**common, save={"dir": str(tmp_path / "a"), "every_steps": 4}),
                         kind="vlm")
    losses = full[0]["losses"]
    assert full[0]["losses"] == full[1]["losses"]
    assert sum(losses[-2:]) < sum(losses[:2]) * 0.9, losses  # it learns
    assert f"deepspeed: ZeRO-{stage}, bf16" in full[0]["strategies"]
    shards = os.listdir(tmp_path / "a" / "step_00000004" / "deepspeed")
    assert sum("optim_states" in name for name in shards) == 2, shards  # one optimizer shard per rank

    # Resume from step 4 of the first run: steps 5..8 repeat exactly (model, optimizer, data position, RNG).
    resumed = run_two_ranks(tmp_path, "resumed", base_spec(**common, save={
        "dir": str(tmp_path / "b"), "resume": str(tmp_path / "a" / "step_00000004")}), kind="vlm")
    assert resumed[0]["resumed_from"].endswith("step_00000004")
    assert resumed[0]["losses"] == pytest.approx(losses[4:], rel=1e-4)
    for name, value in full[0]["params"].items():
        torch.testing.assert_close(resumed[0]["params"][name], value, rtol=1e-3, atol=1e-4)


def test_config_comes_from_the_spec_and_merges_the_users_json(tmp_path):
    user = tmp_path / "ds.json"
    user.write_text(json.dumps({"zero_optimization": {"stage": 1, "round_robin_gradients": True},
                                "bf16": {"enabled": "auto"}, "wall_clock_breakdown": True}))
    spec = TrainSpec(batch_size=8, micro_batch_size=2, precision="bf16", grad_clip=0.5,
                     engine="deepspeed", deepspeed={"zero_stage": 3, "offload_optimizer": "cpu", "config": str(user)})
    config = build_deepspeed_config(spec, world_size=4)
    assert config["zero_optimization"]["stage"] == 3  # the spec's field wins over the JSON
    assert config["zero_optimization"]["round_robin_gradients"] is True  # the JSON's own keys stay
    assert config["zero_optimization"]["offload_optimizer"]["device"] == "cpu"
    assert config["wall_clock_breakdown"] is True
    assert (config["train_micro_batch_size_per_gpu"], config["train_batch_size"]) == (2, 8)
    assert config["bf16"]["enabled"] is True and config["fp16"]["enabled"] is False
    assert config["gradient_clipping"] == 0.5 and config["managed_gradient_accumulation"] is False


def test_conflicts_and_unsupported_combinations_fail_before_any_work(tmp_path):
    conflicting = TrainSpec(precision="bf16", engine="deepspeed", deepspeed={"config": {"fp16": {"enabled": True}}})
    with pytest.raises(SpecError, match="fp16"):
        build_deepspeed_config(conflicting, world_size=1)
    with pytest.raises(SpecError, match="optimizer"):
        build_deepspeed_config(TrainSpec(engine="deepspeed", deepspeed={"config": {"optimizer": {"type": "Adam"}}}), 1)
    for bad, message in [({"oom": {"enabled": True}}, "oom.enabled"),
                         ({"ddp": {"comm_hook": "fp16"}}, "comm_hook"),
                         ({"loss": {"on_nonfinite": "skip"}}, "on_nonfinite"),
                         ({"deepspeed": {"offload_param": "cpu"}}, "zero_stage 3"),
                         ({"deepspeed": {"config": str(tmp_path / "missing.json")}}, "not found")]:
        with pytest.raises(ValueError, match=message):
            TrainSpec(**{"engine": "deepspeed", **bad})


def _single_process(rank: int, out: str) -> None:
    # No launcher environment at all: `vlmfast train --set engine=deepspeed` on one GPU (or CPU).
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(64), TrainSpec(**base_spec(
        batch_size=8, micro_batch_size=4, engine="deepspeed", deepspeed={"zero_stage": 2})))
    torch.save([m["loss"] for m in trainer.fit().history], out)


@pytest.mark.timeout(180)
def test_zero_runs_in_a_single_process_without_a_launcher(tmp_path):
    out = str(tmp_path / "single")
    torch.multiprocessing.spawn(_single_process, args=(out,), nprocs=1)
    losses = torch.load(out)
    assert len(losses) == 6 and losses[-1] < losses[0]
