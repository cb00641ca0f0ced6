"""Attention backends: same numbers everywhere, the backend/kernel that ran is observed, documents never leak.

Usage: ``python -m pytest tests/test_attention.py -q``
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from conftest import LlavaDataset, assert_gradients_close, tiny_llava

import vlmfast.attention
from vlmfast.attention import (
    AttentionBackendError,
    PackedDocuments,
    hf_attention_implementations,
    record_attention_calls,
    set_attention_backend,
    trace_attention_kernels,
    use_attention_backend,
)
from vlmfast.models import TinyVLM, TinyVLMConfig, VLMCollator, build_tiny_vlm_task
from vlmfast.spec import TrainSpec
from vlmfast.strategies.attention import AttentionBackend

SMALL = TinyVLMConfig(vision_dim=32, text_dim=32, vision_heads=2, text_heads=2, vision_layers=1, text_layers=2)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _qkv(b=2, h=4, t=12, d=8, kv_heads=None, seed=0, device="cpu", dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    shapes = [(b, h, t, d), (b, kv_heads or h, t, d), (b, kv_heads or h, t, d)]
    return [torch.randn(s, generator=g).to(device, dtype).requires_grad_() for s in shapes]


def _run(backend, qkv, **kwargs):
    q, k, v = qkv
    out = vlmfast.attention(q, k, v, backend=backend, **kwargs)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    return out.detach(), grads


POSITIONS = torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 0, 1, 2, 3], [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 0, 1]])
CASES = {
    "plain": {},
    "causal": {"causal": True},
    "bool_mask": {"attn_mask": torch.rand(12, 12, generator=torch.Generator().manual_seed(1)) > 0.3},
    "float_mask_causal": {"causal": True, "attn_mask": torch.randn(2, 1, 12, 12)},
    "packed_causal": {"causal": True, "position_ids": POSITIONS},
    "packed_bidirectional": {"position_ids": POSITIONS},
    "packed_and_mask": {"causal": True, "position_ids": POSITIONS, "attn_mask": torch.ones(12, 12, dtype=torch.bool)},
}


@pytest.mark.parametrize("case", list(CASES))
def test_eager_and_sdpa_agree_on_outputs_and_gradients(case: str) -> None:
    kwargs = dict(CASES[case])
    if case == "bool_mask":
        kwargs["attn_mask"] = kwargs["attn_mask"] | torch.eye(12, dtype=torch.bool)  # no fully masked row
    qkv = _qkv()
    out_e, grads_e = _run("eager", qkv, **kwargs)
    out_s, grads_s = _run("sdpa", qkv, **kwargs)
    torch.testing.assert_close(out_s, out_e, atol=1e-5, rtol=1e-5)
    for gs, ge in zip(grads_s, grads_e, strict=True):
        torch.testing.assert_close(gs, ge, atol=1e-5, rtol=1e-5)
    if "float" not in case:  # flex takes boolean masks; on CPU it is forward-only
        with torch.no_grad():
            out_f = vlmfast.attention(*qkv, backend="flex", **kwargs)
        torch.testing.assert_close(out_f, out_e, atol=1e-5, rtol=1e-5)


def test_grouped_query_attention_matches_repeated_heads() -> None:
    q, k, v = _qkv(h=4, kv_heads=2)
    expected = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    for backend in ("eager", "sdpa"):
        out = vlmfast.attention(q, k, v, causal=True, enable_gqa=True, backend=backend)
        torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["eager", "sdpa", "flex"])
def test_no_attention_crosses_documents(backend: str) -> None:
    """Changing one document's keys/values must not move any other document's outputs (and does move its own)."""
    q, k, v = (x.detach() for x in _qkv())
    docs = PackedDocuments.from_position_ids(POSITIONS)
    first_doc = docs.ids == docs.ids[:, :1]  # the first document of each row
    k2, v2 = k.clone(), v.clone()
    k2[:, :, :][first_doc[:, None, :].expand_as(k[..., 0])] += 3.0
    v2[first_doc[:, None, :, None].expand_as(v)] -= 2.0
    with torch.no_grad():
        base = vlmfast.attention(q, k, v, causal=True, documents=docs, backend=backend)
        moved = vlmfast.attention(q, k2, v2, causal=True, documents=docs, backend=backend)
        leaky = vlmfast.attention(q, k2, v2, causal=True, backend=backend)  # no documents: the change spreads
    others = ~first_doc[:, None, :, None].expand_as(base)
    torch.testing.assert_close(moved[others], base[others], atol=0, rtol=0)
    assert not torch.allclose(moved[~others], base[~others])
    assert not torch.allclose(leaky[others], base[others])


def test_cu_seqlens_and_position_ids_describe_the_same_documents() -> None:
    q, k, v = (x.detach()[:1] for x in _qkv())
    cu = torch.tensor([0, 5, 8, 12])
    by_cu = vlmfast.attention(q, k, v, causal=True, cu_seqlens=cu)
    by_pos = vlmfast.attention(q, k, v, causal=True, position_ids=POSITIONS[:1])
    torch.testing.assert_close(by_cu, by_pos)
    cu_flat, max_len = PackedDocuments.from_position_ids(POSITIONS).cu_seqlens()
    assert cu_flat.tolist() == [0, 5, 8, 12, 19, 22, 24] and max_len == 7


def test_mrope_position_ids_are_not_mistaken_for_packing() -> None:
    """Qwen-VL 3-D ids restart inside an image (h/w channels): [3, B, T] is no packing; [4, B, T] uses channel 0."""
    t = 12
    text = torch.arange(t).expand(2, t)
    hw = torch.tensor([0, 1, 2, 2, 2, 2, 0, 0, 1, 1, 9, 10]).expand(2, t)  # zeros mid-sequence, as in an image
    mrope = torch.stack([text, hw, hw])
    assert PackedDocuments.from_position_ids(mrope) is None
    q, k, v = (x.detach() for x in _qkv(t=t))
    plain = vlmfast.attention(q, k, v, causal=True)
    torch.testing.assert_close(vlmfast.attention(q, k, v, causal=True, position_ids=mrope), plain)
    with_text = torch.stack([POSITIONS, hw, hw, hw])
    packed = vlmfast.attention(q, k, v, causal=True, position_ids=POSITIONS)
    torch.testing.assert_close(vlmfast.attention(q, k, v, causal=True, position_ids=with_text), packed)


def test_auto_falls_back_with_a_logged_reason(caplog: pytest.LogCaptureFixture,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    from vlmfast.attention import dispatch

    monkeypatch.setattr(dispatch, "_logged_choices", set())  # each choice is logged once per process: not by us
    q, k, v = _qkv(t=16)
    with caplog.at_level(logging.INFO, logger="vlmfast.attention.dispatch"), record_attention_calls() as calls:
        vlmfast.attention(q, k, v, causal=True, backend="auto")
    assert [c.backend for c in calls] == ["sdpa"] and calls[0].requested == "auto"
    assert "not flash_attn: flash-attn runs on CUDA only" in calls[0].reason
    if not torch.cuda.is_available():
        assert any("attention auto: sdpa" in r.message for r in caplog.records)


def test_explicit_backends_that_cannot_run_raise() -> None:
    q, k, v = _qkv()
    with pytest.raises(AttentionBackendError, match=r"flash_attn.*CUDA only"):
        vlmfast.attention(q, k, v, backend="flash_attn")
    with pytest.raises(AttentionBackendError, match="no backward on CPU"):
        vlmfast.attention(q, k, v, backend="flex")
    with pytest.raises(AttentionBackendError, match="boolean masks"), torch.no_grad():
        vlmfast.attention(q, k, v, backend="flex", attn_mask=torch.zeros(12, 12))
    with pytest.raises(ValueError, match="unknown attention backend 'xformers'"):
        vlmfast.attention(q, k, v, backend="xformers")
    model = TinyVLM(SMALL)
    with pytest.raises(AttentionBackendError, match="CUDA only"):
        set_attention_backend(model, "flash_attn")
    with pytest.raises(ValueError, match=r"sdpa_kernels.*needs backend"):
        set_attention_backend(model, "eager", sdpa_kernels=["math"])


def test_sdpa_kernel_restriction_is_what_runs() -> None:
    """The profiler sees torch's CPU flash kernel by default and only the math kernel when restricted to it."""
    q, k, v = _qkv()
    with trace_attention_kernels() as default:
        vlmfast.attention(q, k, v, causal=True)
    with trace_attention_kernels() as restricted:
        vlmfast.attention(q, k, v, causal=True, sdpa_kernels=["math"])
    with trace_attention_kernels() as eager:
        vlmfast.attention(q, k, v, causal=True, backend="eager")
    if not torch.cuda.is_available():
        assert default.kernels == {"sdpa-flash": 1}
    assert restricted.kernels == {"sdpa-math": 1}
    assert not eager.kernels


