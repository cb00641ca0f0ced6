"""Micro-batches by token budget: longest first, trimmed, the full-batch gradient, the OOM fallback halves N."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TinyCausalLM, TokenDataset, token_batch

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.hooks import (
    TokenBudget,
    accumulate_gradients,
    plan_token_micro_batches,
    saved_tensor_bytes,
    split_by_tokens,
)
from vlmfast.models.long_tail import collate_per_row_images, long_tailed_samples
from vlmfast.models.tiny_vlm import TinyVLM, TinyVLMConfig
from vlmfast.spec import OOMSpec
from vlmfast.strategies.registry import build_micro_batching as build_sizer
from vlmfast.strategies.token_budget import TokenBudgetSizer, image_token_cost, sample_costs
from vlmfast.testing import simulated_oom


def _grads(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten() for p in model.parameters()])


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).norm() / b.norm())


def test_plan_longest_first_under_the_budget() -> None:
    costs = [900, 20, 30, 400, 1500, 100]
    groups = plan_token_micro_batches(costs, 1000)
    assert groups == [[4], [0], [3, 5], [2, 1]]  # 1500 alone (over budget), then rows x longest <= 1000
    assert all(len(g) * costs[g[0]] <= 1000 for g in groups if costs[g[0]] <= 1000)
    assert plan_token_micro_batches(costs, 10_000, max_rows=2) == [[4, 0], [3, 5], [2, 1]]


def test_split_trims_padding_and_per_row_images() -> None:
    batch = collate_per_row_images(long_tailed_samples(12, max_text=64, max_images=3, seed=1))
    budget = TokenBudget(120)
    parts = budget.split(batch)
    costs = sample_costs(batch)
    assert sorted(sum(p["input_ids"].shape[0] for p in parts) for _ in [0]) == [12]
    for part in parts:
        rows, width = part["input_ids"].shape
        assert rows * width <= 120 or rows == 1  # trimmed to its own longest sample
        assert part["attention_mask"][:, -1].any()  # no all-padding column left
        assert part["pixel_values"].shape[1] == max(int(part["images_per_row"].max()), 1)
        assert part["position_ids"].shape == part["input_ids"].shape
    assert budget.last["micro_batches"] == len(parts) and budget.last["real_tokens"] == sum(costs)
    # left padding is cut too
    left = {k: v.flip(-1) if v.dim() == 2 else v for k, v in token_batch(4, 10).items()}
    assert all(p["attention_mask"][:, 0].any() for p in split_by_tokens(left, 12))


def test_refuses_layouts_it_cannot_split() -> None:
    batch = token_batch(4, 10)
    batch["pixel_values"] = torch.zeros(7, 3, 8, 8)  # flattened images of 4 samples: rows unknown
    with pytest.raises(ValueError, match=r"'pixel_values' holds the images of all samples.*image token id is unknown"):
        split_by_tokens(batch, 20)
    with pytest.raises(ValueError, match="dict batches"):
        TokenBudget(20).split([torch.zeros(2, 3)])


def _tiny_vlm() -> TinyVLM:
    torch.manual_seed(0)
    return TinyVLM(TinyVLMConfig(vocab_size=64, text_dim=32, vision_dim=16, max_text_len=160)).double()


def test_gradient_equals_the_full_batch_on_a_long_tailed_vlm_batch() -> None:
    """0-8 images, 8-128 text tokens: the split by tokens gives the full-batch gradient (fp64)."""
    batch = collate_per_row_images(long_tailed_samples(16, max_text=128, seed=2))
    batch["pixel_values"] = batch["pixel_values"].double()
    model = _tiny_vlm()
    reference = copy.deepcopy(model)
    accumulate_gradients(reference, batch, micro_batch_size=16)
    budget = TokenBudget(300)
    accumulate_gradients(model, batch, budget)
    assert budget.last["micro_batches"] >= 3
    assert _relative(_grads(model), _grads(reference)) < 1e-10


def _text_rows(tokens: int, rows: int) -> dict[str, torch.Tensor]:
    """``rows`` text-only rows holding ``tokens`` tokens in all: what a budget of that many tokens stands for."""
    g = torch.Generator().manual_seed(0)
    samples = [{"input_ids": torch.randint(3, 64, (tokens // rows,), generator=g), "images": torch.zeros(0, 3, 48, 48)}
               for _ in range(rows)]
    return collate_per_row_images([{**s, "labels": s["input_ids"]} for s in samples])


def test_saved_bytes_per_micro_batch_stay_within_the_budgets_share() -> None:
    """Each micro-batch keeps no more for backward than N tokens of text keep (the budget's share), whatever its mix
    of long and short samples and images, although it holds many more short samples than N // longest."""
    batch = collate_per_row_images(long_tailed_samples(24, max_text=128, seed=3))
    torch.manual_seed(0)
    # The built-in VLM's own sizes: at the 32/16 widths of _tiny_vlm a 48-pixel image's input outweighs its patches.
    model = TinyVLM(TinyVLMConfig(vocab_size=64, max_text_len=160))
    per_image = image_token_cost(model)  # the vision tower's 9 patches; the placeholders are in input_ids
    budget = TokenBudget(4 * 64, image_tokens=per_image)
    share = saved_tensor_bytes(lambda: model(**_text_rows(4 * 64, 4)).loss)
    peaks = [saved_tensor_bytes(lambda mb=mb: model(**mb).loss) for mb in budget.split(batch)]
    assert max(peaks) <= share
    assert budget.last["micro_batch_rows"] > 256 // max(sample_costs(batch, per_image))


def _spec(**extra) -> TrainSpec:
    return TrainSpec(max_steps=1, batch_size=8, device="cpu", optimizer={"name": "sgd", "lr": 1.0},
                     log={"progress": False}, memory={"timeline_plot": False, "leak_check": False}, **extra)


def _with_token_sizer(trainer: OptimizedTrainer) -> OptimizedTrainer:
    """Stand-in for the loop line `self.micro_batching = build_sizer(spec, model, ...)` (issue 21 report)."""
    sizer = build_sizer(trainer.spec, trainer.engine.module)
    trainer.strategies[trainer.strategies.index(trainer.micro_batching)] = sizer
    trainer.micro_batching = sizer
    return trainer


def test_through_the_trainer_same_update_and_reported() -> None:
    data = TokenDataset(8, 24)
    torch.manual_seed(0)
    model = TinyCausalLM().double()
    full = OptimizedTrainer(copy.deepcopy(model), data, _spec())
    full.fit()
    trainer = _with_token_sizer(OptimizedTrainer(model, data, _spec(micro_batch_tokens=48)))
    result = trainer.fit()
    row = result.history[-1]
    assert row["micro_batches"] >= 3 and row["micro_batch_tokens"] <= 48
    for ours, theirs in zip(trainer.engine.module.parameters(), full.engine.module.parameters(), strict=True):
        assert torch.allclose(ours, theirs, rtol=0, atol=1e-12)
    assert any("micro-batches by tokens: 48 tokens" in line for line in result.report.strategies)


def test_the_loop_builds_the_token_sizer() -> None:
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(8, 24), _spec(micro_batch_tokens=48))
    assert isinstance(trainer.micro_batching, TokenBudgetSizer)


