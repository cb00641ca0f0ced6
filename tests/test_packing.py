"""Sequence packing: rows fill the budget, packed and padded batches give the same losses and gradients.

Usage: ``python -m pytest tests/test_packing.py -q``
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from conftest import LlavaDataset, tiny_llava

from vlmfast.data.batch import split_batch
from vlmfast.data.packing import (
    IMAGE_PLACEHOLDER_ID,
    PackingCollator,
    pack_documents,
    plan_rows,
    unpad_batch,
)
from vlmfast.models import TinyVLM, TinyVLMConfig, VLMCollator, build_tiny_vlm_task
from vlmfast.spec import TrainSpec
from vlmfast.strategies.accumulation import accumulate_gradients, count_loss_tokens

SMALL = TinyVLMConfig(vision_dim=32, text_dim=32, vision_heads=2, text_heads=2, vision_layers=1, text_layers=2)


def test_plan_rows_respects_the_budget_and_places_every_sample_once() -> None:
    lengths = [7, 3, 9, 2, 5, 5, 4, 1, 8, 6]
    for algorithm in ("best_fit_decreasing", "first_fit_decreasing"):
        rows = plan_rows(lengths, 10, algorithm)
        assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in row) <= 10 for row in rows)
        assert len(rows) == 5  # 50 tokens into rows of 10: optimal here
    # 7 | 4 4: the 1 goes to the fullest row that fits (best fit) or to the first (first fit).
    assert plan_rows([1, 7, 4, 4], 10, "best_fit_decreasing") == [[1], [2, 3, 0]]
    assert plan_rows([1, 7, 4, 4], 10, "first_fit_decreasing") == [[1, 0], [2, 3]]
    with pytest.raises(ValueError, match=r"sample 1 has 12 tokens.*packing.max_tokens=10"):
        plan_rows([3, 12], 10)


def _shapes_samples(n: int = 12):
    _, dataset, _ = build_tiny_vlm_task(seed=0, num_samples=64, config=SMALL)
    return [dataset[i] for i in range(n)]


def _packer(**kwargs) -> PackingCollator:
    return PackingCollator(max_tokens=kwargs.pop("max_tokens", 96), collate_fn=VLMCollator(),
                           image_tokens=SMALL.num_image_tokens, **kwargs)


def test_packed_rows_layout() -> None:
    samples = _shapes_samples()
    padded = VLMCollator()(samples)
    packed = _packer()(samples)
    assert "attention_mask" not in packed  # a 2-D padding mask would switch packing off in HF models
    rows, width = packed["input_ids"].shape
    assert rows < len(samples) and width <= 96
    assert int(packed["images_per_row"].sum()) == len(samples)
    assert packed["pixel_values"].shape[:2] == (rows, int(packed["images_per_row"].max()))
    assert int((packed["input_ids"] == IMAGE_PLACEHOLDER_ID).sum()) == len(samples) * SMALL.num_image_tokens
    # Real tokens are kept, each document's positions restart at 0, and loss items match the padded batch.
    real = (packed["input_ids"] != 0).sum()
    assert real == padded["attention_mask"].sum() + len(samples) * SMALL.num_image_tokens
    starts = (packed["position_ids"] == 0) & (packed["input_ids"] == IMAGE_PLACEHOLDER_ID)
    assert int(starts.sum()) == len(samples)
    assert count_loss_tokens(packed, shift=True) == count_loss_tokens(padded, shift=True)
    fixed = _packer(pad_to_max_tokens=True)(samples)
    assert fixed["input_ids"].shape[1] == 96
    longest = int(padded["attention_mask"].sum(1).max()) + SMALL.num_image_tokens
    assert int(fixed["position_ids"].max()) < longest  # padding tails never use positions the model lacks


def _per_sample_losses_padded(model, batch):
    logits = model(**batch).logits
    ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), batch["labels"][:, 1:], reduction="none")
    return ce.sum(1) / (batch["labels"][:, 1:] != -100).sum(1)


def _per_sample_losses_packed(model, packed, rows):
    logits = model(**packed).logits
    ce = F.cross_entropy(logits[:, :-1].transpose(1, 2), packed["labels"][:, 1:], reduction="none")
    valid = packed["labels"][:, 1:] != -100
    doc_of_token = (packed["position_ids"] == 0).long().cumsum(1)[:, 1:] - 1  # document index within the row
    losses = {}
    for r, row in enumerate(rows):
        for j, sample in enumerate(row):
            here = (doc_of_token[r] == j) & valid[r]
            losses[sample] = ce[r][here].sum() / here.sum()
    return torch.stack([losses[i] for i in range(len(losses))])


def test_packed_and_padded_give_the_same_per_sample_losses_and_gradient() -> None:
    samples = _shapes_samples()
    padded = VLMCollator()(samples)
    packed = pack_documents(unpad_batch(padded), 96, image_tokens=SMALL.num_image_tokens)
    torch.manual_seed(0)
    model = TinyVLM(SMALL)
    with torch.no_grad():
        torch.testing.assert_close(_per_sample_losses_packed(model, packed.tensors, packed.rows),
                                   _per_sample_losses_padded(model, padded), atol=1e-5, rtol=1e-5)
    grads = []
    for batch in (padded, packed.tensors):
        model.zero_grad()
        model(**batch).loss.backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for gp, gk in zip(*grads, strict=True):
        torch.testing.assert_close(gk, gp, atol=1e-6, rtol=1e-5)


def test_packed_micro_batches_keep_images_and_token_weighting() -> None:
    """Split into one-row micro-batches: images travel with their rows and the gradient is the padded batch's."""
    samples = _shapes_samples(10)
    padded = VLMCollator()(samples)
    packed = _packer(max_tokens=72)(samples)
    assert len(split_batch(packed, 1)) == packed["input_ids"].shape[0] > 2
    torch.manual_seed(0)
    model = TinyVLM(SMALL)
    accumulate_gradients(model, padded, micro_batch_size=len(samples))
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    accumulate_gradients(model, packed, micro_batch_size=1)
    for got, want in zip((p.grad for p in model.parameters()), expected, strict=True):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)


