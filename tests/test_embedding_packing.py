"""Packing by embeddings (``packing.level: embeddings``): the row layout's pure logic, the exactness probe catching
what is not kept per document, and the trainer on the built-in tiny VLM. Every zoo family: test_zoo_packing.py."""

from __future__ import annotations

import pytest
import torch

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.data.packed_rows import RowLayout
from vlmfast.data.packing import PackingError
from vlmfast.models import build_tiny_vlm_task
from vlmfast.strategies.embedding_packing import EmbeddingPacking, find_language_model

MASK = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])  # right and left padded


def test_the_layout_packs_every_real_token_once_and_unpacks_them_in_place() -> None:
    layout = RowLayout.plan(MASK, max_tokens=6)
    assert sorted(n for row in layout.document_lengths for n in row) == [1, 3, 3, 5]
    assert all(sum(row) <= 6 for row in layout.document_lengths) and layout.rows == 2  # 5 + 1, 3 + 3
    values = torch.arange(1.0, 21.0).view(4, 5, 1).repeat(1, 1, 2)
    packed = layout.pack(values)
    assert packed.shape == (2, layout.width, 2)
    assert sorted(packed[..., 0][packed[..., 0] != 0].tolist()) == sorted(values[..., 0][MASK.bool()].tolist())
    back = layout.unpack(packed)
    assert torch.equal(back[MASK.bool()], values[MASK.bool()]) and not back[~MASK.bool()].any()
    # every document's positions restart at 0, the padding tail restarts too
    for r, row in enumerate(layout.document_lengths):
        starts = [sum(row[:k]) for k in range(len(row))]
        assert all(layout.positions[r, s] == 0 for s in starts)


