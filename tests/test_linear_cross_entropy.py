"""Chunked linear cross-entropy: the same loss and gradients as the standard head + loss, without the logits."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from conftest import LlavaDataset, TokenDataset, tiny_llava, token_batch

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.hooks import apply_linear_cross_entropy, linear_cross_entropy, saved_tensor_bytes, shift_targets
from vlmfast.models.tiny_vlm import TinyVLM, TinyVLMConfig
from vlmfast.strategies.linear_cross_entropy import resolve_impl

transformers = pytest.importorskip("transformers")

VOCAB = 97


def _relative(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).detach().norm() / b.detach().norm())


@pytest.mark.parametrize("recompute", [True, False], ids=["recompute", "in-forward"])
@pytest.mark.parametrize(("softcap", "scale", "smoothing", "z_loss", "bias"), [
    (None, 1.0, 0.0, 0.0, False), (5.0, 1.0, 0.0, 0.0, False), (None, 0.5, 0.1, 1e-3, True),
    (3.0, 2.0, 0.2, 1e-2, True),
])
def test_function_equals_the_standard_loss(softcap, scale, smoothing, z_loss, bias, recompute) -> None:
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 17, 16, dtype=torch.float64, generator=g, requires_grad=True)
    weight = torch.randn(VOCAB, 16, dtype=torch.float64, generator=g, requires_grad=True)
    b = torch.randn(VOCAB, dtype=torch.float64, generator=g, requires_grad=True) if bias else None
    targets = torch.randint(0, VOCAB, (3, 17), generator=g)
    targets[:, ::5] = -100
    leaves = [hidden, weight, *([b] if bias else [])]
    ours = linear_cross_entropy(hidden, weight, targets, bias=b, chunk_tokens=7, softcap=softcap, logit_scale=scale,
                                label_smoothing=smoothing, z_loss=z_loss, reduction="mean", recompute=recompute)
    logits = F.linear(hidden, weight, b) * scale
    if softcap:
        logits = softcap * torch.tanh(logits / softcap)
    flat, flat_targets = logits.reshape(-1, VOCAB), targets.reshape(-1)
    kept = flat_targets != -100
    standard = F.cross_entropy(flat, flat_targets, label_smoothing=smoothing, reduction="sum")
    standard = (standard + z_loss * torch.logsumexp(flat[kept], 1).square().sum()) / kept.sum()
    assert abs(float(ours.detach() - standard.detach())) < 1e-10
    for a, b_ in zip(torch.autograd.grad(ours, leaves), torch.autograd.grad(standard, leaves), strict=True):
        assert _relative(a, b_) < 1e-10


def test_under_autocast_the_head_runs_in_bf16_like_the_model() -> None:
    """The head's matmul in autocast's dtype, the loss in fp32: the standard bf16 path's loss, to fp32 rounding."""
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(64, 32, generator=g, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(500, 32, generator=g))
    targets = torch.randint(0, 500, (64,), generator=g)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours = linear_cross_entropy(hidden, weight, targets, chunk_tokens=16)
        standard = F.cross_entropy(F.linear(hidden, weight).float(), targets, reduction="sum")
    assert ours.dtype == torch.float32
    assert abs(float(ours.detach() - standard.detach())) <= 1e-5 * abs(float(standard.detach()))
    ours_grad = torch.autograd.grad(ours, [hidden, weight])
    standard_grad = torch.autograd.grad(standard, [hidden, weight])
    assert all(_relative(a, b) < 2e-2 for a, b in zip(ours_grad, standard_grad, strict=True))  # bf16 rounding


def _build(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=64)
    if name == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    if name == "qwen2-tied":
        return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**common, tie_word_embeddings=True))
    # tied embeddings and the final logit soft-capping of Gemma 2
    return transformers.Gemma2ForCausalLM(transformers.Gemma2Config(**common, head_dim=8, final_logit_softcapping=3.0))