def test_images_whose_channels_equal_the_sequence_length_are_not_taken_for_cross_attention() -> None:
    """[B, 3, H, W] images with 3-token samples: the shape looks like Mllama's [B, T, images, tiles] mask."""
    batch = VLMCollator()(_shapes_samples(4))
    batch = {k: v[:, :3] if k in ("input_ids", "attention_mask", "labels") else v for k, v in batch.items()}
    assert batch["pixel_values"].shape[:2] == batch["input_ids"].shape
    documents = unpad_batch(batch)
    assert len(documents) == 4
    with pytest.raises(ValueError, match=r"'cross_attention_mask'.*cross-attention"):  # a real per-token key still is
        unpad_batch({**batch, "cross_attention_mask": torch.ones(4, 3, 1, 1)})


def test_packing_leaks_nothing_between_documents() -> None:
    """Change one sample's caption: the logits of the other samples packed in its row do not move."""
    samples = _shapes_samples(6)
    packed = pack_documents(unpad_batch(VLMCollator()(samples)), 200, image_tokens=SMALL.num_image_tokens)
    assert len(packed.rows) == 1  # everything in one row
    batch = packed.tensors
    torch.manual_seed(0)
    model = TinyVLM(SMALL).eval()
    first_doc = (batch["position_ids"] == 0).long().cumsum(1) == 1
    changed = dict(batch, input_ids=batch["input_ids"].clone())
    text_of_first = first_doc & (batch["input_ids"] > 2)
    changed["input_ids"][text_of_first] = 3 + (changed["input_ids"][text_of_first] + 1) % 10
    with torch.no_grad():
        before, after = model(**batch).logits, model(**changed).logits
        # Control: positions that run on from the first document into the second merge the two: now it leaks.
        second_doc = (batch["position_ids"] == 0).long().cumsum(1) == 2
        merged = batch["position_ids"].clone()
        merged[second_doc] += int(first_doc.sum())
        leaky_before = model(**dict(batch, position_ids=merged)).logits
        leaky_after = model(**dict(changed, position_ids=merged)).logits
    torch.testing.assert_close(after[~first_doc], before[~first_doc], atol=0, rtol=0)
    assert not torch.allclose(after[first_doc], before[first_doc])
    assert not torch.allclose(leaky_after[second_doc], leaky_before[second_doc])


def test_hf_llava_packed_equals_padded() -> None:
    """Image tokens inline (LLaVA): flat pixel_values in row order; HF's own packed-sequence masks do the rest."""
    data = LlavaDataset(8)
    items = [data[i] for i in range(8)]
    padded = {key: torch.stack([item[key] for item in items]) for key in items[0]}
    packed = PackingCollator(max_tokens=40, collate_fn=lambda s: padded, image_layout="flat")(items)
    assert packed["pixel_values"].shape[0] == 8 and packed["input_ids"].shape[0] < 8
    model = tiny_llava()
    model.config.use_cache = model.config.text_config.use_cache = False  # HF detects packing only without a cache
    grads, losses = [], []
    for batch in (padded, packed):
        model.zero_grad()
        loss = model(**batch).loss
        loss.backward()
        losses.append(loss.detach())
        grads.append([p.grad.clone() for p in model.parameters() if p.grad is not None])
    torch.testing.assert_close(losses[1], losses[0], atol=1e-5, rtol=1e-5)
    for gk, gp in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(gk, gp, atol=1e-5, rtol=1e-4)


