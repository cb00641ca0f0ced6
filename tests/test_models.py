"""Tests for vlmfast.models: the shapes caption data and the tiny VLM.

Usage: ``python -m pytest tests/test_models.py -q``
"""

from __future__ import annotations

import math
import pickle
import time
from collections import defaultdict

import pytest
import torch
import torch.nn.functional as F

from vlmfast.models import (
    ShapesCaptionDataset,
    ShapesTokenizer,
    TinyVLM,
    TinyVLMConfig,
    VLMCollator,
    build_tiny_vlm_task,
    text_only_baseline_loss,
)
from vlmfast.models.shapes import COLORS, SHAPES, SIZE_CHOICES, render_scene

# A smaller model keeps the non-training tests fast; the learning test uses the defaults.
SMALL = TinyVLMConfig(
    vision_dim=32, text_dim=32, vision_heads=2, text_heads=2, vision_layers=1, text_layers=2
)


@pytest.fixture(scope="module")
def dataset() -> ShapesCaptionDataset:
    return ShapesCaptionDataset(num_samples=512, seed=0)


def _batch(dataset: ShapesCaptionDataset, indices: range | list[int], image_size: int = 48) -> dict:
    return VLMCollator(image_size=image_size)([dataset[i] for i in indices])


def _small_model(seed: int = 0) -> TinyVLM:
    torch.manual_seed(seed)
    return TinyVLM(SMALL).eval()


# ---------------------------------------------------------------------------------------------- data


def test_tokenizer_roundtrip() -> None:
    tok = ShapesTokenizer()
    text = "a big red circle top left and a blue square bottom right"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_id == 1 and ids[-1] == tok.eos_id == 2 and tok.pad_id == 0
    assert tok.decode(ids) == text
    assert tok.decode(torch.tensor(ids)) == text
    assert len(set(tok.id_to_token)) == tok.vocab_size
    with pytest.raises(ValueError, match="purple"):
        tok.encode("a purple circle")


def test_dataset_is_pure_function_of_seed_and_index(dataset: ShapesCaptionDataset) -> None:
    torch.manual_seed(123)  # global RNG state must not matter
    again = ShapesCaptionDataset(num_samples=512, seed=0)
    for i in (0, 7, 511):
        a, b = dataset[i], again[i]
        assert torch.equal(a["image"], b["image"]) and torch.equal(a["input_ids"], b["input_ids"])
        assert a["text_nll"] == b["text_nll"]
    captions = {dataset.tokenizer.decode(dataset[i]["input_ids"]) for i in range(32)}
    assert len(captions) > 28  # different indices -> (almost always) different samples
    other_seed = ShapesCaptionDataset(num_samples=512, seed=1)
    assert not torch.equal(other_seed[0]["input_ids"], dataset[0]["input_ids"])
    with pytest.raises(IndexError):
        dataset.scene(512)


def test_dataset_varies_sizes_and_lengths(dataset: ShapesCaptionDataset) -> None:
    samples = [dataset[i] for i in range(64)]
    shapes = {tuple(s["image"].shape) for s in samples}
    assert all(s["image"].dtype == torch.uint8 and s["image"].shape[0] == 3 for s in samples)
    assert all(24 <= h <= 48 and 24 <= w <= 48 for _, h, w in shapes)
    assert len(shapes) > 40 and any(h != w for _, h, w in shapes)
    lengths = {len(s["input_ids"]) for s in samples}
    assert len(lengths) >= 5
    assert all(s["input_ids"].dtype == torch.long for s in samples)


def test_captions_describe_the_rendered_shapes(dataset: ShapesCaptionDataset) -> None:
    area_by_size: dict[str | None, list[float]] = defaultdict(list)
    for i in range(200):
        scene, sample = dataset.scene(i), dataset[i]
        assert dataset.tokenizer.decode(sample["input_ids"]) == scene.caption()
        assert 1 <= len(scene.objects) <= dataset.max_objects
        colors = [obj.color for obj in scene.objects]
        assert colors == [c for c in COLORS if c in colors]  # distinct, canonical order
        assert len({obj.cell for obj in scene.objects}) == len(scene.objects)
        assert scene.caption().count(" and ") == len(scene.objects) - 1
        image = sample["image"]
        cell_side = min(scene.height, scene.width) / 3
        for obj in scene.objects:
            pixels = (image == torch.tensor(COLORS[obj.color], dtype=torch.uint8).view(3, 1, 1)).all(0)
            assert pixels.any(), f"sample {i}: {obj} is invisible"
            area_by_size[obj.size].append(pixels.sum().item() / cell_side**2)
            rows, cols = pixels.nonzero(as_tuple=True)
            # The shape lies in the grid cell the caption names.
            assert int(rows.float().mean() / (scene.height / 3)) == obj.cell // 3
            assert int(cols.float().mean() / (scene.width / 3)) == obj.cell % 3
    mean_area = {size: sum(v) / len(v) for size, v in area_by_size.items()}
    assert mean_area["small"] < mean_area[None] < mean_area["big"]