def _hidden_grad(model: torch.nn.Module, batch: dict, **extra) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, gradient of the base model's output hidden states)."""
    captured = {}

    def keep(_m, _a, out):
        if not out.last_hidden_state.requires_grad:  # the one-off no-grad check against the model's logits
            return
        out.last_hidden_state.retain_grad()
        captured["hidden"] = out.last_hidden_state

    handle = model.model.register_forward_hook(keep)
    loss = model(**batch, **extra).loss
    handle.remove()
    loss.backward()
    return loss.detach(), captured["hidden"].grad


@pytest.mark.parametrize("name", ["llama", "qwen2-tied", "gemma2"])
def test_hf_gradients_equal_the_models_own_loss(name: str) -> None:
    model = _build(name).double()
    chunked = copy.deepcopy(model)
    state = apply_linear_cross_entropy(chunked, chunk_tokens=16)
    batch = token_batch(6, 20, VOCAB)
    for extra in ({}, {"num_items_in_batch": 40}):  # mean over own tokens; the accumulation's global divisor
        loss, hidden = _hidden_grad(model, batch, **extra)
        ours, our_hidden = _hidden_grad(chunked, batch, **extra)
        assert abs(float(ours - loss)) < 1e-5 * abs(float(loss))
        assert _relative(our_hidden, hidden) < 1e-5
        head, our_head = model.get_output_embeddings().weight, chunked.get_output_embeddings().weight
        assert _relative(our_head.grad, head.grad) < 1e-5
        model.zero_grad()
        chunked.zero_grad()
    assert state.verified == "yes"
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert tied == (name != "llama")
    assert (state.source.transform.softcap == 3.0) == (name == "gemma2")


def test_the_logits_check_passes_under_bf16_autocast() -> None:
    """Seen on an H200 first: in fp32 weights under bf16 autocast the model's head gives bf16 logits, the check's
    fp32 hidden states gave fp32 ones, and the fp32 tolerance refused a model the loss is exact for."""
    model = _build("qwen2-tied")
    standard = copy.deepcopy(model)
    state = apply_linear_cross_entropy(model, chunk_tokens=16)
    batch = token_batch(4, 20, VOCAB)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ours, theirs = model(**batch).loss, standard(**batch).loss
    assert state.verified == "yes"
    assert abs(float(ours - theirs)) < 2e-2 * abs(float(theirs))  # bf16 logits against the chunked fp32 loss


def _train_one_step(model: torch.nn.Module, data, lce: bool, collate=None) -> torch.nn.Module:
    spec = TrainSpec(max_steps=1, batch_size=8, micro_batch_size=3, device="cpu", optimizer={"name": "sgd", "lr": 1.0},
                     linear_cross_entropy={"enabled": lce, "chunk_tokens": 16},
                     log={"progress": False}, memory={"timeline_plot": False, "leak_check": False})
    trainer = OptimizedTrainer(model, data, spec, collate_fn=collate)
    trainer.fit()
    return trainer


@pytest.mark.parametrize("name", ["llama", "qwen2-tied", "gemma2"])
def test_whole_model_after_one_step_equals_the_standard_loss(name: str) -> None:
    """Through the trainer: micro-batches of 3 out of 8 (num_items_in_batch), one SGD step, every parameter."""
    model = _build(name).double()
    data = TokenDataset(8, 20, VOCAB)
    standard = _train_one_step(copy.deepcopy(model), data, lce=False).engine.module
    trainer = _train_one_step(model, data, lce=True)
    before = dict(_build(name).double().named_parameters())
    for (key, ours), (_, theirs) in zip(trainer.engine.module.named_parameters(), standard.named_parameters(),
                                        strict=True):
        step, their_step = ours - before[key], theirs - before[key]
        assert _relative(step, their_step) < 1e-5, key
    assert any("linear cross-entropy: torch" in line for line in trainer._build_report([], 1.0).strategies)


