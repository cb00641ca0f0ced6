"""Bad samples named where they are read: float token ids, labels outside the vocabulary, NaN pixels.

Without the host-side check these end deep inside torch (an embedding dtype error, cross_entropy's "Target out of
bounds") or as a NaN loss that, with loss.on_nonfinite: skip, throws away every good sample of the step.
"""

from __future__ import annotations

import logging

import pytest
import torch
from _faults import make_spec, train
from conftest import TinyCausalLM, TokenDataset

from vlmfast.data.bad_samples import BadSampleCounts, BadSampleError, CheckedCollate
from vlmfast.data.sample_checks import SampleCheck, special_token_ids, vocabulary_sizes

VOCAB = 50


class ImageLM(TinyCausalLM):
    """TinyCausalLM that takes optional pixel values; its vocabulary is not declared anywhere (no
    get_input_embeddings, no config), and a position embedding of another size runs before the token embedding."""

    def __init__(self) -> None:
        super().__init__()
        self.positions = torch.nn.Embedding(512, 4)

    def forward(self, input_ids, labels=None, attention_mask=None, pixel_values=None):
        out = super().forward(input_ids, labels, attention_mask)
        out["loss"] = out["loss"] + 0 * self.positions(torch.arange(input_ids.shape[1])).sum()
        if pixel_values is not None:  # the image reaches the loss, as in a VLM
            out["loss"] = out["loss"] + 1e-3 * pixel_values.mean()
        return out


class VocabLM(ImageLM):
    """ImageLM that says its vocabulary (as Hugging Face models do)."""

    def get_input_embeddings(self):
        return self.embed


class Spoiled(torch.utils.data.Dataset):
    """TokenDataset(64) (with pixel values) where sample `index` is spoiled by `spoil`."""

    def __init__(self, spoil, index: int = 5) -> None:
        self.base, self.spoil, self.index = TokenDataset(64), spoil, index

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        sample = {**self.base[i], "pixel_values": torch.full((3, 4, 4), i / 64)}
        return self.spoil(sample) if i == self.index else sample


SPOILS = {
    "float input_ids": (lambda s: {**s, "input_ids": s["input_ids"].float()}, "'input_ids' has dtype torch.float32"),
    "label beyond the vocabulary": (lambda s: {**s, "labels": s["labels"].clamp(min=0) + VOCAB},
                                    f"'labels' holds \\d+, beyond the model's vocabulary of {VOCAB}"),
    "negative label": (lambda s: {**s, "labels": s["labels"] - 1000}, "'labels' holds -\\d+: labels"),
    "token id beyond the vocabulary": (lambda s: {**s, "input_ids": s["input_ids"] + 1000},
                                       f"'input_ids' holds \\d+, beyond the model's vocabulary of {VOCAB}"),
    "NaN pixels": (lambda s: {**s, "pixel_values": s["pixel_values"] * float("nan")},
                   "'pixel_values' holds 48 NaN/Inf value"),
}


@pytest.mark.parametrize("spoil", list(SPOILS))
def test_a_bad_sample_stops_the_run_naming_it_with_check_samples_error(spoil):
    make, message = SPOILS[spoil]
    torch.manual_seed(0)
    with pytest.raises(BadSampleError, match=rf"sample 5: {message}.*data.check_samples: skip"):
        train(make_spec(max_steps=8, data={"check_samples": "error", "shuffle": False}), VocabLM(), Spoiled(make))


@pytest.mark.parametrize("spoil,index", [("token id beyond the vocabulary", 5), ("label beyond the vocabulary", 5),
                                         ("token id beyond the vocabulary", 0)])  # 0: the probe's own sample
def test_a_model_that_declares_no_vocabulary_gets_it_learned_from_the_embedding_its_ids_reach(spoil, index):
    make, message = SPOILS[spoil]
    torch.manual_seed(0)
    with pytest.raises(BadSampleError, match=rf"sample {index}: {message}"):  # not a raw IndexError deep in torch
        train(make_spec(max_steps=8, data={"check_samples": "error", "shuffle": False}), ImageLM(),
              Spoiled(make, index))