# ------------------------------------------------------------------------------------------------ tiny VLM


def _tiny_vlm_batch(n: int = 6) -> dict[str, torch.Tensor]:
    _, dataset, _ = build_tiny_vlm_task(seed=0, num_samples=32, config=SMALL)
    return VLMCollator()([dataset[i] for i in range(n)])


def _loss_and_grads(model: torch.nn.Module, batch: dict) -> tuple[torch.Tensor, list[torch.Tensor]]:
    model.zero_grad()
    loss = model(**batch).loss
    loss.backward()
    return loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_tiny_vlm_default_numerics_are_plain_sdpa() -> None:
    torch.manual_seed(0)
    attn = TinyVLM(SMALL).language_model.layers[0].attn
    x = torch.randn(2, 7, 32)
    q, k, v = attn.qkv(x).view(2, 7, 3, 2, 16).permute(2, 0, 3, 1, 4)
    expected = attn.proj(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 7, 32))
    assert torch.equal(attn(x), expected)


def test_tiny_vlm_eager_sdpa_flex_same_loss_and_gradients() -> None:
    batch = _tiny_vlm_batch()
    torch.manual_seed(0)
    model = TinyVLM(SMALL)
    results = {}
    for backend in ("eager", "sdpa"):
        setting = set_attention_backend(model, backend)
        assert setting.backends == {"vision": backend, "language_model": backend}
        with record_attention_calls() as calls:
            results[backend] = _loss_and_grads(model, batch)
        assert {c.backend for c in calls} == {backend} and len(calls) == SMALL.vision_layers + SMALL.text_layers
    loss_e, grads_e = results["eager"]
    loss_s, grads_s = results["sdpa"]
    torch.testing.assert_close(loss_s, loss_e, atol=1e-6, rtol=1e-6)
    assert_gradients_close(grads_s, grads_e, rtol=1e-5)  # norm-relative: right on any CPU
    set_attention_backend(model, "flex")  # CPU: forward only
    with torch.no_grad(), record_attention_calls() as calls:
        loss_f = model(**batch).loss
    assert {c.backend for c in calls} == {"flex"}
    torch.testing.assert_close(loss_f, loss_e, atol=1e-6, rtol=1e-6)