def test_vlms_llava_and_the_tiny_vlm_packed_and_padded() -> None:
    llava = tiny_llava().double()
    data = LlavaDataset(6)
    batch = {k: torch.stack([data[i][k] for i in range(6)]) for k in data[0]}
    batch["pixel_values"] = batch["pixel_values"].double()
    chunked = copy.deepcopy(llava)
    state = apply_linear_cross_entropy(chunked, chunk_tokens=5)
    llava(**batch).loss.backward()
    chunked(**batch).loss.backward()
    pairs = zip(llava.parameters(), chunked.parameters(), strict=True)
    grads = [(p.grad, q.grad) for p, q in pairs if p.grad is not None]
    assert _relative(torch.cat([g.flatten() for _, g in grads]), torch.cat([g.flatten() for g, _ in grads])) < 1e-5
    assert state.verified == "yes" and state.source.kind == "hugging face"

    torch.manual_seed(0)
    tiny = TinyVLM(TinyVLMConfig(vocab_size=VOCAB)).double()
    chunked = copy.deepcopy(tiny)
    assert apply_linear_cross_entropy(chunked, chunk_tokens=8).source.kind == "hidden_states_for_loss"
    text = token_batch(4, 12, VOCAB)
    pixels = torch.randn(4, 3, 48, 48, dtype=torch.float64)
    positions = torch.arange(12).repeat(4, 1)  # the packed-row path: every position carries logits
    for extra in ({}, {"position_ids": positions, "pixel_values": pixels[:, None]}):
        inputs = {"pixel_values": pixels, **text, **extra}
        if "position_ids" in extra:
            inputs["input_ids"] = text["input_ids"].clone()
            inputs["input_ids"][:, :9] = -200  # one image's 9 placeholder tokens per row
            inputs["images_per_row"] = torch.ones(4, dtype=torch.long)
        tiny(**inputs, num_items_in_batch=30).loss.backward()
        out = chunked(**inputs, num_items_in_batch=30)
        assert out.logits is None
        out.loss.backward()
        assert _relative(chunked.get_output_embeddings().weight.grad, tiny.get_output_embeddings().weight.grad) < 1e-5
        assert _relative(chunked.vision_tower.patch_embed.weight.grad, tiny.vision_tower.patch_embed.weight.grad) < 1e-5
        tiny.zero_grad()
        chunked.zero_grad()


def test_loss_path_keeps_far_fewer_bytes_for_backward() -> None:
    """Fails if the chunked path kept the logits (or their softmax) for backward: 4,096 / 32 = 128x bound."""
    vocab, dim, tokens = 4096, 32, 512
    hidden = torch.randn(tokens, dim, requires_grad=True)
    weight = torch.nn.Parameter(torch.randn(vocab, dim))  # resident: not counted, as in a model
    targets = torch.randint(0, vocab, (tokens,))

    def standard() -> torch.Tensor:
        return F.cross_entropy(F.linear(hidden * 1.0, weight), targets, reduction="sum")

    def chunked(recompute: bool = True) -> torch.Tensor:
        return linear_cross_entropy(hidden * 1.0, weight, targets, chunk_tokens=64, recompute=recompute)

    assert saved_tensor_bytes(standard) > 50 * saved_tensor_bytes(chunked)
    # Gradients computed in forward keep the head weight's [vocab, hidden] gradient instead: Liger's ratio, not 50x.
    in_forward = saved_tensor_bytes(lambda: chunked(recompute=False))
    assert saved_tensor_bytes(chunked) < in_forward < saved_tensor_bytes(standard) / 5
    assert torch.equal(shift_targets(torch.tensor([[1, 2, 3]])), torch.tensor([[2, 3, -100]]))


def _encoder_decoder(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "t5":  # no base model to run: the head's input is captured (scaled by d_model ** -0.5, tied)
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0,
            pad_token_id=0, dropout_rate=0.0)).double()
    return transformers.BartForConditionalGeneration(transformers.BartConfig(  # its base model gives the hidden states
        vocab_size=VOCAB, d_model=32, encoder_layers=1, decoder_layers=1, encoder_attention_heads=4,
        decoder_attention_heads=4, encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64,
        dropout=0.0)).double()