def test_text_nll_is_exact_for_single_objects() -> None:
    ds = ShapesCaptionDataset(num_samples=16, seed=3, max_objects=1)
    # One object: 8 colours x 9 cells x 4 shapes x 3 sizes, all equally likely.
    expected = math.log(len(COLORS) * 9 * len(SHAPES) * len(SIZE_CHOICES))
    assert all(abs(ds[i]["text_nll"] - expected) < 1e-12 for i in range(16))


def test_text_nll_matches_caption_probability(dataset: ShapesCaptionDataset) -> None:
    # p(caption) = p(count) p(colour set) p(ordered cells) p(shapes) p(sizes) for max_objects=3.
    for i in range(20):
        n = len(dataset.scene(i).objects)
        p = (1 / 3) / math.comb(8, n) / math.perm(9, n) / (4 * 3) ** n
        assert dataset[i]["text_nll"] == pytest.approx(-math.log(p), rel=1e-12)


def test_text_only_baseline(dataset: ShapesCaptionDataset) -> None:
    baseline = text_only_baseline_loss(dataset, num_samples=256)
    nll = sum(dataset[i]["text_nll"] for i in range(256))
    tokens = sum(len(dataset[i]["input_ids"]) - 1 for i in range(256))
    assert baseline == pytest.approx(nll / tokens)
    assert 0.8 < baseline < 1.2  # ~1.01 nats/token for the default data


def test_rendering_is_fast(dataset: ShapesCaptionDataset) -> None:
    scenes = [dataset.scene(i) for i in range(200)]
    start = time.perf_counter()
    for scene in scenes:
        render_scene(scene)
    per_sample = (time.perf_counter() - start) / len(scenes)
    assert per_sample < 2e-3, f"{per_sample * 1e3:.2f} ms per image"  # ~0.1 ms when the machine is idle


def test_collator_shapes_padding_and_labels(dataset: ShapesCaptionDataset) -> None:
    collator = VLMCollator(image_size=32)
    samples = [dataset[i] for i in range(8)]
    batch = collator(samples)
    lengths = [len(s["input_ids"]) for s in samples]
    b, t = 8, max(lengths)
    assert batch["pixel_values"].shape == (b, 3, 32, 32) and batch["pixel_values"].dtype == torch.float32
    assert batch["pixel_values"].min() >= -1.0 and batch["pixel_values"].max() <= 1.0
    assert batch["input_ids"].shape == batch["attention_mask"].shape == batch["labels"].shape == (b, t)
    for row, n in enumerate(lengths):
        assert torch.equal(batch["input_ids"][row, :n], samples[row]["input_ids"])
        assert (batch["input_ids"][row, n:] == 0).all()
        assert batch["attention_mask"][row].tolist() == [1] * n + [0] * (t - n)
        assert torch.equal(batch["labels"][row, :n], samples[row]["input_ids"])
        assert (batch["labels"][row, n:] == -100).all()
    # Same resize path as documented: antialiased bilinear, then (x - 0.5) / 0.5.
    first = samples[0]["image"][None].float() / 255
    want = F.interpolate(first, size=(32, 32), mode="bilinear", antialias=True) * 2 - 1
    assert torch.allclose(batch["pixel_values"][:1], want, atol=1e-6)


def test_collator_and_dataset_pickle(dataset: ShapesCaptionDataset) -> None:
    collator = pickle.loads(pickle.dumps(VLMCollator(image_size=24, pad_id=0, ignore_index=-1)))
    assert collator.image_size == 24 and collator.ignore_index == -1
    clone = pickle.loads(pickle.dumps(dataset))
    assert torch.equal(clone[5]["image"], dataset[5]["image"])
    batch = collator([dataset[0], dataset[1]])
    assert batch["pixel_values"].shape == (2, 3, 24, 24)


# --------------------------------------------------------------------------------------------- model


def test_model_structure() -> None:
    model = TinyVLM(TinyVLMConfig())
    assert len(model.vision_tower.blocks) == model.config.vision_layers
    assert len(model.language_model.layers) == model.config.text_layers
    assert len({type(b) for b in model.vision_tower.blocks}) == 1
    assert len({type(b) for b in model.language_model.layers}) == 1
    assert isinstance(model.multi_modal_projector.act, torch.nn.GELU)
    assert model.language_model.lm_head.out_features == ShapesTokenizer().vocab_size
    assert model.num_parameters() == sum(p.numel() for p in model.parameters())