def test_tiny_vlm_towers_can_differ() -> None:
    model = TinyVLM(SMALL)
    setting = set_attention_backend(model, "sdpa", vision_backend="eager", sdpa_kernels=["math"])
    assert setting.backends == {"vision": "eager", "language_model": "sdpa"} and setting.switched_modules == 3
    with record_attention_calls() as calls, trace_attention_kernels() as trace:
        model(**_tiny_vlm_batch(2))
    by_len = {c.shape[2]: c.backend for c in calls}  # vision: 9 patch tokens; text: 9 + caption
    assert by_len.pop(SMALL.num_image_tokens) == "eager" and set(by_len.values()) == {"sdpa"}
    assert trace.kernels == {"sdpa-math": SMALL.text_layers}  # the vision tower ran no SDPA kernel at all


# ------------------------------------------------------------------------------------------------ Hugging Face


def _llava_batch(n: int = 4) -> dict[str, torch.Tensor]:
    data = LlavaDataset(n)
    items = [data[i] for i in range(n)]
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def test_hf_llava_backends_same_loss_and_gradients_and_observed() -> None:
    batch = _llava_batch()
    model = tiny_llava()
    results = {}
    for backend in ("eager", "sdpa"):
        set_attention_backend(model, backend)
        assert set(hf_attention_implementations(model).values()) == {backend}
        with trace_attention_kernels() as trace:
            results[backend] = _loss_and_grads(model, batch)
        sdpa_calls = sum(trace.kernels.values())
        assert sdpa_calls == (0 if backend == "eager" else 4)  # 2 vision + 2 text layers
    torch.testing.assert_close(results["sdpa"][0], results["eager"][0], atol=1e-6, rtol=1e-6)
    assert_gradients_close(results["sdpa"][1], results["eager"][1], rtol=1e-4)
    set_attention_backend(model, "flex")
    assert hf_attention_implementations(model) == {"": "flex", "text_config": "flex", "vision_config": "flex"}
    with torch.no_grad():
        torch.testing.assert_close(model(**batch).loss, results["eager"][0], atol=1e-5, rtol=1e-5)


