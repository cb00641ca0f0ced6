"""OptimizedTrainer end to end: model kinds, exact resume, optimizer features (faults: tests/faults/)."""

from __future__ import annotations

import pytest
import torch
from conftest import TinyCausalLM, TokenDataset, tiny_llama
from torch.utils.data import TensorDataset

from vlmfast import OptimizedTrainer, TrainSpec


def make_spec(**overrides):
    base = {"max_steps": 12, "batch_size": 8, "micro_batch_size": 2, "optimizer": {"lr": 1e-2},
            "log": {"progress": "off"}}
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return TrainSpec(**base)


def train(spec, model=None, data=None, **kwargs):
    torch.manual_seed(1234)  # a different init each time unless the trainer seeds (it does: spec.seed)
    trainer = OptimizedTrainer(model or TinyCausalLM(dropout=0.1), data or TokenDataset(64), spec, **kwargs)
    return trainer, trainer.fit()


def params_of(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_plain_module_returning_a_tensor_learns():
    torch.manual_seed(0)
    x = torch.randn(128, 6)
    y = x @ torch.randn(6, 1)

    class Regressor(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.linear = torch.nn.Linear(6, 1)

        def forward(self, x, y):
            return torch.nn.functional.mse_loss(self.linear(x), y)

    _, result = train(make_spec(max_steps=60, optimizer={"lr": 0.1}), Regressor(), TensorDataset(x, y))
    assert result.history[-1]["loss"] < 0.1 * result.history[0]["loss"]
    assert result.history[-1]["micro_batch_size"] == 2 and result.history[-1]["accumulation_steps"] == 4


def test_hugging_face_model_from_a_tiny_config_learns():
    trainer, result = train(make_spec(max_steps=25), tiny_llama(), TokenDataset(64))
    assert trainer.accumulation.passes_num_items
    assert result.history[-1]["loss"] < result.history[0]["loss"] - 0.5


def test_resume_reproduces_the_uninterrupted_trajectory_exactly(tmp_path):
    _, full = train(make_spec())
    first = make_spec(max_steps=6, save={"dir": str(tmp_path), "every_steps": 3})
    _, head = train(first)
    assert [m["loss"] for m in head.history] == [m["loss"] for m in full.history[:6]]
    _, tail = train(make_spec(save={"dir": str(tmp_path)}))  # resume: auto
    assert tail.resumed_from is not None and tail.resumed_from.name == "step_00000006"
    assert [m["step"] for m in tail.history] == list(range(7, 13))
    assert [m["loss"] for m in tail.history] == [m["loss"] for m in full.history[6:]]


def test_freeze_keeps_named_modules_unchanged_and_bad_patterns_fail():
    model = TinyCausalLM()
    before = params_of(model)
    trainer, _ = train(make_spec(max_steps=3, optimizer={"freeze": ["embed"]}), model)
    after = params_of(trainer.model)
    assert torch.equal(before["embed.weight"], after["embed.weight"])
    assert not torch.equal(before["head.weight"], after["head.weight"])
    with pytest.raises(ValueError, match="'vision_tower' matches no parameter; top-level modules are"):
        train(make_spec(optimizer={"freeze": ["vision_tower"]}))


def test_param_groups_get_their_own_lr_and_no_decay_for_1d_tensors():
    spec = make_spec(max_steps=1, optimizer={"lr": 1e-2, "weight_decay": 0.1,
                                             "param_groups": [{"modules": ["head"], "lr": 1e-4}]})
    trainer, _ = train(spec)
    groups = {g["label"]: (g["lr"], g["weight_decay"]) for g in trainer.optimizer.param_groups}
    assert groups["head (decay)"] == (1e-4, 0.1)
    assert groups["head (no decay)"] == (1e-4, 0.0)
    assert groups["embed, mix (decay)"] == (1e-2, 0.1)
    assert groups["mix, norm (no decay)"] == (1e-2, 0.0)


@pytest.mark.parametrize(("precision", "dtype"), [("fp32", torch.float32), ("bf16", torch.bfloat16)])
def test_precision_really_changes_the_compute_dtype(precision, dtype):
    model = TinyCausalLM()
    seen = []
    # Training forwards only: the label-convention probe (no grad, once) runs outside the precision context.
    model.mix.register_forward_hook(lambda mod, inp, out: seen.append(out.dtype) if torch.is_grad_enabled() else None)
    _, result = train(make_spec(max_steps=2, precision=precision), model)
    assert set(seen) == {dtype}
    assert all(p.dtype == torch.float32 for p in model.parameters())  # master weights stay fp32
    assert torch.isfinite(torch.tensor(result.history[-1]["loss"]))


def test_grad_clip_bounds_the_norm_the_optimizer_sees():
    norms = []
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(64), make_spec(max_steps=3, grad_clip=1e-3))
    trainer.optimizer.register_step_pre_hook(lambda opt, *_: norms.append(torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for g in opt.param_groups for p in g["params"]])).item()))
    result = trainer.fit()
    assert all(m["grad_norm"] > 1e-2 for m in result.history)  # pre-clip norm is reported
    assert max(norms) <= 1e-3 * (1 + 1e-4)


