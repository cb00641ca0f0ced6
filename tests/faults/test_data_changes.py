"""Resuming on other data: every checkpoint holds a fingerprint of the training data (length, per-sample lengths, a
hash of a few samples, the sampler's settings); a resume on changed data is refused naming what changed, unless
save.accept_data_change says to go on, with the position mapped onto the new data."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from _faults import losses, make_spec, params_of, train
from conftest import TokenDataset
from PIL import Image

from vlmfast import OptimizedTrainer, SpecError
from vlmfast.checkpoints.store import latest_checkpoint, load_checkpoint
from vlmfast.data.fingerprint import data_fingerprint, fingerprint_changes


def saved_run(tmp_path, steps=2, **overrides):
    base = {"max_steps": steps, "save": {"dir": str(tmp_path)}, **overrides}
    train(make_spec(**base))
    return base


class WithLengths(TokenDataset):
    def __init__(self, lengths):
        super().__init__(len(lengths))
        self.lengths = lengths


@pytest.mark.timeout(120)
def test_a_resume_on_a_dataset_of_another_length_is_refused_naming_old_and_new(tmp_path):
    base = saved_run(tmp_path)
    with pytest.raises(SpecError, match=r"training data differs .*length 64 -> 40.*epoch 0, batch 2.*"
                                        r"save.accept_data_change: true"):
        train(make_spec(**{**base, "max_steps": 4}), data=TokenDataset(40))


@pytest.mark.timeout(120)
def test_a_resume_on_same_length_data_of_other_content_is_refused(tmp_path):
    base = saved_run(tmp_path)
    with pytest.raises(SpecError, match=r"content of samples \[0, 21, 42, 63\] \(hash\) '[0-9a-f]+' -> '[0-9a-f]+'"):
        train(make_spec(**{**base, "max_steps": 4}), data=TokenDataset(64, seed=1))


def test_per_sample_lengths_are_part_of_the_fingerprint():
    sampler = {"batch_size": 8}
    old = data_fingerprint(WithLengths([3] * 64), sampler)
    new = data_fingerprint(WithLengths([3] * 63 + [4]), sampler)
    assert "per-sample lengths" in fingerprint_changes(old, new)


@pytest.mark.timeout(120)
def test_an_accepted_data_change_continues_on_the_new_data_and_says_so(tmp_path, caplog):
    base = saved_run(tmp_path)
    spec = make_spec(**{**base, "max_steps": 4, "save": {**base["save"], "accept_data_change": True}})
    with caplog.at_level(logging.WARNING, logger="vlmfast"):
        _, resumed = train(spec, data=TokenDataset(40))
    assert resumed.resumed_from.name == "step_00000002" and [m["step"] for m in resumed.history] == [3, 4]
    # batch 2 of 8 (64 samples) is batch 2 * 5 // 8 = 1 of 5 (40 samples)
    assert "resuming on changed training data (save.accept_data_change): length 64 -> 40; the data position " \
           "epoch 0, batch 2 becomes epoch 0, batch 1 of the new data" in caplog.text
    assert load_checkpoint(latest_checkpoint(tmp_path))["data"]["length"] == 40  # the new data's from here on


@pytest.mark.timeout(120)
def test_a_resume_on_the_same_data_stays_bit_exact_and_every_checkpoint_has_the_fingerprint(tmp_path):
    full_trainer, full = train(make_spec(max_steps=5))
    base = saved_run(tmp_path, steps=3)
    fingerprint = load_checkpoint(latest_checkpoint(tmp_path))["data"]
    assert fingerprint["length"] == 64 and fingerprint["batch_size"] == 8 and fingerprint["shuffle"] is True
    assert fingerprint["seed"] == 0 and fingerprint["world_size"] == 1 and len(fingerprint["samples_sha"]) == 16
    trainer, resumed = train(make_spec(**{**base, "max_steps": 5}))
    assert losses(resumed) == losses(full)[3:]
    for name, value in params_of(trainer.model).items():
        assert torch.equal(value, params_of(full_trainer.model)[name]), name


@pytest.mark.timeout(120)
def test_a_checkpoint_without_a_fingerprint_still_resumes_with_a_log_line(tmp_path, caplog, monkeypatch):
    with monkeypatch.context() as patch:  # as vlmfast wrote checkpoints before the fingerprint
        patch.setattr(OptimizedTrainer, "_data_fingerprint", lambda self: None)
        base = saved_run(tmp_path)
    assert load_checkpoint(latest_checkpoint(tmp_path)).get("data") is None
    with caplog.at_level(logging.INFO, logger="vlmfast"):
        trainer, resumed = train(make_spec(**{**base, "max_steps": 3}), data=TokenDataset(40))
    assert trainer.state.step == 3 and resumed.resumed_from.name == "step_00000002"
    assert "the checkpoint has no data fingerprint (written by an older vlmfast)" in caplog.text


class Mixed(torch.utils.data.Dataset):
    """Samples of tensors, arrays, PIL images, strings and an object without stable bytes; random augmentation."""

    def __init__(self, text="a cat"):
        self.text = text

    def __len__(self):
        return 10

    def __getitem__(self, i):
        noise = torch.rand(3)  # augmentation: seeded while fingerprinting, so it reads the same twice
        return {"ids": torch.arange(i, i + 4), "half": torch.ones(2, dtype=torch.bfloat16) * i, "noise": noise,
                "array": np.full(3, i, dtype=np.int32), "image": Image.new("RGB", (4, 4), (i, 0, 0)),
                "text": self.text, "meta": object()}


def test_samples_of_tensors_arrays_images_and_strings_hash_stably_and_skips_are_named():
    state = torch.random.get_rng_state()
    first, second = data_fingerprint(Mixed(), {}), data_fingerprint(Mixed(), {})
    assert torch.equal(torch.random.get_rng_state(), state)  # training's random stream is untouched
    assert first == second and "samples_sha" in first and first["samples_skipped"] == ["object"]
    assert fingerprint_changes(first, data_fingerprint(Mixed("a dog"), {})) != {}
