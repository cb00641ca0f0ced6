"""Corrupt data: skipped and counted, or a clear error naming the sample when it cannot be skipped.

Map-style datasets and streams: a sample whose reading raises, a sample with the wrong keys, a sample with the wrong
shape. Past `data.max_bad_sample_fraction` the run stops with an error naming the sample; an error that every sample
hits is the collate function's, and propagates unchanged. Bad memory-mapped token files are refused. (WebDataset
shards, which need the optional webdataset package: test_bad_shards.py.)
"""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from _faults import make_spec, train
from conftest import TinyCausalLM, TokenDataset
from torch.utils.data import IterableDataset

from vlmfast import OptimizedTrainer
from vlmfast.data.bad_samples import BadSampleError, TooManyBadSamplesError
from vlmfast.data.mmap import MemmapTokenDataset, write_token_sequences


# ---- map-style datasets -----------------------------------------------------------------------------------------
def spoil(sample: dict[str, torch.Tensor], how: str) -> dict[str, torch.Tensor]:
    if how == "keys":
        return {k: v for k, v in sample.items() if k != "attention_mask"}
    if how == "shape":
        return {k: torch.cat([v, v[:5]]) for k, v in sample.items()}  # 29 tokens where the others have 24
    raise OSError(f"cannot read sample file: {how}")  # an unreadable file


class SpoiltTokens(TokenDataset):
    """TokenDataset whose samples in `bad` ({index: "keys" | "shape" | "unreadable"}) are broken that way."""

    def __init__(self, bad: dict[int, str], n: int = 64) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        sample = super().__getitem__(i)
        return spoil(sample, self.bad[i]) if i in self.bad else sample


REASONS = {
    "keys": r"sample 5: wrong keys \(missing \['attention_mask'\]",
    "shape": r"sample 5: wrong shape: 'attention_mask' has shape \(29,\) where the others have \(24,\)",
    "unreadable": r"sample 5: reading it raised OSError: cannot read sample file",
}


@pytest.mark.parametrize("how", list(REASONS))
def test_a_bad_sample_is_skipped_counted_and_named(how, caplog):
    spec = make_spec(max_steps=8, data={"shuffle": False})
    with caplog.at_level(logging.WARNING, logger="vlmfast"):
        trainer, result = train(spec, data=SpoiltTokens({5: how}))
    assert trainer.state.step == 8 and all(np.isfinite(m["loss"]) for m in result.history)
    assert [m["samples"] for m in result.history] == [7] + [8] * 7  # sample 5 left its batch, nothing else did
    assert trainer.loader.sample_counts() == {"samples": 63, "bad": 1}
    assert result.report.extra["bad samples skipped"] == 1
    assert any(re.search(REASONS[how], r.getMessage()) for r in caplog.records), caplog.text


@pytest.mark.parametrize("how", list(REASONS))
def test_bad_samples_above_the_allowed_fraction_stop_naming_the_sample(how):
    spec = make_spec(max_steps=8, data={"shuffle": False, "max_bad_sample_fraction": 0.0})
    with pytest.raises(TooManyBadSamplesError, match=REASONS[how] + r".*data.max_bad_sample_fraction 0"):
        train(spec, data=SpoiltTokens({5: how}))


def test_bad_samples_are_counted_across_loader_workers():
    bad = {3: "keys", 13: "shape", 29: "unreadable", 50: "keys"}  # in four batches, read by two workers
    spec = make_spec(max_steps=8, data={"shuffle": False, "num_workers": 2, "max_bad_sample_fraction": 0.5})
    trainer, result = train(spec, data=SpoiltTokens(bad))
    assert trainer.loader.sample_counts() == {"samples": 60, "bad": 4}
    assert sum(m["samples"] for m in result.history) == 60


def test_a_collate_error_that_every_sample_hits_propagates_unchanged():
    def collate(samples):
        raise KeyError("pixel_values")  # the collate function does not suit this data: nobody's sample is bad

    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(64), make_spec(), collate_fn=collate)
    with pytest.raises(KeyError, match="pixel_values") as info:
        trainer.fit()
    if sys.version_info >= (3, 11):  # exception notes
        assert "it is not a bad sample: check collate_fn" in " ".join(info.value.__notes__)
    assert trainer.loader.sample_counts()["bad"] == 0


