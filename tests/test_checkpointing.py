"""Activation checkpointing: same gradients, far fewer bytes kept for backward, on the tiny VLM and a tiny HF LLaVA.

Every test compares against an unchecked twin (same seed), so a flag that did nothing fails it.
"""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import LlavaDataset, TinyCausalLM, assert_gradients_close, tiny_llava
from torch import nn

from vlmfast.models import build_tiny_vlm_task
from vlmfast.spec import ActivationCheckpointingSpec, TrainSpec
from vlmfast.strategies import activation_checkpointing as checkpointing
from vlmfast.strategies.activation_checkpointing import (
    ActivationCheckpointing,
    apply_activation_checkpointing,
    detach_frozen_modules,
    find_repeated_blocks,
    saved_tensor_bytes,
)

VLM_BLOCKS = ["vision_tower.blocks.0", "vision_tower.blocks.1", "language_model.layers.0", "language_model.layers.1"]
LLAVA_LM = ["model.language_model.layers.0", "model.language_model.layers.1"]
LLAVA_BLOCKS = ["model.vision_tower.encoder.layers.0", "model.vision_tower.encoder.layers.1", *LLAVA_LM]


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models, one intra-op thread


@pytest.fixture(scope="module")
def vlm_batch() -> dict[str, torch.Tensor]:
    _, dataset, collator = build_tiny_vlm_task(seed=0, num_samples=16)
    return collator([dataset[i] for i in range(8)])


@pytest.fixture(scope="module")
def llava_batch() -> dict[str, torch.Tensor]:
    data = LlavaDataset(n=8)
    return {key: torch.stack([data[i][key] for i in range(8)]) for key in data[0]}


def tiny_vlm() -> nn.Module:
    return build_tiny_vlm_task(seed=0, num_samples=16)[0].train()


def llava() -> nn.Module:
    return tiny_llava(seed=0).train()


