"""Micro-batches of samples: the key-aware splitter's rules and refusals, SampleBatch re-collation, zero-token
micro-batches, and label conventions measured by probes (GPT-2's shift, GPT2DoubleHeads' ignored num_items)."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import default_collate

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.data.batch_layout import BatchLayout, BatchSplitError, split_collated
from vlmfast.data.loader import ResumableLoader
from vlmfast.data.micro_batches import SampleBatch, split_micro_batches
from vlmfast.hooks import accumulate_gradients, split_batch
from vlmfast.models.conventions import LabelConventionError, forget, probe_label_conventions
from vlmfast.spec import DataSpec

transformers = pytest.importorskip("transformers")
from zoo import build_case  # noqa: E402

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def qwen():
    return build_case("qwen2_vl")


def test_flattened_patches_follow_their_samples(qwen):
    """Qwen2-VL: pixel_values rows are patches of all images; each micro-batch gets its samples' images only."""
    batch = qwen.collate_fn(qwen.samples)
    parts = split_collated(batch, 3, BatchLayout.from_model(qwen.model))
    for start, part in zip(range(0, 8, 3), parts, strict=True):
        alone = qwen.collate_fn(qwen.samples[start:start + 3])
        assert torch.equal(part["image_grid_thw"], alone["image_grid_thw"])
        assert torch.equal(part["pixel_values"], alone["pixel_values"])
    text_only = split_collated(batch, 1, BatchLayout.from_model(qwen.model))[1]  # sample 1 has no image
    assert "pixel_values" not in text_only and "image_grid_thw" not in text_only


def test_a_device_copy_is_split_by_what_its_host_copy_says(qwen):
    """Device prefetch: the rules read only the host batch (image tokens, grids) and slice the device one. Here the
    'device' copy's image tokens and grid are scrambled and its patches shifted: the split still follows the host
    copy's samples, and the slices hold the device copy's values."""
    host = qwen.collate_fn(qwen.samples)
    device = {**host, "input_ids": torch.zeros_like(host["input_ids"]), "image_grid_thw": host["image_grid_thw"] * 0,
              "pixel_values": host["pixel_values"] + 1}
    layout = BatchLayout.from_model(qwen.model)
    for part, expected in zip(split_collated(device, 3, layout, host=host), split_collated(host, 3, layout),
                              strict=True):
        assert part.keys() == expected.keys()
        assert torch.equal(part["pixel_values"], expected["pixel_values"] + 1)
        assert not part["input_ids"].any()  # the device copy's
    with pytest.raises(BatchSplitError):  # read on its own, the scrambled copy cannot be split
        split_collated(device, 3, layout)


def test_per_image_rows_are_not_mistaken_for_samples():
    """LLaVA: 8 images for 8 samples (1, 0, 2, 1, 2, 0, 1, 1): slicing rows by sample index would be silently
    wrong; the image tokens say which images are whose."""
    case = build_case("llava")
    batch = case.collate_fn(case.samples)
    assert batch["pixel_values"].shape[0] == 8 == batch["input_ids"].shape[0]
    rows = split_collated(batch, 1, BatchLayout.from_model(case.model))
    assert [r["pixel_values"].shape[0] if "pixel_values" in r else 0 for r in rows] == [1, 0, 2, 1, 2, 0, 1, 1]
    assert torch.equal(rows[2]["pixel_values"], batch["pixel_values"][1:3])


def test_refusals_name_the_key_and_the_way_out(qwen):
    batch = qwen.collate_fn(qwen.samples)
    with pytest.raises(BatchSplitError, match=r"'pixel_values' \(with 'image_grid_thw'\).*image token id is unknown"):
        split_collated(batch, 3)  # no layout: which patches are whose cannot be proven
    with pytest.raises(BatchSplitError, match=r"'lookup' has shape \(5, 2\).*pass the Dataset"):
        split_collated({"input_ids": torch.zeros(8, 4), "lookup": torch.zeros(5, 2)}, 3)
    with pytest.raises(BatchSplitError, match="'names' is a list of 3 items for 8 samples"):
        split_collated({"input_ids": torch.zeros(8, 4), "names": ["a", "b", "c"]}, 3)


