"""Gradient accumulation: any micro-batch split gives the full-batch gradient (token-weighted, variable lengths)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import TinyCausalLM, TokenDataset, assert_gradients_close, tiny_llama, token_batch

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.strategies.accumulation import (
    accumulate_gradients,
    count_loss_tokens,
    model_accepts_num_items,
    model_shifts_labels,
)


def full_batch_gradient(model, batch):
    model.zero_grad()
    out = model(**batch)
    loss = out["loss"] if isinstance(out, dict) else out.loss
    loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, loss.item()


def accumulated_gradient(model, batch, micro_batch_size, **kwargs):
    model.zero_grad()
    loss = accumulate_gradients(model, batch, micro_batch_size, **kwargs)
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}, loss.item()


def assert_grads_close(actual, expected, rtol=1e-5):
    """Norm-relative over the whole gradient (conftest.assert_gradients_close): right on any CPU, also for tensors
    whose true gradient is analytically zero (a vision key bias holds only float noise there)."""
    assert_gradients_close(actual, expected, rtol)


@pytest.mark.parametrize("micro_batch_size", [1, 2, 4])
def test_token_weighted_gradient_equals_full_batch(tiny_lm, micro_batch_size):
    batch = token_batch(batch_size=8)
    expected, expected_loss = full_batch_gradient(tiny_lm, batch)
    actual, loss = accumulated_gradient(tiny_lm, batch, micro_batch_size)
    assert_grads_close(actual, expected)
    assert loss == pytest.approx(expected_loss, rel=1e-5)


def test_naive_mean_of_means_would_fail_this_test(tiny_lm):
    """The test above has teeth: dividing each micro-batch mean by the number of micro-batches is wrong here."""
    batch = token_batch(batch_size=8)
    expected, _ = full_batch_gradient(tiny_lm, batch)
    actual, _ = accumulated_gradient(tiny_lm, batch, 2, weighting="samples")
    with pytest.raises(AssertionError):
        assert_grads_close(actual, expected)


@pytest.mark.parametrize("micro_batch_size", [1, 2, 4])
def test_hugging_face_model_gets_num_items_in_batch_and_matches(micro_batch_size):
    model = tiny_llama()
    assert model_accepts_num_items(model) and model_shifts_labels(model)
    batch = token_batch(batch_size=8)
    expected, expected_loss = full_batch_gradient(model, batch)
    seen = []
    original_forward = model.forward

    def spy(*args, **kwargs):
        seen.append(kwargs.get("num_items_in_batch"))
        return original_forward(*args, **kwargs)

    model.forward = spy
    actual, loss = accumulated_gradient(model, batch, micro_batch_size)
    assert seen == [count_loss_tokens(batch, shift=True)] * (8 // micro_batch_size)
    assert_grads_close(actual, expected)
    assert loss == pytest.approx(expected_loss, rel=1e-5)


@pytest.mark.parametrize("micro_batch_size", [1, 4])
def test_loss_fn_returning_sum_and_count_is_exact(micro_batch_size):
    torch.manual_seed(0)
    model = TinyCausalLM()
    batch = token_batch(batch_size=8)
    expected, expected_loss = full_batch_gradient(model, batch)

    def loss_fn(model, mb):  # the count is known only after forward: exercises the post-backward correction
        logits = model(input_ids=mb["input_ids"], labels=mb["targets"])["logits"]
        targets = mb["targets"][:, 1:]
        losses = torch.nn.functional.cross_entropy(logits[:, :-1].transpose(1, 2), targets, reduction="none")
        valid = targets != -100
        return (losses * valid).sum(), valid.sum()

    unlabelled = {"input_ids": batch["input_ids"], "targets": batch["labels"]}  # nothing vlmfast could count
    actual, loss = accumulated_gradient(model, unlabelled, micro_batch_size, loss_fn=loss_fn)
    assert_grads_close(actual, expected)
    assert loss == pytest.approx(expected_loss, rel=1e-5)


def test_sample_weighting_for_models_without_labels():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    x, y = torch.randn(8, 4), torch.randn(8, 1)

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x, y):
            return ((self.inner(x) - y) ** 2).mean()

    wrapped = Wrapped()
    wrapped(x, y).backward()
    expected = {n: p.grad.clone() for n, p in wrapped.named_parameters()}
    wrapped.zero_grad()
    accumulate_gradients(wrapped, (x, y), 2)
    assert_grads_close({n: p.grad for n, p in wrapped.named_parameters()}, expected)


def test_shift_detection_counts_the_right_tokens():
    batch = token_batch(batch_size=4)
    assert count_loss_tokens(batch, shift=False) - count_loss_tokens(batch, shift=True) == 4
    with pytest.raises(ValueError, match=r"loss\.shift_labels"):  # nothing to probe: asks for the field
        model_shifts_labels(torch.nn.Linear(2, 2))
    assert not model_accepts_num_items(copy.deepcopy(TinyCausalLM()))


@pytest.mark.parametrize("micro_batch_size", [1, 2, 4])
def test_hugging_face_llava_gradient_equals_full_batch(micro_batch_size):
    from conftest import LlavaDataset, tiny_llava

    model = tiny_llava()
    data = LlavaDataset(8)
    batch = {k: torch.stack([data[i][k] for i in range(8)]) for k in data[0]}
    expected, expected_loss = full_batch_gradient(model, batch)
    actual, loss = accumulated_gradient(model, batch, micro_batch_size)
    assert_grads_close(actual, expected)
    assert loss == pytest.approx(expected_loss, rel=1e-5)


def test_a_micro_batch_without_loss_tokens_does_not_poison_the_step(tiny_lm):
    """An image-and-prompt-only sample (all labels -100) alone in a micro-batch: its mean loss is NaN."""
    from vlmfast.strategies.accumulation import GradientAccumulation

    batch = token_batch(batch_size=4)
    batch["labels"][1] = -100
    expected, expected_loss = full_batch_gradient(tiny_lm, batch)
    accumulation = GradientAccumulation()
    accumulation.apply(tiny_lm)
    plan = accumulation.plan(batch, 1)
    # Still run (weight 0, NaN zeroed) so every rank issues the same collectives; ordered first, so the last
    # micro-batch (where DDP reduces) carries loss tokens.
    assert plan.items[0] == 0 and all(plan.items[1:]) and len(plan.micro_batches) == 4

    from vlmfast import OptimizedTrainer, TrainSpec

    data = [{k: v[i] for k, v in batch.items()} for i in range(4)]
    trainer = OptimizedTrainer(tiny_lm, data, TrainSpec(batch_size=4, micro_batch_size=1, log={"progress": "off"}))
    trainer.optimizer.zero_grad()
    loss, plan = trainer.train_step(batch, 1)
    actual = {n: p.grad.clone() for n, p in tiny_lm.named_parameters() if p.grad is not None}
    assert_grads_close(actual, expected)
    assert float(loss) == pytest.approx(expected_loss, rel=1e-5)


def test_the_tolerance_is_norm_relative_so_float_noise_in_a_zero_gradient_passes_and_real_errors_fail():
    """An analytically zero gradient (a key bias) holds float noise whose size depends on the CPU: the comparison must
    not judge it on its own scale; an error in a real gradient must still fail."""
    expected = {"weight": torch.ones(64), "key_bias": torch.zeros(8)}
    noisy = {"weight": torch.ones(64), "key_bias": torch.full((8,), 3e-8)}  # 2.8e-5 "relative" under a 1e-6 floor
    assert_grads_close(noisy, expected)
    wrong = {"weight": torch.ones(64) * (1 + 1e-3), "key_bias": torch.zeros(8)}
    with pytest.raises(AssertionError):
        assert_grads_close(wrong, expected)


@pytest.mark.parametrize("collate, oom_above", [(None, None), (torch.utils.data.default_collate, 3)],
                         ids=["sliced-from-whole", "recollated-after-oom"])
def test_a_step_under_device_prefetch_applies_the_full_batch_gradient(collate, oom_above):
    """Under data.device_prefetch the micro-batches reach the step on the device and their loss tokens are counted on
    their host copies (also those collated again after an OOM resize): the weighting stays exact. One SGD step of lr 1
    in float64 moves the weights by exactly the full-batch gradient of the 8 first samples (3 + 3 + 2 samples of
    different lengths; after the OOM, 2 + 2 + 2 + 2)."""
    from vlmfast import OptimizedTrainer, TrainSpec
    from vlmfast.testing import simulated_oom

    torch.manual_seed(0)
    model = TinyCausalLM().double()
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    data = TokenDataset(16)
    expected, _ = full_batch_gradient(copy.deepcopy(model), {k: v[:8] for k, v in data.batch.items()})
    spec = TrainSpec(max_steps=1, batch_size=8, micro_batch_size=4 if oom_above else 3, seed=0,
                     optimizer={"name": "sgd", "lr": 1.0}, oom={"enabled": bool(oom_above)},
                     data={"device_prefetch": True, "shuffle": False}, log={"progress": "off"})
    with simulated_oom(oom_above) if oom_above else simulated_oom(10**6) as oom:
        trainer = OptimizedTrainer(model, data, spec, collate_fn=collate)
        trainer.fit()
    assert oom.count == (1 if oom_above else 0) and trainer.state.accumulation_steps == (4 if oom_above else 3)
    actual = {n: start[n] - p.detach() for n, p in model.named_parameters()}
    assert_grads_close(actual, expected, rtol=1e-10)



def _long_tailed_vlm_task():
    """A float64 tiny VLM and 8 samples of 8-64 text tokens and 0-3 images laid out per row (images_per_row)."""
    from vlmfast.models.long_tail import collate_per_row_images, long_tailed_samples
    from vlmfast.models.tiny_vlm import TinyVLM, TinyVLMConfig

    def collate(samples):
        batch = collate_per_row_images(samples)
        return {**batch, "pixel_values": batch["pixel_values"].double()}

    model = TinyVLM(TinyVLMConfig(vocab_size=64, text_dim=32, vision_dim=16, max_text_len=160)).double()
    return model, long_tailed_samples(8, max_text=64, max_images=3, seed=2), collate


@pytest.mark.parametrize("task", ["text", "per-row-images"])
def test_a_token_budget_step_under_device_prefetch_applies_the_full_batch_gradient(task):
    """With micro_batch_tokens and data.device_prefetch the split is planned on the host copy of the batch (lengths,
    image counts, columns) and the rows are gathered from the device copy; the loss tokens are counted on the host
    rows of the same plan. One float64 SGD step of lr 1 moves the weights by exactly the full-batch gradient, which
    fails if the host plan and the device gather (or the host counts) disagree in rows, columns or image slots."""
    from vlmfast import OptimizedTrainer, TrainSpec

    torch.manual_seed(0)
    if task == "text":
        model, data, collate, tokens = TinyCausalLM().double(), TokenDataset(8), None, 48
        samples = [data[i] for i in range(8)]
    else:
        (model, samples, collate), tokens = _long_tailed_vlm_task(), 200
        data = samples
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    whole = (collate or torch.utils.data.default_collate)(samples)
    expected, _ = full_batch_gradient(copy.deepcopy(model), whole)
    spec = TrainSpec(max_steps=1, batch_size=8, micro_batch_tokens=tokens, seed=0,
                     optimizer={"name": "sgd", "lr": 1.0}, data={"device_prefetch": True, "shuffle": False},
                     log={"progress": "off"})
    trainer = OptimizedTrainer(model, data, spec, collate_fn=collate)
    trainer.fit()
    assert trainer.state.accumulation_steps >= 3  # split into micro-batches of different rows and widths
    actual = {n: start[n] - p.detach() for n, p in model.named_parameters()}
    assert_grads_close(actual, expected, rtol=1e-10)


def test_loss_tokens_on_padding_are_named_once_with_the_fix(caplog):
    """``labels = input_ids.clone()`` leaves padding labelled: the loss then depends on the split. Said once."""
    import logging

    class LabelsOnPadding(TokenDataset):
        def __getitem__(self, i):
            sample = super().__getitem__(i)
            return {**sample, "labels": sample["input_ids"].clone()}  # the common mistake: padding not masked

    spec = TrainSpec(max_steps=3, batch_size=8, micro_batch_size=4, log={"progress": "off"})
    with caplog.at_level(logging.WARNING, logger="vlmfast.strategies.accumulation"):
        OptimizedTrainer(TinyCausalLM(), LabelsOnPadding(32), spec).fit()
    warnings = [r.message for r in caplog.records if "sit on padding" in r.message]
    assert len(warnings) == 1 and "Set labels to -100 wherever attention_mask is 0" in warnings[0]
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="vlmfast.strategies.accumulation"):
        OptimizedTrainer(TinyCausalLM(), TokenDataset(32), spec).fit()  # padding masked: nothing said
    assert "sit on padding" not in caplog.text


def test_targets_predicted_from_left_padding_are_named_once(caplog):
    """Left padding with the first real token labelled: a pad position predicts it, so the loss depends on padding."""
    import logging

    class LeftPadded(TokenDataset):
        def __getitem__(self, i):
            return {k: v.flip(0) for k, v in super().__getitem__(i).items()}  # real tokens at the end of the row

    spec = TrainSpec(max_steps=2, batch_size=8, micro_batch_size=4, log={"progress": "off"})
    with caplog.at_level(logging.WARNING, logger="vlmfast.strategies.accumulation"):
        OptimizedTrainer(TinyCausalLM(), LeftPadded(32), spec).fit()
    warnings = [r.message for r in caplog.records if "predicted from padding" in r.message]
    assert len(warnings) == 1 and "Set labels to -100 at each row's first real token" in warnings[0]
