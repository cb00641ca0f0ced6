"""Memory estimator: the reference guide's LLaVA-1.5-7B figures, DeepSpeed's ZeRO formulas, measured activations,
cheapest fixes and the CLI. Hugging Face models are built from configs on the meta device: nothing is downloaded.
"""

from __future__ import annotations

import argparse
import math

import pytest
import torch
from torch import nn

from vlmfast.memory.activations import measure_saved_activations
from vlmfast.memory.estimate_cli import add_estimate_memory_parser, run_estimate_memory
from vlmfast.memory.estimator import EstimateOptions, estimate_memory, optimizer_state_bytes
from vlmfast.memory.known_models import KNOWN_CONFIGS, estimate_from_hf_config
from vlmfast.memory.zero import zero2_model_states_bytes, zero3_model_states_bytes
from vlmfast.models import build_tiny_vlm_task

GB_DECIMAL = 1e9  # the reference guide's GB: "7B x 2 bytes = 14 GB"


@pytest.fixture(scope="module")
def llava7b():
    pytest.importorskip("transformers")
    return estimate_from_hf_config("llava-1.5-7b", micro_batch_size=4, gpu_memory_gb=24)


@pytest.fixture(scope="module")
def tiny():
    model, dataset, collator = build_tiny_vlm_task(seed=0, num_samples=16)
    return model, dataset, collator


def _fixed_shape_probe(model):
    """A user-style probe: a synthetic batch of fixed shape (all text positions used), as training would see."""
    cfg = model.config
    gen = torch.Generator().manual_seed(0)

    def probe(mbs: int):
        ids = torch.randint(0, cfg.vocab_size, (mbs, cfg.max_text_len), generator=gen)
        return model(torch.randn(mbs, 3, cfg.image_size, cfg.image_size, generator=gen), ids, labels=ids).loss

    return probe