def grads(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_same_grads(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert_gradients_close(got, want, rtol=1e-5)  # norm-relative: right on any CPU


def measure(model: nn.Module, batch: dict[str, torch.Tensor]) -> int:
    return saved_tensor_bytes(lambda: model(**batch).loss)


@pytest.fixture(scope="module")
def vlm_reference(vlm_batch) -> tuple[int, dict[str, torch.Tensor]]:
    model = tiny_vlm()
    return measure(model, vlm_batch), grads(model, vlm_batch)


@pytest.fixture(scope="module")
def llava_reference(llava_batch) -> tuple[int, dict[str, torch.Tensor]]:
    model = llava()
    return measure(model, llava_batch), grads(model, llava_batch)


def test_saved_tensor_bytes_counts_storages_once_and_skips_parameters():
    layer = nn.Linear(4, 4)
    x = torch.randn(3, 4, requires_grad=True)
    # tanh saves its output (48 bytes), the linear its input x (48 bytes): the weight is left out by default.
    assert saved_tensor_bytes(lambda: torch.tanh(layer(x))) == 2 * 3 * 4 * 4
    assert saved_tensor_bytes(lambda: torch.tanh(layer(x)), include_parameters=True) == 2 * 48 + 4 * 4 * 4
    assert saved_tensor_bytes(lambda: (x * x[0]).sum()) == 48  # x and its view x[0]: one storage


def test_tiny_vlm_same_gradients_and_at_least_half_fewer_saved_bytes(vlm_batch, vlm_reference):
    plain_bytes, plain_grads = vlm_reference
    model = tiny_vlm()
    keys = list(model.state_dict())
    assert apply_activation_checkpointing(model) == VLM_BLOCKS
    assert list(model.state_dict()) == keys  # checkpoints and optimizer groups are unaffected
    assert measure(model, vlm_batch) <= 0.5 * plain_bytes
    assert_same_grads(grads(model, vlm_batch), plain_grads)


def test_no_recomputation_in_eval_or_no_grad(vlm_batch, monkeypatch):
    model = tiny_vlm()
    apply_activation_checkpointing(model)
    calls = []
    real = checkpointing.checkpoint
    monkeypatch.setattr(checkpointing, "checkpoint", lambda *a, **k: calls.append(1) or real(*a, **k))
    with torch.no_grad():
        model(**vlm_batch)
    model.eval()
    model(**vlm_batch)
    assert calls == []
    model.train()
    model(**vlm_batch)
    assert len(calls) == len(VLM_BLOCKS)


def test_deepcopy_of_a_checkpointed_model_uses_its_own_parameters(vlm_batch):
    model = tiny_vlm()
    apply_activation_checkpointing(model)
    clone = copy.deepcopy(model)
    clone(**vlm_batch).loss.backward()
    assert all(p.grad is None for p in model.parameters())
    assert clone.language_model.layers[0].attn.qkv.weight.grad is not None


def test_hf_llava_uses_its_own_checkpointing_same_gradients_fewer_bytes(llava_batch, llava_reference):
    plain_bytes, plain_grads = llava_reference
    model = llava()
    keys = list(model.state_dict())
    assert apply_activation_checkpointing(model) == LLAVA_BLOCKS
    assert model.model.language_model.layers[0].gradient_checkpointing  # HF's switch, not a forward wrapper
    assert "forward" not in vars(model.model.language_model.layers[0])
    assert list(model.state_dict()) == keys
    assert measure(model, llava_batch) <= 0.5 * plain_bytes
    assert_same_grads(grads(model, llava_batch), plain_grads)


def test_every_and_scope_select_blocks_and_save_in_between(vlm_batch, vlm_reference):
    plain_bytes, plain_grads = vlm_reference
    every = tiny_vlm()
    assert apply_activation_checkpointing(every, every=2) == ["vision_tower.blocks.0", "language_model.layers.0"]
    assert apply_activation_checkpointing(tiny_vlm(), scope="vision") == VLM_BLOCKS[:2]
    lm, full = tiny_vlm(), tiny_vlm()
    assert apply_activation_checkpointing(lm, scope="language_model") == VLM_BLOCKS[2:]
    apply_activation_checkpointing(full)
    assert measure(full, vlm_batch) < measure(lm, vlm_batch) < plain_bytes
    assert measure(full, vlm_batch) < measure(every, vlm_batch) < plain_bytes
    assert_same_grads(grads(lm, vlm_batch), plain_grads)
    assert_same_grads(grads(every, vlm_batch), plain_grads)


def test_named_blocks_by_path_or_glob():
    assert apply_activation_checkpointing(tiny_vlm(), blocks=["language_model.layers"]) == VLM_BLOCKS[2:]
    assert apply_activation_checkpointing(tiny_vlm(), blocks=["*.layers.*"]) == VLM_BLOCKS[2:]
    assert apply_activation_checkpointing(tiny_vlm(), blocks=["vision_tower"]) == ["vision_tower"]
    assert list(find_repeated_blocks(tiny_vlm())) == ["vision_tower.blocks", "language_model.layers"]


def test_hf_selective_checkpoints_only_lm_layers_and_drops_the_kv_cache(llava_batch, llava_reference):
    plain_bytes, plain_grads = llava_reference
    model = llava()
    # A plain forward wrapper here would append to Llama's KV cache again on recomputation and fail.
    assert apply_activation_checkpointing(model, scope="language_model") == LLAVA_LM
    assert not model.model.vision_tower.encoder.layers[0].gradient_checkpointing
    assert measure(model, llava_batch) < plain_bytes
    assert_same_grads(grads(model, llava_batch), plain_grads)


class CountingSaveOnCpu(torch.autograd.graph.save_on_cpu):
    """torch's save_on_cpu that counts the tensors it packs and checks they land on the CPU."""

    packed = 0

    def __init__(self, pin_memory: bool = False, device_type: str = "cuda") -> None:
        super().__init__(pin_memory=pin_memory, device_type=device_type)
        pack = self.pack_hook

        def counting_pack(tensor: torch.Tensor):
            device, packed = pack(tensor)
            assert packed.device.type == "cpu"
            CountingSaveOnCpu.packed += 1
            return device, packed

        self.pack_hook = counting_pack


@pytest.mark.parametrize("offload", [False, True])
def test_offload_to_cpu_sends_block_inputs_through_save_on_cpu(vlm_batch, vlm_reference, monkeypatch, offload):
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", CountingSaveOnCpu)
    CountingSaveOnCpu.packed = 0
    on_device, model = tiny_vlm(), tiny_vlm()
    apply_activation_checkpointing(on_device)
    apply_activation_checkpointing(model, offload_to_cpu=offload)
    kept_on_device = measure(on_device, vlm_batch)
    assert CountingSaveOnCpu.packed == 0
    kept = measure(model, vlm_batch)
    # One saved input per checkpointed block, taken by save_on_cpu before the outer measuring hook sees it.
    assert CountingSaveOnCpu.packed == (len(VLM_BLOCKS) if offload else 0)
    assert (kept < kept_on_device) if offload else (kept == kept_on_device)
    assert_same_grads(grads(model, vlm_batch), vlm_reference[1])


def test_hf_offload_uses_save_on_cpu(llava_batch, monkeypatch):
    monkeypatch.setattr(torch.autograd.graph, "save_on_cpu", CountingSaveOnCpu)
    CountingSaveOnCpu.packed = 0
    model = llava()
    apply_activation_checkpointing(model, offload_to_cpu=True)
    model(**llava_batch).loss.backward()
    assert CountingSaveOnCpu.packed >= len(LLAVA_BLOCKS)


def test_frozen_vision_tower_keeps_no_graph(llava_batch):
    # HF checkpointing hooks the vision patch embedding to require grad: the frozen tower then keeps activations.
    trapped, fixed = llava(), llava()
    for model in (trapped, fixed):
        model.model.vision_tower.requires_grad_(False)
        apply_activation_checkpointing(model)
    assert detach_frozen_modules(fixed) == ["model.vision_tower"]
    assert measure(fixed, llava_batch) < measure(trapped, llava_batch)
    fixed_grads = grads(fixed, llava_batch)
    assert not any("vision_tower" in name for name in fixed_grads)
    assert_same_grads(fixed_grads, grads(trapped, llava_batch))


def test_frozen_fix_steps_aside_when_unfrozen_or_inputs_need_grad(vlm_batch, vlm_reference):
    model = tiny_vlm()
    model.vision_tower.requires_grad_(False)
    assert detach_frozen_modules(model) == ["vision_tower"]
    model.vision_tower.requires_grad_(True)  # checked at every call, not only when wrapped
    assert_same_grads(grads(model, vlm_batch), vlm_reference[1])
    model.vision_tower.requires_grad_(False)
    pixels = vlm_batch["pixel_values"].clone().requires_grad_(True)
    model(**{**vlm_batch, "pixel_values": pixels}).loss.backward()
    assert pixels.grad is not None and pixels.grad.abs().sum() > 0


def test_bad_blocks_or_scope_name_the_field():
    with pytest.raises(ValueError, match=r"activation_checkpointing\.blocks.*language_model\.layers"):
        apply_activation_checkpointing(tiny_vlm(), blocks=["decoder.layers"])
    with pytest.raises(ValueError, match=r"activation_checkpointing\.blocks: no repeated blocks"):
        apply_activation_checkpointing(TinyCausalLM())
    with pytest.raises(ValueError, match=r"activation_checkpointing\.scope"):
        apply_activation_checkpointing(tiny_vlm(), blocks=["language_model.layers"], scope="vision")


def test_strategy_from_spec_wraps_fixes_frozen_and_describes(vlm_batch, vlm_reference):
    spec = TrainSpec(activation_checkpointing={"enabled": True, "every": 2}).activation_checkpointing
    model = tiny_vlm()
    model.vision_tower.requires_grad_(False)
    strategy = ActivationCheckpointing(spec)
    assert strategy.apply(model) is model
    assert strategy.blocks == ["vision_tower.blocks.0", "language_model.layers.0"]
    assert strategy.frozen == ["vision_tower"]
    assert strategy.describe() == (
        "activation checkpointing: 1/2 vision_tower.blocks + 1/2 language_model.layers blocks (non-reentrant), "
        "saved activations kept on device, frozen vision_tower run without autograd")
    assert measure(model, vlm_batch) < vlm_reference[0]


def test_disabled_strategy_changes_nothing(vlm_batch, vlm_reference):
    model = tiny_vlm()
    strategy = ActivationCheckpointing(ActivationCheckpointingSpec())
    strategy.apply(model)
    assert strategy.describe() == "activation checkpointing: off"
    assert measure(model, vlm_batch) == vlm_reference[0]