@pytest.mark.parametrize("name", ["t5", "bart"])
def test_an_encoder_decoder_gets_its_decoder_inputs_from_the_labels_and_the_same_loss_and_gradients(name) -> None:
    """The chunked loss takes the labels away before the forward: the decoder inputs are made from them first, by
    the model's own prepare_decoder_input_ids_from_labels, and the targets are the labels unshifted (seq2seq)."""
    model = _encoder_decoder(name)
    chunked = copy.deepcopy(model)
    state = apply_linear_cross_entropy(chunked, chunk_tokens=4)
    labels = torch.randint(3, VOCAB, (3, 6))
    labels[0, 4:] = -100
    batch = {"input_ids": torch.randint(3, VOCAB, (3, 9)), "attention_mask": torch.ones(3, 9, dtype=torch.long),
             "labels": labels}
    loss, ours = model(**batch).loss, chunked(**batch).loss
    loss.backward()
    ours.backward()
    assert abs(float(ours - loss)) < 1e-10 * abs(float(loss)) and state.verified in ("yes", "not checked (the forward "
                                                                                    "takes no logits_to_keep)")
    # all gradients as one vector (a key bias's gradient is zero in exact arithmetic: noise alone, per tensor)
    theirs = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert _relative(torch.cat([p.grad.flatten() for p in chunked.parameters()]), theirs) < 1e-10


def test_a_forward_that_takes_decoder_input_ids_over_a_decoder_only_lm_is_not_an_encoder_decoder() -> None:
    """InstructBLIP's forward takes decoder_input_ids (for its T5 variants) but its language model here is a Llama:
    the configs, not the signature, decide (it was refused as an encoder-decoder for a while)."""
    from zoo import build_case

    case = build_case("instructblip")
    state = apply_linear_cross_entropy(case.model)
    assert state.decoder_inputs is None


def test_an_encoder_decoder_without_a_way_to_make_its_decoder_inputs_is_refused_naming_the_strategy() -> None:
    model = _encoder_decoder("bart")
    model.prepare_decoder_input_ids_from_labels = None  # neither the model's own shift ...
    model.config.decoder_start_token_id = None  # ... nor the config's start token
    with pytest.raises(ValueError, match=r"linear_cross_entropy: BartForConditionalGeneration is an encoder-decoder "
                       r"that shows no way to make its decoder_input_ids from the labels"):
        apply_linear_cross_entropy(model)


def test_clear_refusals() -> None:
    with pytest.raises(ValueError, match="hidden_states_for_loss"):
        apply_linear_cross_entropy(torch.nn.Linear(3, 3))
    with pytest.raises(ValueError, match="CUDA only"):
        resolve_impl("liger", torch.device("cpu"))
    assert resolve_impl("auto", torch.device("cpu")) == "torch"

    model = _build("llama").double()
    original = model.forward

    def squared_forward(*args, **kwargs):  # no scale, cap, bias or mask gives this: refused, naming what was seen
        out = original(*args, **kwargs)
        out.logits = out.logits + out.logits ** 2
        return out

    model.forward = squared_forward
    apply_linear_cross_entropy(model)
    with pytest.raises(ValueError, match=r"^linear_cross_entropy: what the model does between its head and its "
                                         r"logits is not .* a zero head output gave logits \[0, 0"):
        model(**token_batch(2, 8, VOCAB))


def _with_logits(model, change):
    """The model with its forward's logits changed by ``change`` (what a model might do after its head)."""
    original = model.forward

    def forward(*args, **kwargs):
        out = original(*args, **kwargs)
        out.logits = change(out.logits)
        return out

    model.forward = forward
    return model


def _masked(logits):
    logits = logits.clone()
    logits[..., [3, 5, 7]] = torch.finfo(logits.dtype).min  # Chameleon's way with its image tokens
    return logits