def test_gradients_flow_back_to_the_real_tokens_only() -> None:
    layout = RowLayout.plan(MASK, max_tokens=8)
    x = torch.randn(4, 5, 3, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(layout.rows, layout.width, 3, dtype=torch.float64)
    (layout.pack(x) * weights).sum().backward()
    assert not x.grad[~MASK.bool()].any()
    expected = layout.unpack(weights)  # each real token gets its slot's weight
    torch.testing.assert_close(x.grad, expected)


def test_a_4d_mask_is_gathered_per_document_and_blocks_the_rest() -> None:
    layout = RowLayout.plan(MASK, max_tokens=8)
    own = torch.rand(4, 1, 5, 5) > 0.3  # any mask the model built
    packed = layout.pack_mask(own)
    b = (layout.source // 5).view(layout.rows, layout.width)
    t = (layout.source % 5).view(layout.rows, layout.width)
    real = layout.real.view(layout.rows, layout.width)
    for r in range(layout.rows):
        for i in range(layout.width):
            for j in range(layout.width):
                same = real[r, i] and real[r, j] and layout.document[r, i] == layout.document[r, j]
                expected = bool(own[b[r, i], 0, t[r, i], t[r, j]]) if same else (i == j and not real[r, i])
                assert bool(packed[r, 0, i, j]) == expected
    additive = layout.pack_mask(torch.where(own, 0.0, torch.finfo(torch.float32).min))
    assert torch.equal(additive == 0, packed)


def test_values_listed_under_a_token_mask_follow_their_tokens() -> None:
    layout = RowLayout.plan(MASK, max_tokens=6)
    selected = torch.zeros(4, 5, dtype=torch.bool)
    selected[0, 1] = selected[1, 3] = selected[2, 0] = selected[2, 4] = True
    token_ids = torch.arange(20).view(4, 5)
    values = token_ids[selected].float()[:, None]  # one value per selected token, in the padded order
    reordered = layout.pack_selected(selected, values)
    assert torch.equal(reordered[:, 0].long(), layout.pack(token_ids)[layout.pack(selected)])


def test_mrope_positions_keep_their_own_channels_and_restart_channel_0() -> None:
    layout = RowLayout.plan(MASK, max_tokens=8)
    own = torch.randint(0, 50, (3, 4, 5))
    packed = layout.pack_positions(own)
    assert packed.shape == (4, layout.rows, layout.width)
    assert torch.equal(packed[0], layout.positions)
    assert torch.equal(packed[1:], layout.pack(own.permute(1, 2, 0)).permute(2, 0, 1))


def test_a_mask_with_holes_is_refused() -> None:
    with pytest.raises(ValueError, match="one run"):
        RowLayout.plan(torch.tensor([[1, 0, 1]]), max_tokens=8)


@pytest.fixture(scope="module")
def tiny():
    model, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=32)
    return model, dataset, collate


def test_the_probe_finds_the_language_model_and_catches_documents_that_see_each_other(tiny) -> None:
    model, dataset, collate = tiny
    batch = collate([dataset[i] for i in range(6)])
    packing = EmbeddingPacking(max_tokens=4096)
    packing.install(model, batch)
    try:
        assert find_language_model(model, batch) is model.language_model  # not the vision tower's blocks
        assert packing.check(model, batch) <= 1e-5
        # Positions that run on across documents and no mask: the documents attend to each other, measured
        real_plan = RowLayout.plan

        def leaky(*args, **kwargs):
            layout = real_plan(*args, **kwargs)
            layout.positions = torch.arange(layout.width).expand(layout.rows, -1).contiguous()
            layout.document = torch.zeros_like(layout.document)
            return layout

        RowLayout.plan = leaky
        try:
            with pytest.raises(PackingError, match=r"not exact for TinyVLM.*with positions.*with document mask"):
                packing.check(model, batch)
        finally:
            RowLayout.plan = real_plan
    finally:
        packing.remove()


def test_trainer_packing_by_embeddings_trains_the_same_as_padding(tiny) -> None:
    """Micro-batches of 4 padded samples, each packed into rows of 64 tokens at the language model: the same losses
    and weights as the padded run, on fewer rows."""
    _, dataset, collate = tiny

    def run(packing: dict, **extra: dict) -> tuple[OptimizedTrainer, list[dict]]:
        model, _, _ = build_tiny_vlm_task(seed=0, num_samples=32)
        model.double()
        spec = TrainSpec(max_steps=2, batch_size=8, micro_batch_size=4, optimizer={"name": "sgd", "lr": 0.5},
                         data={"shuffle": False}, log={"progress": "off"}, packing=packing, device="cpu", **extra)
        trainer = OptimizedTrainer(model, dataset, spec, collate_fn=lambda s: _double(collate(s)))
        return trainer, trainer.fit().history

    padded, padded_history = run({"enabled": False})
    packed, packed_history = run({"enabled": True, "level": "embeddings", "max_tokens": 64})
    # with the chunked loss (the hidden states come back unpacked) and checkpointed blocks inside the packed call
    combined, combined_history = run({"enabled": True, "level": "embeddings", "max_tokens": 64},
                                     linear_cross_entropy={"enabled": True},
                                     activation_checkpointing={"enabled": True})
    assert [m["loss"] for m in packed_history] == pytest.approx([m["loss"] for m in padded_history], rel=1e-10)
    assert [m["tokens"] for m in packed_history] == [m["tokens"] for m in padded_history]
    strategy = next(s for s in packed.strategies if s.name == "packing")
    assert strategy.packing.rows < strategy.packing.padded_rows  # rows of 64 tokens hold several samples
    assert "packing by embeddings: LanguageModel" in strategy.describe()
    a = torch.cat([p.detach().flatten() for p in padded.model.parameters()])
    for trainer, tolerance in ((packed, 1e-12), (combined, 1e-7)):  # the chunked loss's own rounding: ~4e-9
        b = torch.cat([p.detach().flatten() for p in trainer.model.parameters()])
        assert float((a - b).norm() / a.norm()) <= tolerance
    assert [m["loss"] for m in combined_history] == pytest.approx([m["loss"] for m in padded_history], rel=1e-7)
    report = "\n".join(s.describe() for s in combined.strategies)
    assert "linear cross-entropy: torch" in report and "activation checkpointing" in report


def _double(batch: dict) -> dict:
    return {k: v.double() if torch.is_tensor(v) and v.is_floating_point() else v for k, v in batch.items()}


def test_a_document_longer_than_the_budget_gets_a_row_of_its_own() -> None:
    layout = RowLayout.plan(MASK, max_tokens=2)
    assert sorted(map(sorted, layout.document_lengths)) == [[1, 3], [3], [5]]


def test_calls_that_build_a_kv_cache_are_not_packed() -> None:
    """With a cache being built the model's mask ignores restarting positions: such a call runs padded."""
    from conftest import tiny_llama

    model = tiny_llama()
    batch = {"input_ids": torch.randint(3, 50, (3, 7)),
             "attention_mask": torch.tensor([[1] * 7, [1] * 4 + [0] * 3, [1] * 2 + [0] * 5])}
    packing = EmbeddingPacking(max_tokens=64)
    packing.install(model, batch)
    with torch.no_grad():
        model(**batch, use_cache=False)
        assert packing.calls == 1
        model(**batch, use_cache=True)
        assert packing.calls == 1
    packing.remove()


def test_loader_row_fields_are_refused_at_the_embeddings_level() -> None:
    with pytest.raises(ValueError, match=r"packing\.pad_to_max_tokens shapes the loader's packed rows"):
        TrainSpec(packing={"enabled": True, "level": "embeddings", "pad_to_max_tokens": True})