def test_hf_llava_per_tower_backends_and_auto() -> None:
    model = tiny_llava()
    setting = set_attention_backend(model, "sdpa", vision_backend="eager")
    assert hf_attention_implementations(model) == {"": "sdpa", "text_config": "sdpa", "vision_config": "eager"}
    with trace_attention_kernels() as trace:
        model(**_llava_batch(2))
    assert sum(trace.kernels.values()) == 2  # only the 2 text layers call SDPA
    assert "vision_config=eager" in setting.describe()
    setting = set_attention_backend(model, "auto")
    assert set(hf_attention_implementations(model).values()) == {"sdpa"}
    assert "not flash_attn" in setting.reasons["text_config"] or torch.cuda.is_available()


# ------------------------------------------------------------------------------------------------ spec + strategy


def test_attention_spec_checks() -> None:
    assert TrainSpec().attention.backend is None
    with pytest.raises(ValueError, match=r"sdpa_kernels.*set attention\.backend"):
        TrainSpec(attention={"backend": "eager", "sdpa_kernels": ["math"]})
    with pytest.raises(ValueError, match=r"vision_backend is set but attention\.backend is not"):
        TrainSpec(attention={"vision_backend": "eager"})
    with pytest.raises(ValueError, match="did you mean 'backend'"):
        TrainSpec(attention={"backends": "sdpa"})


def test_strategy_applies_spec_and_restricts_kernels_in_forward_context() -> None:
    model = tiny_llava()
    strategy = AttentionBackend(TrainSpec(attention={"backend": "sdpa", "sdpa_kernels": ["math"]}).attention)
    strategy.apply(model)
    batch = _llava_batch(2)
    with trace_attention_kernels() as trace, strategy.forward_context():
        model(**batch)
    assert set(trace.kernels) == {"sdpa-math"}
    assert "SDPA kernels ['math']" in strategy.describe()
    assert AttentionBackend(TrainSpec().attention).apply(model) is model  # backend null: untouched
    if not torch.cuda.is_available():
        with pytest.raises(AttentionBackendError, match="cannot train on CPU"):
            AttentionBackend(TrainSpec(attention={"backend": "flex"}).attention).apply(TinyVLM(SMALL))


def test_default_backend_context_and_callable_package() -> None:
    q, k, v = _qkv()
    with use_attention_backend("eager"), record_attention_calls() as calls:
        vlmfast.attention(q, k, v)
    assert calls[0].backend == "eager"
    with record_attention_calls() as calls:
        vlmfast.attention.attention(q, k, v)
    assert calls[0].backend == "sdpa"


# ------------------------------------------------------------------------------------------------ GPU


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("backend", ["sdpa", "flex", "flash_attn"])
def test_cuda_backends_match_eager_in_bf16(backend: str) -> None:
    if backend == "flash_attn":
        pytest.importorskip("flash_attn")
    qkv = _qkv(t=256, d=64, device="cuda", dtype=torch.bfloat16)
    for kwargs in ({"causal": True}, {"causal": True, "position_ids": torch.arange(256).remainder(100)[None]}):
        kwargs = {k: (v.expand(2, -1).cuda() if torch.is_tensor(v) else v) for k, v in kwargs.items()}
        out_e, grads_e = _run("eager", qkv, **kwargs)
        out_b, grads_b = _run(backend, qkv, **kwargs)
        torch.testing.assert_close(out_b, out_e, atol=2e-2, rtol=2e-2)
        for gb, ge in zip(grads_b, grads_e, strict=True):
            torch.testing.assert_close(gb, ge, atol=5e-2, rtol=5e-2)


@pytest.mark.gpu
@gpu
def test_cuda_sdpa_flash_kernel_is_observed() -> None:
    q, k, v = _qkv(t=256, d=64, device="cuda", dtype=torch.bfloat16)
    with trace_attention_kernels() as trace:
        vlmfast.attention(q, k, v, causal=True, sdpa_kernels=["flash"])
    assert trace.kernels == {"sdpa-flash": 1}
