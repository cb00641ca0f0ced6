"""Chunked cross-entropy, checkpointing budgets and token budgets in `vlmfast estimate-memory` and `vlmfast doctor`."""

from __future__ import annotations

import argparse

import pytest

from vlmfast.memory.known_models import build_estimate_model, estimate_from_hf_config
from vlmfast.profiling.doctor import Evidence, diagnose
from vlmfast.spec import TrainSpec

pytest.importorskip("transformers")

# Qwen2-0.5B's head (vocabulary 151,936, hidden 896) on a 2-layer body, built on the meta device: nothing allocated.
QWEN_HEAD = {"model_type": "qwen2", "vocab_size": 151_936, "hidden_size": 896, "intermediate_size": 4864,
             "num_hidden_layers": 2, "num_attention_heads": 14, "num_key_value_heads": 2,
             "max_position_embeddings": 4096, "tie_word_embeddings": True}


@pytest.fixture(scope="module")
def qwen_head():
    return build_estimate_model(QWEN_HEAD)


def test_estimate_knows_chunked_cross_entropy_and_proposes_it_first(qwen_head) -> None:
    from vlmfast.memory.estimator import estimate_memory

    est = estimate_memory(qwen_head, micro_batch_size=1, seq_len=4096, gpu_memory_gb=4)
    chunked = est.reestimate(linear_cross_entropy=True)
    logits = 4095 * 151_936 * 4  # the fp32 log-softmax the standard loss keeps
    assert est.activation_bytes - chunked.activation_bytes >= 0.99 * logits
    assert "chunked cross-entropy" in chunked.to_table()
    assert est.cheapest_fixes()[0].startswith("linear_cross_entropy.enabled: true")


def test_estimate_with_a_checkpointing_budget_and_a_token_budget() -> None:
    est = estimate_from_hf_config("tiny-vlm", micro_batch_size=8, gpu_memory_gb=1)
    every = est.reestimate(activation_checkpointing=True)
    roomy = est.reestimate(checkpoint_budget_gb=1.05 * est.activation_bytes / 2**30)
    assert roomy.activation_bytes == est.activation_bytes  # nothing needs checkpointing
    middle = est.reestimate(checkpoint_budget_gb=(every.activation_bytes + est.activation_bytes) / 2 / 2**30)
    assert every.activation_bytes <= middle.activation_bytes  # what it keeps, plus one block while recomputed
    assert any("budget_gb" in note and "keeps" in note for note in middle.notes)
    seq = est.seq_len
    by_tokens = est.reestimate(micro_batch_tokens=3 * seq)  # three rows of the longest sample
    assert by_tokens.activation_bytes == est.reestimate(micro_batch_size=3).activation_bytes
    assert f"micro-batch {3 * seq} tokens" in by_tokens.to_table()


def test_cli_flags() -> None:
    from vlmfast.memory.estimate_cli import add_estimate_memory_parser, run_estimate_memory

    parser = argparse.ArgumentParser()
    add_estimate_memory_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["estimate-memory", "--model", "tiny-vlm", "--linear-cross-entropy",
                              "--checkpoint-budget-gb", "0.01", "--micro-batch-tokens", "600", "--gpu-gb", "1"])
    assert run_estimate_memory(args) == 0


def _evidence(spec: TrainSpec, **facts) -> Evidence:
    sample = {"perf/step_time": 1.0, "perf/forward_time": 0.3, "perf/backward_time": 0.6, "perf/optimizer_time": 0.1}
    return Evidence(samples=[sample, dict(sample)], spec=spec, **facts)


def test_doctor_proposes_each_when_it_would_help() -> None:
    spec = TrainSpec(batch_size=16, micro_batch_size=4, activation_checkpointing={"enabled": True})
    findings = {f.key: f for f in diagnose(_evidence(
        spec, vocab_size=151_936, tokens_per_micro_batch=8192, peak_memory_gb=20.0, device_memory_gb=80.0,
        padding_fraction=0.6, length_spread=40.0))}
    assert findings["logits_memory"].change == {"linear_cross_entropy.enabled": True}
    assert findings["token_budget"].change == {"micro_batch_tokens": 8192}
    assert findings["memory_headroom"].change == {"activation_checkpointing.budget_gb": 48.0}
    quiet = {f.key for f in diagnose(_evidence(
        TrainSpec(batch_size=16, micro_batch_size=4, micro_batch_tokens=4096, linear_cross_entropy={"enabled": True}),
        vocab_size=151_936, tokens_per_micro_batch=8192, peak_memory_gb=70.0, device_memory_gb=80.0,
        padding_fraction=0.6, length_spread=40.0))}
    assert not quiet & {"logits_memory", "token_budget", "memory_headroom"}