def test_oom_fallback_halves_the_token_budget_and_keeps_the_gradient() -> None:
    batch = token_batch(8, 24)
    torch.manual_seed(0)
    model = TinyCausalLM().double()
    reference = copy.deepcopy(model)
    accumulate_gradients(reference, batch, micro_batch_size=8)
    sizer = TokenBudgetSizer(200, oom=OOMSpec(enabled=True, grow_after_steps=1))
    with simulated_oom(2) as oom:  # more than 2 rows per forward "runs out of memory"
        sizer.run(lambda size: accumulate_gradients(model, batch, size), cleanup=lambda: model.zero_grad())
    assert oom.count >= 1 and sizer.budget.tokens < 200 and sizer.micro_batch_size <= 2
    assert sizer.events[0]["reason"] == "out of memory"
    assert _relative(_grads(model), _grads(reference)) < 1e-10
    model.zero_grad()
    sizer.run(lambda size: accumulate_gradients(model, batch, size), cleanup=lambda: model.zero_grad())
    assert sizer.events[-1]["reason"] == "1 clean steps"  # grows back toward the configured budget


def test_build_sizer_charges_images_by_the_models_layout() -> None:
    torch.manual_seed(0)
    tiny = TinyVLM(TinyVLMConfig(text_dim=32, vision_dim=16))
    sizer = build_sizer(TrainSpec(batch_size=8, micro_batch_tokens=100), tiny)
    assert isinstance(sizer, TokenBudgetSizer) and sizer.budget.image_tokens == 9  # the vision tower's patches
    assert sizer.budget.prepended_tokens == 9  # padded rows: the model puts 9 image tokens before the text
    packed = build_sizer(TrainSpec(batch_size=8, micro_batch_tokens=512, packing={"enabled": True,
                                                                                 "max_tokens": 256}), tiny)
    assert packed.budget.prepended_tokens == 0  # packed rows hold the placeholders already
    assert type(build_sizer(TrainSpec(batch_size=8), tiny)).__name__ == "FixedMicroBatchSize"
    with pytest.raises(ValueError, match=r"packing\.max_tokens"):
        TrainSpec(batch_size=8, micro_batch_tokens=100, packing={"enabled": True, "max_tokens": 256})