def test_adjacent_images_of_variable_size_are_refused_not_guessed():
    """LLaVA-NeXT images have different token counts; two with no text between them read as one run."""
    case = build_case("llava_next")
    batch = case.collate_fn(case.samples)
    image = case.image_token_ids[0]
    ids = batch["input_ids"].clone()
    row = 2  # two images: fill the word between them with image tokens, so the runs merge
    runs = (ids[row] == image).nonzero().flatten()
    gap = [i for i in range(int(runs[0]), int(runs[-1])) if ids[row, i] != image]
    ids[row, gap] = image
    with pytest.raises(BatchSplitError, match=r"'pixel_values' \(with 'image_sizes'\) holds 8 image\(s\)"):
        split_collated({**batch, "input_ids": ids}, 3, BatchLayout.from_model(case.model))


def test_without_a_collate_fn_micro_batches_are_slices_of_the_stacked_batch():
    """torch's default_collate only stacks: the loader collates the whole batch once (every sample checked against
    all the others) and any micro-batch size is a slice of it; the samples are not shipped at all."""
    data = [{"x": torch.full((2,), float(i))} for i in range(16)]
    batch = next(ResumableLoader(data, 8, DataSpec(shuffle=False), seed=0, micro_batch_size=4))
    assert batch.whole is not None and len(batch) == 8
    assert [mb["x"][:, 0].tolist() for mb in split_micro_batches(batch, 3)] == [[0, 1, 2], [3, 4, 5], [6, 7]]
    assert split_micro_batches(batch, 3)[0]["x"].data_ptr() == batch.whole["x"].data_ptr()  # views, no copy


def test_samples_cross_the_worker_queue_as_one_blob_and_unpack_on_demand():
    import pickle

    batch = SampleBatch([{"x": torch.ones(2)}, {"x": torch.zeros(2)}], [], 2, default_collate)
    copy = pickle.loads(pickle.dumps(batch))
    assert copy._samples is None and len(copy) == 2  # not unpacked yet
    assert [s["x"].tolist() for s in copy.samples] == [[1, 1], [0, 0]]


def test_generic_batches_and_scalars_still_split():
    x, y = torch.randn(8, 3), torch.randn(8)
    assert [len(p[0]) for p in split_batch((x, y), 3)] == [3, 3, 2]
    parts = split_batch({"x": x, "captions": list("abcdefgh"), "scale": torch.tensor(2.0), "tag": "run"}, 3)
    assert [p["captions"] for p in parts] == [list("abc"), list("def"), list("gh")]
    assert all(p["tag"] == "run" and float(p["scale"]) == 2.0 for p in parts)


class CountingCollate:
    def __init__(self) -> None:
        self.calls: list[int] = []

    def __call__(self, samples):
        self.calls.append(len(samples))
        return default_collate(samples)


def test_sample_batch_is_collated_in_the_loader_and_again_only_when_the_size_changes():
    data = [{"x": torch.full((2,), float(i))} for i in range(16)]
    collate = CountingCollate()
    loader = ResumableLoader(data, 8, DataSpec(shuffle=False), seed=0, collate_fn=collate, micro_batch_size=4)
    batch = next(loader)
    assert isinstance(batch, SampleBatch) and collate.calls == [4, 4]
    assert [mb["x"][:, 0].tolist() for mb in split_micro_batches(batch, 4)] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert collate.calls == [4, 4]  # the loader's micro-batches, used as they are
    parts = split_micro_batches(batch, 3)  # the OOM fallback shrank it: collated again, once
    assert [len(mb["x"]) for mb in parts] == [3, 3, 2] and collate.calls == [4, 4, 3, 3, 2]
    split_micro_batches(batch, 3)
    assert collate.calls == [4, 4, 3, 3, 2]
    next(loader)  # the loader was told: the next batch comes at the new size
    assert collate.calls[-3:] == [3, 3, 2]


def test_a_changed_size_reaches_the_loader_workers():
    data = [{"x": torch.tensor([float(i)])} for i in range(32)]
    spec = DataSpec(shuffle=False, num_workers=1, prefetch_factor=1)
    loader = ResumableLoader(data, 8, spec, seed=0, collate_fn=default_collate, micro_batch_size=8)
    batch = next(loader)
    split_micro_batches(batch, 2)
    sizes = [len(next(loader).micro_batches) for _ in range(3)]
    assert sizes[-1] == 4  # collated in the worker at 2 (a batch or two already in flight may be at 8)


