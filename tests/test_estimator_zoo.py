"""The memory estimator on real VLM batches (images included) from the zoo's processors.

A real batch as ``activation_probe`` (samples with their collate_fn, or a collated batch, split by sample: Qwen2-VL's
flattened patches and LLaVA-NeXT's tiles used to crash the probe) is measured at half and all of it, and the estimate
for a micro-batch of 4 lands within 25 % of what autograd really saves on the batch's micro-batches of 4. Without a
probe, a VLM that the built-in probe can only run as text is not called "measured".
"""

from __future__ import annotations

import pytest
import torch

from vlmfast.data.batch_layout import BatchLayout, split_collated
from vlmfast.data.micro_batches import SampleBatch
from vlmfast.memory.activations import measure_saved_activations
from vlmfast.memory.estimator import estimate_memory

transformers = pytest.importorskip("transformers")
from zoo import build_case  # noqa: E402

transformers.logging.set_verbosity_error()


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def saved_bytes(model, batch) -> int:
    """What autograd keeps for backward during a training forward of ``batch`` (parameters excluded)."""
    model.train()
    return measure_saved_activations(model, lambda: model(**batch).loss).full()


@pytest.mark.parametrize("name", ["qwen2_vl", "llava_next", "mllama", "idefics3"])
def test_activation_estimate_from_a_real_batch_is_within_25_percent(name):
    case = build_case(name)
    layout = BatchLayout.from_model(case.model)
    # Samples first (as the trainer's loader): the estimate for micro-batches of 4 collated from their samples.
    est = estimate_memory(case.model, precision="fp32", micro_batch_size=4,
                          activation_probe=SampleBatch.from_samples(case.samples, case.collate_fn))
    assert est.activations_measured and "saved for backward, measured" in est.to_table()
    real = [saved_bytes(case.model, case.collate_fn(case.samples[i:i + 4])) for i in (0, 4)]
    assert est.activation_bytes == pytest.approx(sum(real) / 2, rel=0.25)
    # A collated batch (a user's DataLoader): split by sample, padding kept, as the trainer would run it.
    batch = case.collate_fn(case.samples)
    est = estimate_memory(case.model, precision="fp32", micro_batch_size=4, activation_probe=batch)
    real = [saved_bytes(case.model, part) for part in split_collated(batch, 4, layout)]
    assert est.activation_bytes == pytest.approx(sum(real) / 2, rel=0.25)
    if name != "mllama":  # (the zoo pads Mllama's text-only batches with empty image slots)
        text_only = [{**s, "images": []} for s in case.samples[:4]]
        assert saved_bytes(case.model, case.collate_fn(text_only)) < 0.9 * real[0]  # images are in the figure


def test_a_text_only_probe_of_a_vlm_is_not_called_measured():
    case = build_case("mllama")  # the built-in probe runs it as a causal LM: no image
    est = estimate_memory(case.model, precision="fp32", micro_batch_size=4)
    assert not est.activations_measured and est.activations_text_only
    assert "text only, images not measured" in est.to_table()