def _uneven_llava_batch() -> dict[str, torch.Tensor]:
    """8 LLaVA samples holding 2, 0, 1, 2, 0, 1, 1, 1 images: 8 images over 8 rows, so ``pixel_values`` has as many
    rows as the batch by coincidence; right-padded text of different lengths after each sample's image tokens."""
    from conftest import IMAGE_TOKEN

    counts, g = [2, 0, 1, 2, 0, 1, 1, 1], torch.Generator().manual_seed(3)
    rows = [[IMAGE_TOKEN] * 4 * k + torch.randint(1, 60, (3 + 2 * i,), generator=g).tolist()
            for i, k in enumerate(counts)]
    width = max(map(len, rows))
    ids, mask = torch.zeros(8, width, dtype=torch.long), torch.zeros(8, width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    labels = torch.where((mask == 1) & (ids != IMAGE_TOKEN), ids, -100)
    pixels = torch.rand(sum(counts), 3, 16, 16, generator=g)
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "pixel_values": pixels}


def test_images_that_match_the_rows_by_coincidence_stay_with_their_samples() -> None:
    """The bug this guards: a first-dimension-equals-rows rule took pixel_values[rows] as each row's image, so each
    micro-batch trained on other samples' images (and counts that matched the image tokens would train silently)."""
    from conftest import IMAGE_TOKEN, tiny_llava

    from vlmfast.data.batch_layout import BatchLayout

    model = tiny_llava().double()
    batch = _uneven_llava_batch()
    batch["pixel_values"] = batch["pixel_values"].double()
    assert batch["pixel_values"].shape[0] == batch["input_ids"].shape[0]  # the coincidence
    model(**batch).loss.backward()
    reference = _grads(model)
    model.zero_grad()
    budget = TokenBudget(2 * batch["input_ids"].shape[1], layout=BatchLayout.from_model(model))
    loss = accumulate_gradients(model, batch, budget)
    assert budget.last["micro_batches"] >= 3 and torch.isfinite(loss)
    assert _relative(_grads(model), reference) < 1e-10  # float64: the split changes nothing
    parts = budget.split(batch)
    images = [int(p["pixel_values"].shape[0]) if "pixel_values" in p else 0 for p in parts]
    tokens = [int((p["input_ids"] == IMAGE_TOKEN).sum()) // 4 for p in parts]
    assert images == tokens  # every micro-batch got exactly its samples' images
