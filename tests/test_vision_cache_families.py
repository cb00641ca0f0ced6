"""The vision cache at the frozen boundary on the families whose image path is not a tower + projector pair:
BLIP-2 (a Q-Former between tower and projection, frozen or trained), Qwen2.5-Omni's thinker (an audio tower held next
to the vision tower), Phi-4-multimodal (image and audio embedding in one module, only the image half frozen) and
Chameleon (a VQ-VAE whose quantizer, not the text layers, runs after the tower).

Each: two epochs (2 SGD steps of the zoo case's 8 samples, fp32) with and without the cache; epoch 2 all hits, and
the weights move the same (within 1e-5 of the update's norm). What is frozen is learned from the model (the probed
tower, autograd on the image call), never from attribute names. Each model is built once for the module.
"""

from __future__ import annotations

import copy

import pytest
import torch

from vlmfast import OptimizedTrainer, TrainSpec

transformers = pytest.importorskip("transformers")
from zoo import build_case  # noqa: E402

from vlmfast.common.image_path import find_image_modules  # noqa: E402

transformers.logging.set_verbosity_error()


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models, one intra-op thread


@pytest.fixture(scope="module")
def cases():
    built: dict[str, object] = {}

    def get(name: str):
        if name not in built:
            built[name] = build_case(name)
        return built[name]
    return get


def _fit(case, frozen: list[str], cache_dir):
    """Two steps with the parameters named in `frozen` frozen; (update of the trainable ones, history, cache)."""
    model = copy.deepcopy(case.model)
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    spec = TrainSpec(max_steps=2, batch_size=8, micro_batch_size=8, device="cpu", log={"progress": "off"},
                     optimizer={"name": "sgd", "lr": 0.01}, memory={"leak_check": False},
                     vision_cache={"enabled": cache_dir is not None, "dir": str(cache_dir)})
    trainer = OptimizedTrainer(model, case.samples, spec, loss_fn=case.loss_fn, collate_fn=case.collate_fn)
    result = trainer.fit()
    moved = {n: p.detach() - before[n] for n, p in model.named_parameters() if n in before}
    cache = next((s.cache for s in trainer.strategies if s.name == "vision_cache"), None)
    return moved, result.history, cache


def _cached_like_plain(case, frozen: list[str], tmp_path):
    """The cached run's cache, after checking it hit in epoch 2 and moved the weights as the plain run did."""
    plain, _, _ = _fit(case, frozen, None)
    cached, history, cache = _fit(case, frozen, tmp_path)
    assert cache.disabled is None, cache.disabled
    assert history[1]["vision_cache/hits"] > 0 and history[1]["vision_cache/misses"] == 0, history
    names = sorted(plain)
    diff = torch.cat([(cached[n] - plain[n]).flatten() for n in names]).double().norm()
    scale = torch.cat([plain[n].flatten() for n in names]).double().norm()
    assert scale > 0 and diff <= 1e-5 * scale, f"update off by {float(diff / scale):.2e} of its norm"
    return cache


def _under(model, *paths: str) -> list[str]:
    return [n for n, _ in model.named_parameters() if n.startswith(tuple(f"{p}." for p in paths))]


def _used_by_image_call(case) -> list[str]:
    """The parameters the image call uses (autograd on it; BLIP-2's query_tokens belong to no module)."""
    model = copy.deepcopy(case.model)
    batch = case.collate_fn(case.samples[:2])
    owner = next(m for _, m in model.named_modules() if hasattr(m, "get_image_features"))
    out = owner.get_image_features(batch["pixel_values"]).pooler_output
    named = [(n, p) for n, p in model.named_parameters()]
    grads = torch.autograd.grad(out.sum(), [p for _, p in named], allow_unused=True)
    return [n for (n, _), g in zip(named, grads, strict=True) if g is not None]


def test_blip2_whole_frozen_image_path_is_cached_as_one_call(cases, tmp_path):
    """Tower, Q-Former, query tokens and projection frozen: the whole get_image_features is served (in its own
    output class: the forward reads its qformer_outputs)."""
    case = cases("blip2")
    frozen = _used_by_image_call(case)
    assert any("qformer" in n for n in frozen) and "query_tokens" in frozen  # a check on the probe, not a rule
    cache = _cached_like_plain(case, frozen, tmp_path)
    assert cache.unit.name == "get_image_features"


def test_blip2_with_a_trainable_qformer_caches_the_tower_alone(cases, tmp_path):
    """The Q-Former trains: the tower's output is cached, the Q-Former and projection run every step on it."""
    case = cases("blip2")
    found = find_image_modules(case.model)
    cache = _cached_like_plain(case, _under(case.model, found.tower), tmp_path)
    assert cache.unit.name == f"{found.tower}.forward"


def test_qwen2_5_omni_thinker_caches_its_image_call_while_its_audio_tower_trains(cases, tmp_path):
    """The thinker holds an audio tower next to the vision tower; it trains, but the image call never runs it:
    the whole image call is cached (before: the cache stood in for the tower's hidden_states + grid_thw forward,
    which no layout cuts, and served nothing without saying so)."""
    case = cases("qwen2_5_omni")
    found = find_image_modules(case.model)
    frozen = _under(case.model, found.tower)
    assert any(p.requires_grad for n, p in case.model.named_parameters() if n not in frozen and "audio" in n)
    cache = _cached_like_plain(case, frozen, tmp_path)
    assert cache.unit.name == "get_image_features" and list(cache.unit.modules) == [found.tower]


def test_phi4_multimodal_caches_the_image_half_of_its_shared_embedding(cases, tmp_path):
    """The module that embeds images and audio into the text embeddings trains its audio half; its image half
    (the probed tower's parent) is frozen: the tower the images flow into alone is cached, not the shared module."""
    case = cases("phi4_multimodal")
    found = find_image_modules(case.model, batches=[case.collate_fn(case.samples)])
    half = found.tower.rsplit(".", 1)[0]
    shared = half.rsplit(".", 1)[0]
    assert found.learned == "probe forward" and shared  # the images reach the tower through the shared module
    frozen = _under(case.model, half)
    assert any(n not in frozen for n in _under(case.model, shared))  # the other half trains
    cache = _cached_like_plain(case, frozen, tmp_path)
    assert cache.unit.name == f"{found.tower}.forward"


def test_chameleon_projector_is_what_its_image_call_runs_after_the_tower(cases):
    """Chameleon's image call runs the VQ encoder, then its quant conv and quantizer, then the text embeddings:
    those two are the projector (before: its decoder layers and norm, the owner's other children)."""
    case = cases("chameleon")
    found = find_image_modules(case.model)
    layers = {n for n, m in case.model.named_modules() if isinstance(m, torch.nn.ModuleList)}
    assert found.seen and found.projectors and not set(found.projectors) & layers
    assert all(p.rsplit(".", 1)[0] == found.tower.rsplit(".", 1)[0] for p in found.projectors)