def test_forward_backward_shapes(dataset: ShapesCaptionDataset) -> None:
    model = _small_model().train()
    batch = _batch(dataset, range(4))
    out = model(**batch)
    b, t = batch["input_ids"].shape
    assert out.logits.shape == (b, t, SMALL.vocab_size)  # text positions only
    assert out.loss is not None and out.loss.ndim == 0 and torch.isfinite(out.loss)
    out.loss.backward()
    missing = [name for name, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert not missing, f"no gradient reaches {missing}"
    assert model(batch["pixel_values"], batch["input_ids"]).loss is None


def test_attention_goes_through_sdpa(dataset: ShapesCaptionDataset, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[bool] = []
    sdpa = F.scaled_dot_product_attention

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(bool(kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", spy)
    _small_model()(**_batch(dataset, range(2)))
    assert calls == [False] * SMALL.vision_layers + [True] * SMALL.text_layers


def test_loss_follows_hf_shift_convention(dataset: ShapesCaptionDataset) -> None:
    model = _small_model()
    batch = _batch(dataset, range(6))
    out = model(**batch)
    logits, labels = out.logits[:, :-1], batch["labels"][:, 1:]
    want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
    assert out.loss.item() == pytest.approx(want.item(), rel=1e-6)
    # num_items_in_batch=1 gives the plain sum, so exactly the shifted text tokens carry a loss.
    total = model(**batch, num_items_in_batch=1).loss
    per_token = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    assert total.item() == pytest.approx(per_token.sum().item(), rel=1e-6)
    assert (labels != -100).sum().item() == sum(len(dataset[i]["input_ids"]) - 1 for i in range(6))


def test_image_positions_carry_no_loss_but_condition_text(dataset: ShapesCaptionDataset) -> None:
    model = _small_model()
    batch = _batch(dataset, range(4))
    # Labels that ignore all text make the loss zero: nothing else (e.g. image tokens) contributes.
    ignored = torch.full_like(batch["labels"], -100)
    assert model(**{**batch, "labels": ignored}, num_items_in_batch=1).loss.item() == 0.0
    other_images = _batch(dataset, range(4, 8))["pixel_values"]
    changed = model(**{**batch, "pixel_values": other_images}).logits
    assert not torch.allclose(changed, model(**batch).logits)


def test_padding_does_not_change_real_token_logits(dataset: ShapesCaptionDataset) -> None:
    model = _small_model()
    batch = _batch(dataset, range(8))
    short = int(batch["attention_mask"].sum(1).argmin())
    n = int(batch["attention_mask"][short].sum())
    alone = model(batch["pixel_values"][short : short + 1], batch["input_ids"][short : short + 1, :n]).logits
    assert torch.allclose(model(**batch).logits[short, :n], alone[0], atol=1e-5)


@pytest.mark.parametrize("as_tensor", [False, True])
def test_num_items_in_batch_matches_full_batch_mean(dataset: ShapesCaptionDataset, as_tensor: bool) -> None:
    model = _small_model()
    indices = list(range(10))
    full = _batch(dataset, indices)
    n_total = int((full["labels"][:, 1:] != -100).sum())
    assert len(set(full["attention_mask"].sum(1).tolist())) > 1  # variable-length captions
    num_items: int | torch.Tensor = torch.tensor(n_total) if as_tensor else n_total
    # Micro-batches are collated on their own, so they are padded to different lengths.
    micro = [indices[:3], indices[3:4], indices[4:]]
    accumulated = sum(model(**_batch(dataset, mb), num_items_in_batch=num_items).loss for mb in micro)
    assert accumulated.item() == pytest.approx(model(**full).loss.item(), rel=1e-5)


def test_bf16_model_accepts_float32_batch(dataset: ShapesCaptionDataset) -> None:
    model = _small_model().to(torch.bfloat16)
    out = model(**_batch(dataset, range(2)))
    assert out.logits.dtype == torch.bfloat16 and out.loss.dtype == torch.float32
    assert torch.isfinite(out.loss)


def test_build_tiny_vlm_task_is_seeded() -> None:
    state = torch.get_rng_state()
    m1, ds, collator = build_tiny_vlm_task(seed=5, num_samples=64)
    m2, _, _ = build_tiny_vlm_task(seed=5, num_samples=64)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's global RNG is left alone
    assert all(
        torch.equal(a, b) for a, b in zip(m1.state_dict().values(), m2.state_dict().values(), strict=True)
    )
    assert len(ds) == 64 and ds.seed == 5 and collator.image_size == m1.config.image_size
    assert m1(**collator([ds[0], ds[1]])).loss is not None


# ---------------------------------------------------------------------------------- learning signal


def test_model_learns_from_the_image() -> None:
    """Default config, AdamW: the training loss falls clearly below the best text-only loss.

    Falling below ``text_only_baseline_loss`` is only possible by reading the image. About 9 s on
    2 CPU cores (~22 ms per step); the loss crosses the baseline after ~150 steps.
    """
    steps, batch_size, warmup = 400, 16, 20
    model, dataset, collator = build_tiny_vlm_task(seed=0, num_samples=steps * batch_size)
    baseline = text_only_baseline_loss(dataset)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / warmup))
    model.train()
    losses = []
    for step in range(steps):
        # Every step sees fresh samples, so this is also the held-out loss.
        batch = collator([dataset[step * batch_size + j] for j in range(batch_size)])
        loss = model(**batch).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)  # without it, some seeds stall on text
        optimizer.step()
        schedule.step()
        losses.append(loss.item())
    final = sum(losses[-50:]) / 50
    assert final < 0.9 * baseline, f"final loss {final:.3f} vs text-only baseline {baseline:.3f}"
