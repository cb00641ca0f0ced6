"""Modality sync on the zoo's VLMs: the image path it learns, and a text-only forward that stands in for it touches
exactly the parameters an image forward touches (so DDP, ZeRO and FSDP2 see the same graph on every rank).

The 2-rank runs (every engine, images on one rank only) are in test_rank_symmetry.py.
"""

from __future__ import annotations

import pytest
import torch

from vlmfast.strategies.modality_sync import ModalitySync, learn_image_path

# The zoo VLMs whose processors make text-only samples (PaliGemma's takes none; Mllama's collate pads image slots, so
# its batches always carry images)
TEXT_AND_IMAGES = ("llava", "llava_next", "qwen2_vl", "qwen2_5_vl", "idefics3")


def case_samples(name: str):
    from zoo.cases import build_case

    case = build_case(name)
    with_images = [s for s in case.samples if s["images"]]
    text_only = [s for s in case.samples if not s["images"]]
    return case, with_images, text_only


def gradients(model: torch.nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    """The gradient of every parameter that gets one from `batch`'s loss."""
    model.zero_grad(set_to_none=True)
    model(**batch).loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_the_image_path_is_learned_from_one_forward():
    case, with_images, _ = case_samples("llava")
    path = learn_image_path(case.model, [case.collate_fn(with_images[:1])])
    assert path is not None
    assert (path.owner, path.entry, path.trigger, path.image_key) == (
        "model", "model.vision_tower", ("model.language_model", 0), "pixel_values")
    assert path.args == () and path.kwargs["pixel_values"].device.type == "cpu"


def test_text_batches_learn_nothing():
    case, _, text_only = case_samples("llava")
    assert learn_image_path(case.model, [case.collate_fn(text_only[:1])]) is None


@pytest.mark.parametrize("name", TEXT_AND_IMAGES)
def test_a_stand_in_touches_exactly_the_parameters_of_an_image_forward(name):
    """LLaVA reads the tower's hidden_states[-2]: its last layer and post_layernorm stay unused with images, and must
    stay unused in the stand-in too (a zero-sum over the tower's whole output would touch them)."""
    case, with_images, text_only = case_samples(name)
    model, batch = case.model, case.collate_fn(text_only[:2])
    with_image_path = set(gradients(model, case.collate_fn(with_images[:2])))
    plain = gradients(model, batch)
    assert set(plain) < with_image_path  # the text forward skips the image path

    sync = ModalitySync(lambda: [case.collate_fn(with_images[:1])], always=True)
    model = sync.apply(model)
    stood_in = gradients(model, batch)
    assert sync.stand_ins == 1
    assert set(stood_in) == with_image_path
    for name, grad in stood_in.items():  # weight 0: the text path's gradient is unchanged, the image path's is zero
        torch.testing.assert_close(grad, plain.get(name, torch.zeros_like(grad)), rtol=0, atol=0)
