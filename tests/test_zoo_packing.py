"""Packing on every zoo architecture: exact (per-document losses and the whole gradient equal the padded batch's),
or refused at trainer construction with an error naming ``packing`` and why, before any training step.

The trainer decides, not this test: the collator refuses what it cannot lay out per document (a batch without token
sequences, per-token cross-attention masks) and a probe at construction packs 4 samples into one row and compares
each document's logits with the padded batch's (vlmfast/data/packing_check.py). The table below only pins which
outcome each family gets today, so a regression either way fails. Public API only, plus the collator's ``pack``.
"""

from __future__ import annotations

import copy
import functools
import itertools
import re

import pytest
import torch
import torch.nn.functional as F

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.data.packing import PackingCollator, disable_kv_cache

transformers = pytest.importorskip("transformers")
from zoo import ZOO, build_case  # noqa: E402

transformers.logging.set_verbosity_error()

TOLERANCE = 1e-5
N = 6  # samples per step: 1, 0, 2, 1, 2, 0 images
REFUSED = {  # family -> what the refusal must say: refused by its batch layout, on any release
    "mllama": r"packing cannot lay out batch key 'cross_attention_mask'.*cross-attention",
    "cnn": r"packing needs token sequences.*a list",
    # InstructBLIP's Q-Former prompt is one per sample: a packed row of several samples has no place for them
    "instructblip": r"packing cannot lay out batch key 'qformer_input_ids'.*a per-sample value has no layout rule",
    # An encoder-decoder's labels are the decoder's tokens, not the encoder row's: no place for them in a packed row
    "florence2": r"packing cannot lay out batch key 'labels' \(one sample: \(1, \d+\)\): a per-sample value has no "
                 r"layout rule",
    # Measured by the probe at construction: Kosmos-2's vision model takes [images, C, H, W], not a row's [1, n, C,
    # H, W]; with image_layout flat it runs but is not exact (logits 1.3 off: its text model's positions and
    # attention span the whole row)
    "kosmos2": r"packing: Kosmos2ForConditionalGeneration fails on packed rows \(ValueError: too many values to "
               r"unpack.*pixel_values \(1, \d+, 3, 16, 16\)",
}
# Any other family is packed when the probe measures packing exact and refused, with this reason, when it does not:
# which of the two a model gets may change between releases of transformers (PaliGemma's token_type_ids mask did).
MEASURED_REFUSAL = r"packing is not exact for \w+"


pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny models, one intra-op thread


def spec(**packing: object) -> TrainSpec:
    """One SGD step (lr 1: the update is minus the gradient) on N samples, fp32, 2 packed rows per micro-batch."""
    return TrainSpec(max_steps=1, batch_size=N, micro_batch_size=2, device="cpu", data={"shuffle": False},
                     optimizer={"name": "sgd", "lr": 1.0}, log={"progress": "off"}, memory={"leak_check": False},
                     packing={"enabled": True, **packing})


@functools.cache
def padded_gradient_of(name):
    """The padded batch's gradient of the family's first N samples (read only by the tests, so computed once)."""
    return padded_gradient(cached_case(name), cached_case(name).samples[:N])


def padded_gradient(case, samples):
    model = copy.deepcopy(case.model)
    batch = case.collate_fn(samples)
    (case.loss_fn(model, batch) if case.loss_fn else model(**batch).loss).backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def per_document_losses(logits, labels, documents):
    """Mean shifted cross-entropy of each document: ``documents`` = (row, start, length) per sample."""
    ce = F.cross_entropy(logits[:, :-1].transpose(1, 2).float(), labels[:, 1:], reduction="none")
    valid = labels[:, 1:] != -100
    out = []
    for row, start, length in documents:  # targets of a document: its positions 1..length-1 (shifted: start..)
        here = slice(start, start + length - 1)
        out.append(ce[row, here][valid[row, here]].sum() / valid[row, here].sum())
    return torch.stack(out)


@functools.cache
def cached_case(name):
    """Each family built once for this module's tests (they train deep copies, never the case's model)."""
    return build_case(name)