def test_mrope_position_ids_are_kept_and_text_positions_added() -> None:
    ids = torch.tensor([[5, 6, 7, 8], [9, 10, 0, 0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    mrope = torch.stack([torch.tensor([[0, 1, 1, 2], [0, 1, 0, 0]]), torch.tensor([[0, 0, 1, 2], [0, 1, 0, 0]]),
                         torch.tensor([[0, 1, 0, 2], [0, 1, 0, 0]])])  # [3, B, T]; h/w restart inside an image
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100),
             "position_ids": mrope}
    packed = pack_documents(unpad_batch(batch), 8)
    pos = packed.tensors["position_ids"]
    assert pos.shape == (4, 1, 6)
    assert pos[0, 0].tolist() == [0, 1, 2, 3, 0, 1]  # text positions: restart per document
    assert pos[1:, 0, :4].tolist() == mrope[:, 0].tolist() and pos[1:, 0, 4:].tolist() == mrope[:, 1, :2].tolist()


def test_bad_batches_get_clear_errors() -> None:
    ids = torch.tensor([[5, 6, 7], [0, 8, 9]])
    with pytest.raises(ValueError, match="real tokens in one run"):  # a hole in the mask
        unpad_batch({"input_ids": ids, "attention_mask": torch.tensor([[1, 0, 1], [0, 1, 1]])})
    left = unpad_batch({"input_ids": ids, "attention_mask": torch.tensor([[1, 1, 1], [0, 1, 1]])})
    assert left[1]["input_ids"].tolist() == [8, 9]  # a left-padded row: its real tokens, re-padded to the right
    with pytest.raises(ValueError, match="needs its 'attention_mask'"):
        unpad_batch({"input_ids": ids})
    with pytest.raises(ValueError, match=r"packing cannot split.*'lengths'"):
        unpad_batch({"input_ids": ids, "attention_mask": torch.ones(2, 3), "lengths": torch.tensor([3])})
    with pytest.raises(ValueError, match="cannot pack an empty"):
        pack_documents([], 8)


def test_packing_spec() -> None:
    spec = TrainSpec(packing={"enabled": True, "max_tokens": 512, "algorithm": "first_fit_decreasing"})
    assert spec.packing.enabled and spec.packing.image_layout == "auto"
    with pytest.raises(ValueError, match="did you mean 'max_tokens'"):
        TrainSpec(packing={"max_token": 512})
    with pytest.raises(ValueError, match="max_tokens"):
        TrainSpec(packing={"max_tokens": 0})


def test_trainer_with_packing_trains_the_same_as_padding() -> None:
    """`packing.enabled` in the trainer: same losses, same token counts, same weights as the padded run."""
    from vlmfast import OptimizedTrainer, TrainSpec
    from vlmfast.models import build_tiny_vlm_task

    reports = []

    def run(packing: dict) -> tuple[list[dict], dict]:
        model, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=64)
        spec = TrainSpec(max_steps=3, batch_size=8, micro_batch_size=2, optimizer={"lr": 1e-3}, packing=packing,
                         data={"shuffle": False}, log={"progress": "off"})
        trainer = OptimizedTrainer(model, dataset, spec, collate_fn=collate)
        result = trainer.fit()
        reports.append(result.report.to_text())
        return result.history, {n: p.detach().clone() for n, p in trainer.model.named_parameters()}

    padded, padded_weights = run({"enabled": False})
    packed, packed_weights = run({"enabled": True, "max_tokens": 64})
    assert [m["loss"] for m in packed] == pytest.approx([m["loss"] for m in padded], rel=1e-5)
    # Real tokens, not padded rows: the packed rows also hold the tiny VLM's 9 image placeholders per sample,
    # which the padded batch leaves to the model.
    assert [m["tokens"] for m in packed] == [m["tokens"] + 9 * 8 for m in padded]
    assert [m["samples"] for m in packed] == [8, 8, 8]  # samples, not the fewer packed rows
    assert "packing: rows of 64 tokens" in reports[1] and "packing" not in reports[0]
    assert packed[0]["accumulation_steps"] < padded[0]["accumulation_steps"]  # fewer rows: packing happened
    for name, value in padded_weights.items():
        torch.testing.assert_close(packed_weights[name], value, rtol=1e-3, atol=5e-5)  # Adam: 3 steps of 1e-3