def test_metrics_jsonl_tensorboard_and_report_are_written(tmp_path):
    _, result = train(make_spec(max_steps=4, log={"dir": str(tmp_path), "tensorboard": True, "memory_every_steps": 2}))
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 4 and '"samples_per_s"' in lines[0]
    assert ['"mem/peak_gb"' in line for line in lines] == [True, True, False, True]
    assert list(tmp_path.glob("events.out.tfevents.*"))
    assert (tmp_path / "report.json").exists()
    text = result.report.to_text()
    assert "samples/s" in text and "accumulation: 4 micro-batch(es) of 2" in text and "weighted by loss tokens" in text


def test_eval_loss_is_token_weighted_and_independent_of_micro_batch_size():
    losses = []
    for mbs in (1, 8):
        torch.manual_seed(0)
        trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(64), make_spec(max_steps=1, micro_batch_size=mbs),
                                   eval_data=TokenDataset(16, seed=5))
        losses.append(trainer.evaluate())
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_user_dataloader_with_a_mismatched_batch_size_is_refused():
    loader = torch.utils.data.DataLoader(TokenDataset(64), batch_size=4)
    with pytest.raises(ValueError, match="yields batches of 4 but batch_size is 8"):
        train(make_spec(), data=loader)


def test_hugging_face_llava_with_frozen_vision_tower_and_projector_lr():
    from conftest import LlavaDataset, tiny_llava

    model = tiny_llava()
    before = params_of(model)
    spec = make_spec(max_steps=30, optimizer={"lr": 3e-3, "freeze": ["vision_tower"],
                                              "param_groups": [{"modules": ["multi_modal_projector"], "lr": 1e-2}]})
    trainer, result = train(spec, model, LlavaDataset(64))
    after = params_of(trainer.model)
    vision = [n for n in before if ".vision_tower." in n]
    assert vision and all(torch.equal(before[n], after[n]) for n in vision)
    assert any(g["lr"] == 1e-2 and "model" in g["label"] for g in trainer.optimizer.param_groups)
    assert result.history[-1]["loss"] < result.history[0]["loss"] - 0.5


def test_activation_checkpointing_through_the_spec_keeps_the_trajectory():
    from vlmfast.models import build_tiny_vlm_task

    losses = []
    for enabled in (False, True):
        model, data, collate = build_tiny_vlm_task(seed=0, num_samples=64)
        spec = make_spec(max_steps=3, activation_checkpointing={"enabled": enabled, "scope": "language_model"})
        trainer = OptimizedTrainer(model, data, spec, collate_fn=collate)
        losses.append([m["loss"] for m in trainer.fit().history])
        if enabled:
            checkpointing = next(s for s in trainer.strategies if s.name == "activation_checkpointing")
            assert "activation checkpointing" in checkpointing.describe()
            assert checkpointing.blocks  # something was really wrapped
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)


def test_history_is_bounded_for_long_runs_and_the_report_counts_every_step():
    _, full = train(make_spec(max_steps=20))
    _, bounded = train(make_spec(max_steps=20, log={"history_steps": 4}))
    assert 4 <= len(bounded.history) <= 5 and bounded.history[-1]["step"] == 20  # the latest steps are kept
    assert bounded.report.steps == 20 and bounded.report.first_loss == full.history[0]["loss"]