BIAS = torch.linspace(-1, 1, VOCAB, dtype=torch.float64)
AFTER_THE_HEAD = {  # what the forward does to the head's output -> what the probe must find
    "config scale not applied": (lambda x: x, "scale 1"),  # Aya Vision: the config's logit_scale, unused
    "scale": (lambda x: x * 0.0625, "scale 0.0625"),
    "soft cap": (lambda x: 2.5 * torch.tanh(x / 2.5), "scale 1, soft cap 2.5"),
    "scaled and capped": (lambda x: 30.0 * torch.tanh(x * 0.5 / 30.0), "scale 0.5, soft cap 30"),
    "bias": (lambda x: x + BIAS, "scale 1, an additive bias"),
    "mask": (_masked, "scale 1, 3 vocabulary entries masked"),
    "capped, bias and mask": (lambda x: _masked(3.0 * torch.tanh(x / 3.0) + BIAS), "soft cap 3, an additive bias"),
}


@pytest.mark.parametrize("seen", list(AFTER_THE_HEAD))
def test_what_the_model_does_after_its_head_is_probed_and_reproduced_in_the_chunks(seen: str) -> None:
    """Learned from the forward, never the config: the config says logit_scale 0.0625 in every case here (Aya
    Vision's text config does, its forward applies none); the loss and every gradient equal the model's own."""
    change, found = AFTER_THE_HEAD[seen]
    model = _with_logits(_build("llama").double(), change)
    model.config.logit_scale = 0.0625
    chunked = _with_logits(_build("llama").double(), change)
    state = apply_linear_cross_entropy(chunked, chunk_tokens=8)
    batch = token_batch(3, 12, VOCAB)
    batch["labels"] = batch["labels"].masked_fill(torch.isin(batch["labels"], torch.tensor([3, 5, 7])), -100)
    inputs = {k: v for k, v in batch.items() if k != "labels"}
    logits = model(**inputs).logits  # what the model's forward returns, its loss taken on them in float64
    loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten(), ignore_index=-100)
    ours = chunked(**batch).loss
    loss.backward()
    ours.backward()
    assert abs(float(ours - loss)) < 1e-10 * abs(float(loss))
    theirs = torch.cat([p.grad.flatten() for p in model.parameters()])
    assert _relative(torch.cat([p.grad.flatten() for p in chunked.parameters()]), theirs) < 1e-10
    assert state.verified == "yes" and found in str(state.source.transform)
    assert f"after the head: {state.source.transform}" in state.describe()


def test_through_a_peft_lora_wrapper_the_gradients_equal_the_models_own_loss() -> None:
    """A PEFT LoRA model: the chunked loss goes on the model it wraps (whose forward the wrapper calls with the
    labels); LoRA's adapters and the projector get the standard loss's gradients, the frozen base none."""
    peft = pytest.importorskip("peft")
    llava = tiny_llava().double()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             modules_to_save=["multi_modal_projector"])
    wrapped = peft.get_peft_model(llava, config)
    chunked = copy.deepcopy(wrapped)
    state = apply_linear_cross_entropy(chunked, chunk_tokens=5)
    assert state.source.kind == "hugging face"
    data = LlavaDataset(6)
    batch = {k: torch.stack([data[i][k] for i in range(6)]) for k in data[0]}
    batch["pixel_values"] = batch["pixel_values"].double()
    standard, ours = wrapped(**batch).loss, chunked(**batch).loss
    assert ours.item() == pytest.approx(standard.item(), rel=1e-6)
    standard.backward()
    ours.backward()
    pairs = [(n, p.grad, q.grad) for (n, p), q in zip(wrapped.named_parameters(), chunked.parameters(), strict=True)
             if p.requires_grad]
    assert all((g is None) == (q is None) for _, g, q in pairs)  # the vision tower's unused last layer: neither
    pairs = [(n, g, q) for n, g, q in pairs if g is not None]
    assert any("lora_A" in n for n, _, _ in pairs) and any("multi_modal_projector" in n for n, _, _ in pairs)
    assert _relative(torch.cat([q.flatten() for _, _, q in pairs]), torch.cat([g.flatten() for _, g, _ in pairs])) \
        < 1e-5
    assert state.verified == "yes"