def test_the_vocabulary_probe_stops_at_the_token_embedding_and_changes_nothing():
    from vlmfast.data.sample_checks import embedding_reached_by_ids

    model = ImageLM().train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    batch = {"input_ids": torch.tensor([[3, 4, 5]]), "labels": torch.tensor([[3, 4, 5]])}
    assert vocabulary_sizes(model) == (None, None)
    assert embedding_reached_by_ids(model, batch) == VOCAB  # not the 512 positions that ran first
    assert model.training and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    placeholders = {**batch, "input_ids": torch.tensor([[-200, 4, 5]])}  # replaced by the model before embedding

    class Replacing(ImageLM):
        def forward(self, input_ids, **kw):
            return super().forward(input_ids.clamp(min=0), **kw)

    assert embedding_reached_by_ids(Replacing(), placeholders) == VOCAB


@pytest.mark.parametrize("spoil", ["float input_ids", "label beyond the vocabulary", "NaN pixels"])
def test_a_bad_sample_is_skipped_counted_and_named_and_the_run_finishes(spoil, caplog):
    make, message = SPOILS[spoil]
    torch.manual_seed(0)
    with caplog.at_level(logging.WARNING, logger="vlmfast.data.bad_samples"):
        trainer, result = train(make_spec(max_steps=8, data={"shuffle": False}), VocabLM(), Spoiled(make))
    assert trainer.state.step == 8 and result.report.skipped_steps == 0
    assert trainer.loader.sample_counts()["bad"] == 1  # one epoch of 64: sample 5 once
    assert "bad sample 5:" in caplog.text and message.split("'")[1] in caplog.text
    assert result.history[0]["samples"] == 7  # its batch trained on the other 7


def test_a_nan_image_costs_one_sample_not_the_whole_step_under_on_nonfinite_skip():
    make, _ = SPOILS["NaN pixels"]
    spec = {"max_steps": 8, "data": {"shuffle": False}, "loss": {"on_nonfinite": "skip"}}
    torch.manual_seed(0)
    _, checked = train(make_spec(**spec), VocabLM(), Spoiled(make))
    torch.manual_seed(0)
    _, unchecked = train(make_spec(**{**spec, "data": {"shuffle": False, "check_samples": "off"}}), VocabLM(),
                         Spoiled(make))
    assert unchecked.report.skipped_steps == 1 and unchecked.history[0]["skipped"]  # 8 samples thrown away
    assert checked.report.skipped_steps == 0 and checked.history[0]["samples"] == 7  # 1 sample dropped


def test_bad_samples_are_checked_in_loader_workers_and_counted_across_them():
    make, _ = SPOILS["label beyond the vocabulary"]
    torch.manual_seed(0)
    trainer, _ = train(make_spec(max_steps=16, data={"num_workers": 2, "max_bad_sample_fraction": 0.05}), VocabLM(),
                       Spoiled(make))
    assert trainer.loader.sample_counts()["bad"] == 2  # two epochs, once each


def test_without_a_known_vocabulary_only_dtype_and_finiteness_are_checked():
    assert vocabulary_sizes(TinyCausalLM()) == (None, None)
    check = SampleCheck.for_model(TinyCausalLM())
    assert check.problem({"input_ids": torch.tensor([[1, 10_000]]), "labels": torch.tensor([[1, 10_000]])}) is None
    assert "dtype torch.float32" in check.problem({"input_ids": torch.tensor([[1.0]])})
    assert "labels" in check.problem({"labels": torch.tensor([[-7]])})  # negative labels are wrong without a vocab
    assert check.problem({"input_ids": torch.tensor([[-200, 3]])}) is None  # image placeholders (LLaVA's -200)


def test_special_token_ids_of_a_hugging_face_vlm_are_allowed():
    from conftest import IMAGE_TOKEN, tiny_llava

    model = tiny_llava()
    check = SampleCheck.for_model(model)
    assert check.vocab_size == 64 and IMAGE_TOKEN in special_token_ids(model)
    assert check.problem({"input_ids": torch.tensor([[IMAGE_TOKEN, 5]])}) is None
    assert "beyond the model's vocabulary of 64" in check.problem({"input_ids": torch.tensor([[64]])})


def test_a_collate_function_that_spoils_every_batch_is_not_blamed_on_a_sample():
    floats = CheckedCollate(lambda samples: {"input_ids": torch.stack([s["input_ids"] for s in samples]).float()},
                            BadSampleCounts(), check=SampleCheck())
    with pytest.raises(BadSampleError, match=r"every sample of a batch is bad|check collate_fn"):
        floats([(i, TokenDataset(4)[i]) for i in range(4)])
