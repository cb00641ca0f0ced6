"""FSDP2 backend on 2 CPU processes (gloo): the same training as one process, bf16 policy, exact resume."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyCausalLM, TokenDataset, spawn_two_ranks

from vlmfast import OptimizedTrainer, TrainSpec


def _worker(spec: dict, kind: str) -> dict:
    torch.manual_seed(0)
    if kind == "vlm":
        from vlmfast.models import build_tiny_vlm_task

        model, data, collate = build_tiny_vlm_task(seed=0, num_samples=256)
    else:
        model, data, collate = TinyCausalLM(), TokenDataset(64), None
    trainer = OptimizedTrainer(model, data, TrainSpec(**spec), collate_fn=collate)
    result = trainer.fit()
    params = {n: p.detach().full_tensor().float() for n, p in trainer.model.named_parameters()}
    units = [m for m in trainer.model.modules() if m is not trainer.model and hasattr(m, "_get_fsdp_state")]
    # A block that reshards after forward has a post-forward mesh (torch's private state: the flag's effect).
    resharded = [m._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None for m in units]
    return {"params": params, "losses": [m["loss"] for m in result.history], "resharded": resharded,
            "sharded": type(next(trainer.model.parameters())).__name__,
            "strategies": result.report.strategies}


def run_two_ranks(tmp_path, name: str, spec: dict, kind: str = "lm") -> list[dict]:
    return spawn_two_ranks(_worker, tmp_path, name, spec, kind)


def base_spec(**overrides) -> dict:
    spec = {"max_steps": 6, "batch_size": 4, "micro_batch_size": 2, "optimizer": {"lr": 1e-2}, "grad_clip": 1.0,
            "log": {"progress": "off"}}
    spec.update(overrides)
    return spec


@pytest.mark.timeout(240)
def test_fsdp_gives_the_same_training_as_one_process_with_the_global_batch(tmp_path):
    ranks = run_two_ranks(tmp_path, "fsdp", base_spec(engine="fsdp", fsdp={"blocks": ["mix", "head"],
                                                                      "reshard_after_forward": False}))
    torch.manual_seed(0)
    single = OptimizedTrainer(TinyCausalLM(), TokenDataset(64), TrainSpec(**base_spec(batch_size=8,
                                                                                      micro_batch_size=4)))
    reference = single.fit()
    assert ranks[0]["sharded"] == "DTensor"  # the parameters really are sharded
    assert any("fsdp2: 3 sharded units" in line for line in ranks[0]["strategies"])
    assert ranks[0]["resharded"] == [False, False]  # reshard_after_forward: false keeps blocks gathered
    for rank in ranks:
        assert rank["losses"] == pytest.approx([m["loss"] for m in reference.history], rel=1e-5)
        for name, value in single.model.named_parameters():
            torch.testing.assert_close(rank["params"][name], value.detach(), rtol=1e-5, atol=1e-6)


@pytest.mark.timeout(300)
def test_fsdp_trains_the_tiny_vlm_in_bf16_and_resumes_exactly(tmp_path):
    common = dict(max_steps=8, batch_size=8, micro_batch_size=4, precision="bf16", optimizer={"lr": 3e-3},
                  engine="fsdp")
    full = run_two_ranks(tmp_path, "full", base_spec(**common, save={"dir": str(tmp_path / "a"), "every_steps": 4}),
                         kind="vlm")
    losses = full[0]["losses"]
    assert full[0]["resharded"] and all(full[0]["resharded"])  # the default frees each block after forward
    assert sum(losses[-2:]) < sum(losses[:2]) * 0.9, losses
    resumed = run_two_ranks(tmp_path, "resumed", base_spec(**common, save={
        "dir": str(tmp_path / "b"), "resume": str(tmp_path / "a" / "step_00000004")}), kind="vlm")
    assert resumed[0]["losses"] == pytest.approx(losses[4:], rel=1e-4)
    for name, value in full[0]["params"].items():
        torch.testing.assert_close(resumed[0]["params"][name], value, rtol=1e-3, atol=1e-4)
