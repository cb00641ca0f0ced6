"""Activation-checkpointing budget: per-block (and per-op) choices that fit, the same gradient, less recompute."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import LlavaDataset, tiny_llava, token_batch
from torch.utils.flop_counter import FlopCounterMode

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.hooks import (
    apply_activation_checkpointing,
    apply_checkpoint_plan,
    plan_activation_checkpointing,
    saved_tensor_bytes,
)
from vlmfast.models.shapes import ShapesCaptionDataset, VLMCollator
from vlmfast.models.tiny_vlm import TinyVLM, TinyVLMConfig


def _tiny_vlm():
    torch.manual_seed(0)
    config = TinyVLMConfig(text_layers=3, vision_layers=2, text_dim=32, vision_dim=16, text_heads=2, vision_heads=2,
                           image_size=32)
    model = TinyVLM(config)  # fp32: torch has no fast fp64 convolution on CPU; recomputation runs the same kernels
    data = ShapesCaptionDataset(num_samples=2, seed=0)
    return model, VLMCollator(image_size=32)([data[i] for i in range(2)])


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config).double(), token_batch(2, 16)


def _llava():
    data = LlavaDataset(2)
    batch = {k: torch.stack([data[i][k] for i in range(2)]) for k in data[0]}
    batch["pixel_values"] = batch["pixel_values"].double()
    return tiny_llava().double(), batch


def _step(model, batch) -> tuple[float, list[torch.Tensor]]:
    """Matmul-type FLOPs of forward + backward (FlopCounterMode), and the gradients."""
    model.zero_grad()
    with FlopCounterMode(display=False) as counter:
        model(**batch).loss.backward()
    return counter.get_total_flops(), [p.grad.clone() if p.grad is not None else None for p in model.parameters()]


@pytest.mark.parametrize("build", [_tiny_vlm, _llama, _llava], ids=["tiny-vlm", "llama", "llava"])
def test_three_budgets_fit_keep_the_gradient_and_recompute_less_than_every_block(build) -> None:
    model, batch = build()
    model.train()
    none_bytes = saved_tensor_bytes(lambda: model(**batch).loss)
    base_flops, base_grads = _step(model, batch)
    every = copy.deepcopy(model)
    apply_activation_checkpointing(every)
    every_bytes = saved_tensor_bytes(lambda: every(**batch).loss)
    every_flops = _step(every, batch)[0] - base_flops
    assert every_bytes < none_bytes and every_flops > 0
    towers = set()
    for share in (0.3, 0.55, 0.8):
        budget = int(every_bytes + share * (none_bytes - every_bytes))  # every block checkpointed fits it too
        planned = copy.deepcopy(model)
        plan = plan_activation_checkpointing(planned, lambda m=planned: m(**batch).loss, budget)
        apply_checkpoint_plan(planned, plan)
        assert saved_tensor_bytes(lambda m=planned: m(**batch).loss) <= budget
        flops, grads = _step(planned, batch)
        assert flops - base_flops < every_flops  # measured recomputation, not the plan's estimate
        assert [g is None for g in grads] == [g is None for g in base_grads]
        ours = torch.cat([g.flatten() for g in grads if g is not None])
        theirs = torch.cat([g.flatten() for g in base_grads if g is not None])
        assert float((ours - theirs).norm() / theirs.norm()) < 1e-6  # norm-relative over the whole gradient
        towers |= {b.tower for b in plan.costs.blocks}
        assert "budget" in plan.describe() and plan.fits
    assert towers == ({"vision", "language"} if build is not _llama else {"language"})


def test_trainer_plans_from_the_spec_and_reports_it() -> None:
    torch.manual_seed(0)
    model = TinyVLM(TinyVLMConfig(text_layers=2, vision_layers=2))
    data = ShapesCaptionDataset(num_samples=8, seed=0)
    spec = TrainSpec(max_steps=1, batch_size=4, device="cpu", log={"progress": False},
                     memory={"timeline_plot": False, "leak_check": False},
                     activation_checkpointing={"enabled": True, "budget_gb": 0.004})
    trainer = OptimizedTrainer(model, data, spec, collate_fn=VLMCollator())
    result = trainer.fit()
    line = next(s for s in result.report.strategies if s.startswith("activation checkpointing"))
    assert "budget 4.1 MiB" in line and "language_model.layers" in line
    plan = trainer.strategies[[s.name for s in trainer.strategies].index("activation_checkpointing")].plan
    assert plan.fits and plan.kept_bytes <= 0.004 * 2**30


def test_spec_checks() -> None:
    with pytest.raises(ValueError, match="leave every at 1"):
        TrainSpec(activation_checkpointing={"enabled": True, "budget_gb": 1.0, "every": 2})
    with pytest.raises(ValueError, match="enabled: true"):
        TrainSpec(activation_checkpointing={"budget_gb": 1.0})


def test_with_chunked_cross_entropy_the_plan_reserves_no_room_for_logits() -> None:
    from vlmfast.strategies.activation_checkpointing import plan_for_budget

    torch.manual_seed(0)
    model = TinyVLM(TinyVLMConfig(text_layers=2, vision_layers=1, vocab_size=2048))
    standard = plan_for_budget(model, 0.01)
    chunked = plan_for_budget(model, 0.01, chunked_loss=True)
    logits = (model.config.max_text_len - 1) * 2048 * 4  # the fp32 log-softmax of one sample
    assert standard.costs.outside - chunked.costs.outside >= 0.9 * logits