def _direct_saved_bytes(model: nn.Module, fn) -> int:
    """An independent count of what autograd keeps: storages by address, parameters excluded, all held alive."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}
    alive = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            seen[storage.data_ptr()] = storage.nbytes()
            alive.append(t)
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    del out
    return sum(seen.values())


# ------------------------------------------------------------------------------------------------------------------
# LLaVA-1.5-7B against the reference guide (cuda-oom-debugging.zh.md, 9.1.1-9.1.4)


def test_llava_7b_parameter_counts(llava7b):
    vision, projector, lm = (llava7b.component(n) for n in ("vision_tower", "projector", "language_model"))
    assert llava7b.params == pytest.approx(7.06e9, rel=2e-3)
    # Guide: CLIP ViT-L/14 "304M", MLP projector "20M" (2 layers 1024->4096->4096 with biases).
    assert vision.params == pytest.approx(304e6, rel=0.01)
    assert projector.params == 1024 * 4096 + 4096 + 4096 * 4096 + 4096
    assert projector.params == pytest.approx(20e6, rel=0.05)
    # Vicuna-7B is Llama-2-7B's shapes: 6.74B, which the guide rounds to "7B".
    assert lm.params == pytest.approx(6.74e9, rel=2e-3)
    assert llava7b.largest_layer_params == 32064 * 4096  # the embedding / lm_head, as DeepSpeed counts it


def test_llava_7b_weights_grads_and_optimizer_match_the_reference(llava7b):
    p = llava7b.params
    weights = sum(c.weights for c in llava7b.components)
    grads = sum(c.grads for c in llava7b.components)
    # Guide: 304M x 2 + 7B x 2 + 20M x 2 bytes = "about 14.6 GB" of fp16 weights. Same accounting (2 bytes per
    # parameter); our 14.1e9 is lower only because the guide counts the language model as a round 7B (6.74B real).
    assert weights == 2 * p
    assert weights / GB_DECIMAL == pytest.approx(14.13, abs=0.01)
    assert weights / GB_DECIMAL == pytest.approx(14.6, rel=0.05)
    assert grads == weights  # guide 9.1.2: M_gradients = M_params when nothing is frozen

    # The guide's optimizer line counts states in the weights' 16 bits: "14 GB x 2 = 28 GB", total
    # "14.6 + 14.6 + 28 > 57.2 GB". That is master_weights=False here.
    guide = llava7b.reestimate(master_weights=False)
    guide_optimizer = sum(c.optimizer for c in guide.components)
    assert guide_optimizer == 2 * weights
    assert guide_optimizer / GB_DECIMAL == pytest.approx(28, rel=0.05)
    assert sum(c.total for c in guide.components) / GB_DECIMAL == pytest.approx(57.2, rel=0.05)

    # The default, DeepSpeed's mixed-precision accounting: AdamW m and v in fp32 (2 x params x 4 bytes) plus the
    # fp32 master weights: 12 bytes, 16 per parameter in all.
    master = sum(c.master for c in llava7b.components)
    optimizer = sum(c.optimizer for c in llava7b.components)
    assert master == 4 * p
    assert optimizer - master == 2 * 4 * p
    assert llava7b.model_state_bytes == 16 * p


def test_llava_7b_fp32_and_other_optimizers(llava7b):
    p = llava7b.params
    fp32 = llava7b.reestimate(precision="fp32")
    assert sum(c.weights for c in fp32.components) == 4 * p
    assert fp32.model_state_bytes == 16 * p  # 4 + 4 + 8: mixed precision saves activations, not model states
    assert llava7b.reestimate(optimizer="sgd").model_state_bytes == (2 + 2 + 4) * p
    assert llava7b.reestimate(optimizer="sgd_momentum").model_state_bytes == (2 + 2 + 4 + 4) * p
    adam8 = llava7b.reestimate(optimizer="adamw_8bit").model_state_bytes
    assert (2 + 2 + 4 + 2) * p <= adam8 < (2 + 2 + 4 + 2.01) * p  # small tensors stay 32-bit, as in bitsandbytes
    adafactor = llava7b.reestimate(optimizer="adafactor").model_state_bytes
    assert (2 + 2 + 4) * p < adafactor < (2 + 2 + 4 + 0.01) * p  # factored: a row and a column per matrix


def test_optimizer_state_bytes_per_tensor():
    assert optimizer_state_bytes((4096, 4096), "adamw") == 2 * 4 * 4096 * 4096
    assert optimizer_state_bytes((4096, 4096), "adafactor") == (4096 + 4096) * 4
    assert optimizer_state_bytes((4096,), "adafactor") == 4096 * 4
    assert optimizer_state_bytes((4096, 4096), "adamw_8bit") == 2 * 4096 * 4096
    assert optimizer_state_bytes((64,), "adamw_8bit") == 8 * 64
    assert optimizer_state_bytes((10, 10), "sgd") == 0
    assert optimizer_state_bytes((10, 10), "sgd_momentum", state_bytes=2) == 200
    with pytest.raises(ValueError, match="unknown optimizer"):
        optimizer_state_bytes((2,), "lion")


# ------------------------------------------------------------------------------------------------------------------
# DeepSpeed ZeRO


def test_deepspeed_formulas_numerically():
    p, n, layer = 7_000_000_000, 8, 131_000_000
    # ZeRO-2: 2P + 18P/N (18 = 16-bit grads 2 + fp32 grads 4 + fp32 master 4 + Adam m, v 8).
    assert zero2_model_states_bytes(p, num_gpus_per_node=n, cpu_offload=False).gpu_bytes == 14e9 + 15.75e9
    assert zero2_model_states_bytes(p, num_gpus_per_node=n, cpu_offload=True) == (int(p * 32 * 1.5), 2 * p)
    # ZeRO-3: 4L + 18P/N; offloading both leaves the gathered layer on the GPU and 18P (x1.5) on the host.
    z3 = zero3_model_states_bytes(p, layer, num_gpus_per_node=n, cpu_offload=False, cpu_offload_params=False)
    assert z3.gpu_bytes == 4 * layer + 15.75e9
    assert zero3_model_states_bytes(p, layer, num_gpus_per_node=n) == (int(18 * p * 1.5), 4 * layer)
    offload_opt = zero3_model_states_bytes(p, layer, num_gpus_per_node=n, cpu_offload_params=False)
    assert offload_opt == (int(16 * p * 1.5), 4 * layer + 2 * p // n)


@pytest.mark.parametrize(("stage", "offload_opt", "offload_params", "world"), [
    (2, False, False, 8), (2, True, False, 4), (3, False, False, 8), (3, True, False, 8), (3, True, True, 8),
])
def test_estimate_reproduces_deepspeed(llava7b, stage, offload_opt, offload_params, world):
    est = llava7b.reestimate(zero_stage=stage, world_size=world, offload_optimizer=offload_opt,
                             offload_params=offload_params)
    p, layer = est.params, est.largest_layer_params
    if stage == 2:
        ds = zero2_model_states_bytes(p, num_gpus_per_node=world, cpu_offload=offload_opt)
    else:
        ds = zero3_model_states_bytes(p, layer, num_gpus_per_node=world, cpu_offload=offload_opt,
                                      cpu_offload_params=offload_params)
    assert est.model_state_bytes == pytest.approx(ds.gpu_bytes, abs=16)  # rounding per component
    assert est.cpu_bytes == pytest.approx(ds.cpu_bytes if offload_opt else 0, abs=16)


def test_zero_stage_0_and_1(llava7b):
    p = llava7b.params
    assert llava7b.reestimate(world_size=8).model_state_bytes == 16 * p  # plain DDP replicates everything
    assert llava7b.reestimate(zero_stage=1, world_size=8).model_state_bytes == pytest.approx(4 * p + 16 * p / 8,
                                                                                             abs=16)


def test_invalid_options():
    with pytest.raises(ValueError, match="offload_optimizer needs zero_stage"):
        EstimateOptions(offload_optimizer=True)
    with pytest.raises(ValueError, match="offload_params needs zero_stage 3"):
        EstimateOptions(zero_stage=2, offload_optimizer=True, offload_params=True)
    with pytest.raises(ValueError, match="precision"):
        EstimateOptions(precision="fp8")  # type: ignore[arg-type]


# ------------------------------------------------------------------------------------------------------------------
# frozen parts


def test_frozen_vision_tower_has_no_grads_or_optimizer_states(llava7b):
    frozen = llava7b.reestimate(frozen=("vision_tower",))
    vision = frozen.component("vision_tower")
    assert (vision.trainable, vision.grads, vision.optimizer) == (0, 0, 0)
    assert vision.weights == llava7b.component("vision_tower").weights
    assert frozen.component("language_model") == llava7b.component("language_model")
    assert frozen.trainable_params == llava7b.params - vision.params


def test_requires_grad_false_counts_as_frozen(tiny):
    model, _, _ = tiny
    before = estimate_memory(model, precision="fp32", micro_batch_size=4)
    model.vision_tower.requires_grad_(False)
    try:
        after = estimate_memory(model, precision="fp32", micro_batch_size=4)
    finally:
        model.vision_tower.requires_grad_(True)
    vision = after.component("vision_tower")
    assert (vision.trainable, vision.grads, vision.optimizer) == (0, 0, 0)
    # A frozen tower with no trainable input saves nothing for backward either.
    assert after.activation_bytes < before.activation_bytes
    assert all(p.requires_grad for p in model.parameters())  # the probe restored the flags


# ------------------------------------------------------------------------------------------------------------------
# activations


def test_saved_tensors_counted_once_without_parameters():
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))
    measured = measure_saved_activations(model, lambda: model(torch.randn(4, 16)).sum())
    # addmm keeps the input (4x16); ReLU's output (4x32) is kept once although ReLU and the next Linear both save it.
    assert measured.full() == (4 * 16 + 4 * 32) * 4


def test_tiny_vlm_activations_scale_linearly_and_match_direct_measurement(tiny):
    model, _, _ = tiny
    probe = _fixed_shape_probe(model)
    est = estimate_memory(model, precision="fp32", activation_probe=probe, micro_batch_size=1)
    sizes = {mbs: est.reestimate(micro_batch_size=mbs).activation_bytes for mbs in (1, 2, 4, 8)}
    assert sizes[1] > 0
    assert sizes[8] / sizes[4] == pytest.approx(2, rel=0.1)
    assert sizes[4] / sizes[2] == pytest.approx(2, rel=0.1)
    direct = _direct_saved_bytes(model, lambda: probe(8))
    assert sizes[8] == pytest.approx(direct, rel=0.25)


def test_batch_probe_and_builtin_probe(tiny):
    model, dataset, collator = tiny
    batch = collator([dataset[i] for i in range(8)])
    from_batch = estimate_memory(model, precision="fp32", activation_probe=batch, micro_batch_size=8)
    direct = _direct_saved_bytes(model, lambda: model(**batch).loss)
    assert from_batch.activation_bytes == pytest.approx(direct, rel=0.25)
    builtin = estimate_memory(model, precision="fp32", micro_batch_size=8)  # the tiny VLM's own probe
    assert builtin.activations_measured and builtin.seq_len == model.config.max_positions
    # bf16 autocast keeps 16-bit activations: less per sample than fp32.
    bf16 = estimate_memory(model, precision="bf16", micro_batch_size=8)
    assert bf16.activation_bytes < builtin.activation_bytes


def test_checkpointing_keeps_less(tiny, llava7b):
    model, _, _ = tiny
    full = estimate_memory(model, precision="fp32", micro_batch_size=8)
    ckpt = full.reestimate(activation_checkpointing=True)
    lm_only = full.reestimate(activation_checkpointing="language_model")
    assert ckpt.activation_bytes < lm_only.activation_bytes < full.activation_bytes
    big = llava7b.reestimate(micro_batch_size=1)
    # 32 decoder layers: only their inputs (and one layer's internals) stay, a small fraction of the total.
    assert big.reestimate(activation_checkpointing=True).activation_bytes < 0.25 * big.activation_bytes


def test_llava_activations_grow_with_sequence_length(llava7b):
    short, long = (llava7b.reestimate(micro_batch_size=1, seq_len=n) for n in (1024, 2048))
    assert long.seq_len == 2048 and short.seq_len == 1024
    assert 1.6 < long.activation_bytes / short.activation_bytes < 2.4  # fused attention: about linear


# ------------------------------------------------------------------------------------------------------------------
# cheapest fixes


def test_cheapest_fixes_make_7b_fit_on_24gb(llava7b):
    assert not llava7b.fits(24)
    fixes = llava7b.cheapest_fixes(24)
    assert fixes and not fixes[-1].startswith("still")
    plan = llava7b.plan_fixes(24)
    assert plan.fits and plan.estimate.fits(24) and plan.changes == fixes
    # The reference guide's order: checkpointing before freezing before offload.
    order = [next(i for i, f in enumerate(fixes) if key in f)
             for key in ("activation_checkpointing", "optimizer.freeze", "offload_optimizer")]
    assert order == sorted(order)
    # Re-estimating from scratch with the plan's options gives the same, fitting, numbers.
    again = llava7b.reestimate(**{k: getattr(plan.estimate.options, k) for k in (
        "micro_batch_size", "activation_checkpointing", "precision", "frozen", "zero_stage", "offload_optimizer",
        "linear_cross_entropy", "checkpoint_budget_gb")})
    assert again.gpu_bytes == plan.estimate.gpu_bytes and again.fits(24)


def test_cheapest_fixes_empty_when_it_fits_and_shrinks_micro_batch(llava7b):
    assert llava7b.reestimate(zero_stage=3, world_size=64, activation_checkpointing=True).cheapest_fixes(80) == []
    # On 8 x 80 GiB with ZeRO available, a smaller micro-batch or checkpointing plus sharding suffices: no offload.
    fixes = llava7b.reestimate(world_size=8, micro_batch_size=16).cheapest_fixes(80)
    assert fixes and not any("offload" in f for f in fixes)


def test_table_lists_components_and_verdict(llava7b):
    table = llava7b.to_table()
    for text in ("vision_tower", "projector", "language_model", "activations", "total per GPU", "does NOT fit"):
        assert text in table
    assert "ZeRO-3 gathered layer" in llava7b.reestimate(zero_stage=3, world_size=8).to_table()


# ------------------------------------------------------------------------------------------------------------------
# CLI


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="vlmfast")
    add_estimate_memory_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["estimate-memory", *argv])


def test_cli_prints_table_and_fixes(capsys):
    pytest.importorskip("transformers")
    args = _parse(["--model", "llava-1.5-7b", "--micro-batch-size", "2", "--gpu-gb", "24"])
    assert args.run is run_estimate_memory
    assert run_estimate_memory(args) == 1
    out = capsys.readouterr().out
    assert "language_model" in out and "does NOT fit" in out
    assert "activation_checkpointing.enabled: true" in out


def test_cli_tiny_vlm_fits(capsys):
    assert run_estimate_memory(_parse(["--model", "tiny-vlm", "--precision", "fp32", "--checkpointing"])) == 0
    out = capsys.readouterr().out
    assert "checkpointing all" in out and "fits" in out


def test_known_configs_and_13b():
    pytest.importorskip("transformers")
    assert set(KNOWN_CONFIGS) == {"llava-1.5-7b", "llava-1.5-13b"}
    est = estimate_from_hf_config("llava-1.5-13b", activation_checkpointing=True)
    # Guide exercise 9.1: 304M vision + 13B language model (+ projector, 5120 wide here).
    assert est.component("language_model").params == pytest.approx(13.0e9, rel=0.01)
    assert math.isclose(est.component("vision_tower").params, 303_507_456)
    assert est.component("projector").params == 1024 * 5120 + 5120 + 5120 * 5120 + 5120


def test_lora_gets_gradients_and_optimizer_states_for_the_adapters_only():
    """--lora-r 8 on LLaVA-1.5-7B (meta device): ~20M trainable, and the language model's gradient and AdamW bytes
    shrink by over 100x; the frozen base keeps its bf16 weights."""
    pytest.importorskip("peft")
    from vlmfast.memory.known_models import estimate_from_hf_config

    full = estimate_from_hf_config("llava-1.5-7b", micro_batch_size=1, seq_len=1024, gpu_memory_gb=24)
    lora = estimate_from_hf_config("llava-1.5-7b", micro_batch_size=1, seq_len=1024, gpu_memory_gb=24, lora_r=8)
    by_name = {c.name: c for c in lora.components}
    assert 15e6 < lora.trainable_params < 30e6 and by_name["vision_tower"].trainable == 0
    full_lm = next(c for c in full.components if c.name == "language_model")
    lm = by_name["language_model"]
    assert (lm.grads + lm.optimizer) * 100 < full_lm.grads + full_lm.optimizer
    assert lm.weights >= full_lm.weights  # the base stays, the adapters add a little
    assert not full.fits() and lora.model_state_bytes < full.model_state_bytes / 2