@pytest.mark.parametrize("name", ZOO)
def test_packing_equals_padding_or_is_refused_before_any_work(name):
    case = cached_case(name)
    samples = case.samples[:N]
    model = copy.deepcopy(case.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    padded = None if name in REFUSED else case.collate_fn(samples)
    lengths = [] if padded is None else sorted(padded["attention_mask"].sum(1).tolist())
    # rows of 5/4 of the longest sample, and at least the two shortest together (samples of similar length)
    max_tokens = 512 if padded is None else max(lengths[-1] * 5 // 4, lengths[0] + lengths[1])
    forwards = []
    hook = model.register_forward_pre_hook(lambda module, args: forwards.append(module.training))
    try:
        trainer = OptimizedTrainer(model, samples, spec(max_tokens=max_tokens), loss_fn=case.loss_fn,
                                   collate_fn=case.collate_fn)
    except ValueError as refused:  # refused with the reason, before any work
        assert re.search(REFUSED.get(name, MEASURED_REFUSAL), str(refused)), str(refused)
        assert not any(forwards)  # at most the probe's eval-mode forwards: nothing trained
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        assert all(p.grad is None for p in model.parameters())
        return
    finally:
        hook.remove()
    assert name not in REFUSED, f"{name}'s batch layout cannot be packed, yet packing was accepted"

    collate = trainer.collate_fn
    assert isinstance(collate, PackingCollator)
    packed = collate.pack(samples)
    assert 2 < len(packed.rows) < N  # rows hold several documents (packing happened), split into micro-batches
    assert sum(len(r) for r in packed.rows) == N

    # Per-document losses of the packed batch (on the untouched weights) equal each padded sample's.
    reference_model = copy.deepcopy(case.model).eval()
    disable_kv_cache(reference_model)  # as the trainer does: with a KV cache HF models ignore packed positions
    with torch.no_grad():
        lengths = padded["attention_mask"].sum(1).tolist()
        where = {}
        for r, row in enumerate(packed.rows):
            start = 0
            for i in row:
                where[i] = (r, start, lengths[i])
                start += lengths[i]
        packed_losses = per_document_losses(reference_model(**packed.tensors).logits, packed.tensors["labels"],
                                            [where[i] for i in range(N)])
        first = padded["attention_mask"].int().argmax(1).tolist()  # 0, or where a left-padded row starts
        padded_losses = per_document_losses(reference_model(**padded).logits, padded["labels"],
                                            [(i, first[i], lengths[i]) for i in range(N)])
    torch.testing.assert_close(packed_losses, padded_losses, rtol=TOLERANCE, atol=TOLERANCE)

    # One SGD step with packing (rows split into micro-batches of 2): the update is minus the padded gradient.
    result = trainer.fit()
    assert result.history[0]["accumulation_steps"] == -(-len(packed.rows) // 2)
    reference = padded_gradient_of(name)
    names = sorted(reference)
    update = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    diff = torch.cat([(update[n] + reference[n]).flatten() for n in names]).double().norm()
    scale = torch.cat([reference[n].flatten() for n in names]).double().norm()
    assert diff <= TOLERANCE * scale, f"packed update off by {float(diff / scale):.2e} of its norm"


def test_the_probe_catches_wrong_positions():
    """Control: Qwen2-VL packed without its own mRoPE position ids (the model then numbers the whole row as one
    sequence, so documents see each other) is refused by the same probe that passes it with them."""
    from vlmfast.data.packing import build_packing_collator
    from vlmfast.data.packing_check import check_packing
    from vlmfast.spec import PackingSpec

    case = build_case("qwen2_vl")
    collate = build_packing_collator(PackingSpec(enabled=True), case.model, case.collate_fn)
    assert collate.position_ids_fn is not None  # found on the model (get_rope_index), not by class name
    assert check_packing(case.model, case.samples[:4], collate) < 1e-5
    with pytest.raises(ValueError, match="packing is not exact"):
        check_packing(case.model, case.samples[:4], PackingCollator(**{**collate.__dict__, "position_ids_fn": None}))


@pytest.mark.parametrize("name", ["paligemma", "llava", "mllama", "gemma3"])
def test_the_doctor_offers_packing_only_to_models_that_pack(name):
    """`vlmfast doctor` checks its advice: a padding-heavy model packing refuses (Mllama, by its layout; PaliGemma
    where the probe measures it inexact) is told to group by length, one that packs exactly is told to pack."""
    from vlmfast.profiling.doctor import Evidence, diagnose, packing_offer

    case = cached_case(name)
    plain = spec().model_copy(update={"packing": spec().packing.model_copy(update={"enabled": False})})
    trainer = OptimizedTrainer(copy.deepcopy(case.model), case.samples[:N], plain, collate_fn=case.collate_fn)
    refusal, level = packing_offer(trainer)
    if name == "gemma3":  # id-level packing is measured inexact; packing by embeddings is offered, measured exact
        assert refusal is None and level == "embeddings"
    if name in REFUSED:
        assert refusal is not None and re.search(REFUSED[name], refusal), refusal
    elif refusal is not None:
        assert re.search(MEASURED_REFUSAL, refusal), refusal
    evidence = Evidence([{"perf/step_time": 1.0, "perf/forward": 0.4, "perf/backward": 0.5}], plain,
                        padding_fraction=0.5, packing_refused=refusal, packing_level=level)
    padding = next(f for f in diagnose(evidence) if f.key == "padding")
    if refusal:
        assert padding.change == {"data.group_by_length": "length"} and "packing is refused" in padding.advice
    else:
        assert padding.change == {"packing.enabled": True, **({"packing.level": level} if level != "ids" else {})}


def test_a_layout_the_model_cannot_take_is_refused_naming_packing():
    """LLaVA takes its images flat; an explicit image_layout: per_row breaks its forward: refused at construction."""
    case = build_case("llava")
    with pytest.raises(ValueError, match=r"packing: LlavaForConditionalGeneration fails on packed rows.*image_layout"):
        OptimizedTrainer(copy.deepcopy(case.model), case.samples[:N], spec(image_layout="per_row"),
                         collate_fn=case.collate_fn)


# Packing by embeddings: refused where no language model receives merged embeddings, or where measured not exact.
REFUSED_BY_EMBEDDINGS = {
    "cnn": r"needs batches with token sequences",
    # measured: Mllama's images are cross-attention states over the whole row, Kosmos-2's image features have no
    # per-document layout (its text model places them itself)
    "mllama": r"embeddings: not exact for MllamaForConditionalGeneration",
    "kosmos2": r"embeddings: not exact for Kosmos2ForConditionalGeneration.*'image_embeds'",
    "florence2": r"Florence2ForConditionalGeneration is an encoder-decoder: its head reads the decoder",
}


def update_error(model, before, reference):
    names = sorted(reference)
    update = {n: p.detach() - before[n] for n, p in model.named_parameters()}
    diff = torch.cat([(update[n] + reference[n]).flatten() for n in names]).double().norm()
    return float(diff / torch.cat([reference[n].flatten() for n in names]).double().norm())


@pytest.mark.parametrize("name", ZOO)
def test_packing_by_embeddings_equals_padding_or_is_refused_before_any_work(name):
    """``packing.level: embeddings``: one SGD step over micro-batches of 2 samples, each packed where its language
    model receives its embeddings, gives minus the padded gradient; or the trainer refuses before any step."""
    case = cached_case(name)
    samples = case.samples[:N]
    model = copy.deepcopy(case.model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    try:
        trainer = OptimizedTrainer(model, samples, spec(max_tokens=4096, level="embeddings"), loss_fn=case.loss_fn,
                                   collate_fn=case.collate_fn)
    except ValueError as refused:
        assert name in REFUSED_BY_EMBEDDINGS, f"{name}: {refused}"
        assert re.search(REFUSED_BY_EMBEDDINGS[name], str(refused)), str(refused)
        assert "packing.level: embeddings" in str(refused)
        assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
        return
    assert name not in REFUSED_BY_EMBEDDINGS, f"{name} was expected to be refused"
    packing = next(s for s in trainer.strategies if s.name == "packing").packing
    calls, rows, padded_rows = packing.calls, packing.rows, packing.padded_rows
    trainer.fit()
    assert packing.calls - calls >= N // 2  # every micro-batch (and the probes) ran packed
    assert packing.rows - rows < packing.padded_rows - padded_rows  # on fewer rows than padded: packing happened
    error = update_error(model, before, padded_gradient_of(name))
    assert error <= TOLERANCE, f"update by embeddings packing off by {error:.2e} of its norm"


@pytest.mark.parametrize(("name", "level"),
                         [("llava", "ids"), ("instructblip", "embeddings"), ("gemma3", "embeddings")])
def test_packing_level_auto_packs_ids_where_exact_else_embeddings(name, level):
    """``packing.level: auto``: the loader packs ids where measured exact (LLaVA); InstructBLIP's per-sample
    Q-Former prompt and Gemma3's bidirectional image attention refuse id-level packing, so embeddings are packed."""
    case = cached_case(name)
    trainer = OptimizedTrainer(copy.deepcopy(case.model), case.samples[:N], spec(max_tokens=4096, level="auto"),
                               collate_fn=case.collate_fn)
    assert trainer.spec.packing.level == level
    assert isinstance(trainer.collate_fn, PackingCollator) == (level == "ids")
    assert any(s.name == "packing" for s in trainer.strategies) == (level == "embeddings")
    said = trainer.fit().report.to_text()  # the run report says which level, and why
    assert f"packing.level auto: {level}" in said
    assert ("id-level packing refused: packing" in said) == (level == "embeddings"), said


def _flash_stand_in(module, query, key, value, attention_mask, scaling=None, cu_seq_lens_q=None, **kwargs):
    """What a flash kernel computes, on the CPU: causal attention per row (the padding after a row's tokens never
    reaches them), or per segment of the flattened rows when given their boundaries (flash varlen)."""
    b, h, t, d = query.shape
    key, value = (x.repeat_interleave(h // x.shape[1], dim=1) for x in (key, value))
    if cu_seq_lens_q is None:
        return F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling).transpose(1, 2), None
    q, k, v = (x.transpose(1, 2).reshape(b * t, h, d) for x in (query, key, value))
    bounds = cu_seq_lens_q.tolist()
    parts = [F.scaled_dot_product_attention(*(x[s:e].transpose(0, 1)[None] for x in (q, k, v)), is_causal=True,
                                            scale=scaling)[0].transpose(0, 1) for s, e in itertools.pairwise(bounds)]
    return torch.cat(parts).view(b, t, h, d), None


def test_a_flash_kernel_keeps_packed_documents_apart_only_with_their_boundaries():
    """Hugging Face's flash path reads packed documents from positions on a batch of one row only. With a CPU stand-in
    for the kernel: id-level packing is refused by the probe's two-row pass (it would leak in training), packing by
    embeddings hands the kernel the documents' boundaries and is exact."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    AttentionInterface.register("flash_attention_cpu_stand_in", _flash_stand_in)
    AttentionMaskInterface.register("flash_attention_cpu_stand_in", flash_attention_mask)
    model = copy.deepcopy(cached_case("llava").model)
    model.set_attn_implementation({"text_config": "flash_attention_cpu_stand_in"})
    case = cached_case("llava")
    with pytest.raises(ValueError, match=r"packing is not exact.*packed into one row and into two.*flash"):
        OptimizedTrainer(copy.deepcopy(model), case.samples[:N], spec(max_tokens=4096), collate_fn=case.collate_fn)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    whole_batch = spec(max_tokens=40, level="embeddings").model_dump()
    whole_batch["micro_batch_size"] = N  # one micro-batch of N samples: several rows of several documents
    trainer = OptimizedTrainer(model, case.samples[:N], TrainSpec.model_validate(whole_batch),
                               collate_fn=case.collate_fn)
    trainer.fit()
    packing = next(s for s in trainer.strategies if s.name == "packing").packing
    assert packing.rows < packing.padded_rows and packing.rows > packing.calls  # several rows of several documents
    error = update_error(model, before, padded_gradient_of("llava"))
    assert error <= TOLERANCE, f"off by {error:.2e}"