def test_a_batch_of_only_bad_samples_is_an_error_naming_them():
    spec = make_spec(max_steps=2, data={"shuffle": False, "max_bad_sample_fraction": 1.0})
    with pytest.raises(BadSampleError, match=r"every sample of a batch is bad \(sample 0: reading it raised"):
        train(spec, data=SpoiltTokens(dict.fromkeys(range(8), "unreadable")))


class TokenStream(IterableDataset):
    """A stream of token samples; the `bad` positions come with the wrong keys."""

    def __init__(self, bad: set[int]) -> None:
        self.data, self.bad = TokenDataset(64), bad

    def __iter__(self):
        for i in range(len(self.data)):
            yield spoil(self.data[i], "keys") if i in self.bad else self.data[i]


def test_a_bad_sample_in_a_stream_is_skipped_and_named_by_its_place_in_the_batch(caplog):
    with caplog.at_level(logging.WARNING, logger="vlmfast"):
        trainer, _ = train(make_spec(max_steps=4), data=TokenStream({10}))
    assert trainer.loader.sample_counts() == {"samples": 31, "bad": 1}
    assert "sample 2 of its batch: wrong keys" in caplog.text


def test_memmap_bad_input_is_refused_and_loses_no_data(tmp_path: Path):
    write_token_sequences([[1, 2, 3]], tmp_path / "train", vocab_size=10)
    with pytest.raises(ValueError, match=r"sequence 1 has token id 300 outside 0\.\.255"):
        write_token_sequences([[1], [300]], tmp_path / "train", vocab_size=200)
    assert MemmapTokenDataset(tmp_path / "train")[0]["input_ids"].tolist() == [1, 2, 3]  # the old data is intact
    assert not list(tmp_path.glob("*.tmp*"))
    (tmp_path / "train.bin").write_bytes(b"\x01\x02")
    with pytest.raises(ValueError, match="does not match the 3 tokens"):
        MemmapTokenDataset(tmp_path / "train")
    with pytest.raises(FileNotFoundError, match="write_token_sequences"):
        MemmapTokenDataset(tmp_path / "missing")


# ---- degenerate batches and errors inside the model ---------------------------------------------------------------
def test_a_collate_that_returns_zero_rows_is_an_error_naming_the_micro_batch():
    from torch.utils.data import default_collate

    from vlmfast.models.conventions import EmptyBatchError, probe_label_conventions

    def no_rows(samples):
        return {key: value[:0] for key, value in default_collate(samples).items()}

    with pytest.raises(EmptyBatchError, match=r"micro-batch 1 of 4 of this optimizer batch has zero rows \(input_ids "
                       r"\(0, \d+\).*the collate_fn returned no row"):
        train(make_spec(max_steps=2), collate_fn=no_rows)
    with pytest.raises(EmptyBatchError, match="the label probe's micro-batch has zero rows"):
        probe_label_conventions(TinyCausalLM(), no_rows([TokenDataset(4)[i] for i in range(2)]))


class _ReshapesWrongly(TinyCausalLM):
    loss_shifts_labels = None  # undeclared: the probe's verdict is the error

    def forward(self, input_ids, labels=None, **kwargs):
        if labels is not None:
            self._merge_rows(labels)
        return super().forward(input_ids, labels=labels, **kwargs)

    @staticmethod
    def _merge_rows(labels):
        return labels.view(4, 51)  # as Qwen2.5-Omni's thinker on chunked cross-entropy's inputs: the wrong size


def test_an_error_inside_the_model_during_the_label_probe_keeps_its_frame():
    """The label-convention verdict is a LabelConventionError chained to the model's own exception, so
    VLMFAST_TRACEBACK=1 (which prints the chain) shows the frame inside the model."""
    import traceback

    from vlmfast.models.conventions import LabelConventionError

    with pytest.raises(LabelConventionError, match=r"the probe forward raised RuntimeError: shape '\[4, 51\]'") as info:
        train(make_spec(max_steps=2), model=_ReshapesWrongly())
    assert isinstance(info.value.__cause__, RuntimeError)
    printed = "".join(traceback.format_exception(info.value))
    assert "in _merge_rows" in printed and "labels.view(4, 51)" in printed