class MeanLossModel(nn.Module):
    """A token classifier whose loss_fn returns a masked mean: 0/0 on a micro-batch without labels."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 8)
        self.head = nn.Linear(8, 10)

    def forward(self, input_ids):
        return self.head(self.embed(input_ids))


def masked_mean_loss(model, batch):
    losses = F.cross_entropy(model(batch["input_ids"]).transpose(1, 2), batch["labels"].clamp_min(0),
                             reduction="none")
    mask = (batch["labels"] != -100).float()
    return (losses * mask).sum() / mask.sum()


def token_samples():
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(8):
        ids = torch.randint(0, 10, (5,), generator=g)
        out.append({"input_ids": ids, "labels": ids if i % 3 else torch.full((5,), -100)})  # 0, 3, 6: no labels
    return out


def test_a_zero_token_micro_batch_weighs_zero_not_nan():
    torch.manual_seed(0)
    model = MeanLossModel()
    full = default_collate(token_samples())
    masked_mean_loss(model, full).backward()
    expected = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    loss = accumulate_gradients(model, full, 1, loss_fn=masked_mean_loss)
    assert torch.isfinite(loss)
    for p, e in zip(model.parameters(), expected, strict=True):
        torch.testing.assert_close(p.grad, e, rtol=1e-5, atol=1e-7)
    spec = TrainSpec(max_steps=1, batch_size=8, micro_batch_size=1, device="cpu", log={"progress": "off"},
                     optimizer={"name": "sgd", "lr": 1.0}, data={"shuffle": False})
    result = OptimizedTrainer(MeanLossModel(), token_samples(), spec, loss_fn=masked_mean_loss).fit()
    assert not result.history[0]["skipped"] and torch.isfinite(torch.tensor(result.history[0]["loss"]))


def test_gpt2_shift_and_num_items_are_measured():
    """GPT2LMHeadModel shifts and honours num_items_in_batch; GPT2DoubleHeadsModel shifts but ignores the count
    (it takes **kwargs): both measured, where class names and signatures guessed wrong before."""
    for name, honours in (("gpt2", True), ("gpt2_double_heads", False)):
        case = build_case(name)
        batch = case.collate_fn(case.samples)
        rng = torch.get_rng_state()
        found = probe_label_conventions(case.model, batch)
        assert (found.shifts_labels, found.honours_num_items) == (True, honours)
        assert found.shift_source == "measured" and torch.equal(torch.get_rng_state(), rng)
        assert case.model.training  # the probe's eval mode is undone


class TokenTagger(nn.Module):
    """An unshifted loss (labels[t] at t), the mean over labelled tokens; it reads labels directly."""

    def __init__(self, reads_labels: bool = True) -> None:
        super().__init__()
        self.inner = MeanLossModel()
        self.reads_labels = reads_labels

    def forward(self, input_ids, labels):
        logits = self.inner(input_ids)
        if not self.reads_labels:
            return logits.square().mean()
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def test_unshifted_loss_is_measured_and_undecidable_asks_for_the_field():
    batch = default_collate(token_samples()[1:3])
    assert not probe_label_conventions(TokenTagger(), batch).shifts_labels
    with pytest.raises(LabelConventionError, match=r"loss.shift_labels: yes \(causal LMs\) or no"):
        probe_label_conventions(TokenTagger(reads_labels=False), batch)
    model = TokenTagger(reads_labels=False)
    assert probe_label_conventions(model, batch, shift_labels=True).shift_source == "loss.shift_labels"
    forget(model)


def test_image_token_ids_are_found_in_any_sub_config() -> None:
    """Phi-4-multimodal keeps its image token id in config.vision_config, not at the top nor in text_config: every
    sub-config is read (the ids a model keeps in a config nested two deep too), never chosen by model type."""
    phi4 = nn.Module()
    phi4.config = transformers.Phi4MultimodalConfig()
    assert getattr(phi4.config, "image_token_id", None) is None and phi4.config.vision_config.image_token_id == 200010
    assert BatchLayout.from_model(phi4).image_token_ids == (200010,)

    nested = nn.Module()
    nested.config = transformers.PretrainedConfig(image_token_id=7)
    nested.config.perception = transformers.PretrainedConfig()
    nested.config.perception.video = transformers.PretrainedConfig(video_token_id=9, image_token_index=11)
    assert BatchLayout.from_model(nested) == BatchLayout(image_token_ids=(7, 11), video_token_ids=(9,))
