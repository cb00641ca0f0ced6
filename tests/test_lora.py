"""LoRA (the ``lora`` section, PEFT): the step equals a hand-written PEFT full-batch step, with any strategy on top.

Per family (tiny Qwen2-VL, LLaVA, Idefics3 from tests/zoo, inputs from their real processors): the trainer's LoRA
model is copied before training, one SGD step on the whole batch is taken by hand on the copy (PEFT's forward, the
model's own loss), and the trainer's step must give the same update within 1e-5 of its norm; only the adapters (and
``modules_to_save``) move.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from vlmfast import OptimizedTrainer, SpecError, TrainSpec

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
from zoo import build_case  # noqa: E402

transformers.logging.set_verbosity_error()
TOLERANCE = 1e-5


pytestmark = pytest.mark.usefixtures("one_thread")


def spec(**extra) -> TrainSpec:
    base = {"max_steps": 1, "batch_size": 8, "micro_batch_size": 8, "device": "cpu", "log": {"progress": "off"},
            "optimizer": {"name": "sgd", "lr": 0.1}, "memory": {"leak_check": False},
            "lora": {"enabled": True, "r": 8, "alpha": 16}}
    for key, value in extra.items():
        base[key] = {**base[key], **value} if isinstance(base.get(key), dict) else value
    return TrainSpec(**base)


def hand_written_step(model, case) -> dict[str, torch.Tensor]:
    """One SGD step (lr 0.1) of `model` (a copy of the trainer's PEFT model) on the whole batch: the update."""
    model = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    batch = case.collate_fn(case.samples)
    model(**batch).loss.backward()
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad and p.grad is not None:
                p -= 0.1 * p.grad
    return {n: p.detach() - before[n] for n, p in model.named_parameters()}


def lora_step(case, trainer_spec: TrainSpec, oom_above: int | None = None):
    """The trainer's update, and the hand-written one from the same initial LoRA model (a plain LoRA trainer's: a
    strategy may replace the forward, e.g. the chunked loss, which a copy of the model would not carry over)."""
    plain = OptimizedTrainer(copy.deepcopy(case.model), case.samples, spec(lora=trainer_spec.lora.model_dump()),
                             collate_fn=case.collate_fn).engine.module
    reference = hand_written_step(plain, case)
    trainer = OptimizedTrainer(copy.deepcopy(case.model), case.samples, trainer_spec, collate_fn=case.collate_fn)
    model = trainer.engine.module
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    assert all(torch.equal(start[n], p) for n, p in plain.named_parameters())  # the same adapters to start from
    if oom_above is None:
        result = trainer.fit()
    else:
        from vlmfast.testing import simulated_oom

        with simulated_oom(oom_above):  # more samples per micro-batch run out of memory
            result = trainer.fit()
    update = {n: p.detach() - start[n] for n, p in model.named_parameters()}
    return update, reference, trainer, result


def assert_same_update(update, reference) -> None:
    names = sorted(reference)
    diff = torch.cat([(update[n] - reference[n]).flatten() for n in names]).double().norm()
    scale = torch.cat([reference[n].flatten() for n in names]).double().norm()
    assert scale > 0 and diff <= TOLERANCE * scale, f"update off by {float(diff / scale):.2e} of its norm"


@pytest.fixture(scope="module", params=["qwen2_vl", "llava", "idefics3"])
def case(request):
    return build_case(request.param)


def test_the_lora_step_equals_a_hand_written_peft_step(case):
    update, reference, trainer, result = lora_step(case, spec(lora={"modules_to_save": ["multi_modal_projector"]}
                                                               if case.name != "qwen2_vl" else {}))
    assert_same_update(update, reference)
    model = trainer.engine.module
    assert peft.PeftModel in type(model).__mro__
    moved = {n for n, u in update.items() if u.abs().max() > 0}
    assert moved and all("lora_" in n or "modules_to_save" in n for n in moved)  # the base never moves
    adapted = {n.split(".lora_")[0] for n, _ in model.named_parameters() if ".lora_A." in n}
    tower = [n for n in adapted if "vision" in n or "visual" in n]
    assert adapted and not tower  # language model only, by default
    assert "lora: r 8, alpha 16" in result.report.to_text()


@pytest.mark.parametrize("strategy", [
    {"micro_batch_size": 3},
    {"micro_batch_size": 8, "micro_batch_tokens": 64},
    {"activation_checkpointing": {"enabled": True}},
    {"linear_cross_entropy": {"enabled": True}},
    {"oom": {"enabled": True}},
    {"packing": {"enabled": True, "max_tokens": 64}},
    {"vision_cache": {"enabled": True}},
], ids=["micro-batches", "token-budget", "checkpointing", "chunked-ce", "oom-fallback", "packing", "vision-cache"])
def test_each_strategy_on_top_gives_the_plain_lora_step(strategy, tmp_path):
    case = build_case("llava")
    if "vision_cache" in strategy:  # LoRA leaves the tower frozen (no adapters there): the cache may serve it
        strategy = {"vision_cache": {"enabled": True, "dir": str(tmp_path)}}
    oom = 3 if "oom" in strategy else None  # 8 -> 4 -> 2 samples per micro-batch
    update, reference, trainer, _ = lora_step(case, spec(**strategy), oom_above=oom)
    assert oom is None or trainer.state.micro_batch_size == 2
    assert_same_update(update, reference)
    if "vision_cache" in strategy:
        cache = next(s for s in trainer.strategies if s.name == "vision_cache").cache
        assert cache.disabled is None or "uses trainable parameters" not in cache.disabled, cache.disabled


def test_bf16_trains_the_adapters():
    case = build_case("llava")
    update, _, _, result = lora_step(case, spec(precision="bf16"))
    assert torch.isfinite(torch.tensor(result.history[0]["loss"]))
    assert any(u.abs().max() > 0 for n, u in update.items() if "lora_" in n)


def test_a_model_the_user_wrapped_with_peft_is_used_as_it_is():
    case = build_case("llava")
    torch.manual_seed(0)
    wrapped = peft.get_peft_model(copy.deepcopy(case.model), peft.LoraConfig(r=4, target_modules=["q_proj"]))
    trainer = OptimizedTrainer(wrapped, case.samples, spec(), collate_fn=case.collate_fn)
    assert trainer.engine.module is wrapped
    assert "the user's PEFT model (r 4, alpha 8, scale alpha / r = 2)" in trainer.fit().report.to_text()


def test_the_report_shows_r_alpha_and_the_scale_they_make():
    """lora.alpha defaults to 16 where PEFT's lora_alpha defaults to 8: the report says which scale a run used."""
    case = build_case("llava")
    for lora, shown in (({"r": 8, "alpha": 16}, "lora: r 8, alpha 16, scale alpha / r = 2, all-linear on language"),
                        ({"r": 4, "alpha": 8}, "lora: r 4, alpha 8, scale alpha / r = 2, all-linear on language"),
                        ({"r": 16, "alpha": 8}, "lora: r 16, alpha 8, scale alpha / r = 0.5, ")):
        trainer = OptimizedTrainer(copy.deepcopy(case.model), case.samples, spec(lora=lora), collate_fn=case.collate_fn)
        assert shown in trainer.fit().report.to_text()
    assert TrainSpec(lora={"enabled": True}).lora.alpha == 16  # kept (existing runs' scale), documented
    assert "differs from PEFT's 8" in type(TrainSpec().lora).model_fields["alpha"].description


def test_without_peft_the_error_names_the_extra(monkeypatch):
    import builtins

    real_import = builtins.__import__

    def no_peft(name, *args, **kwargs):
        if name == "peft" or name.startswith("peft."):
            raise ImportError("No module named 'peft'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_peft)
    with pytest.raises(ImportError, match=r"lora.enabled needs peft: pip install 'vlmfast\[lora\]'"):
        OptimizedTrainer(copy.deepcopy(build_case("llava").model), [], spec())


# ---- checkpoints: the adapters only, on a fingerprinted base ------------------------------------------------------
def _llava_5m(seed: int = 0):
    """A LLaVA of ~5.6M parameters (a 6-layer Llama of width 320): big enough for checkpoint sizes to mean something."""
    from conftest import tiny_llava

    return tiny_llava(seed, text_hidden=320, text_layers=6, vision_layers=1)


def _run(tmp_path, name, steps, lora=True, model=None, resume="auto"):
    from conftest import LlavaDataset

    extra = {"max_steps": steps, "batch_size": 4, "micro_batch_size": 4, "optimizer": {"name": "adamw", "lr": 1e-3},
             "save": {"dir": str(tmp_path / name), "every_steps": 2, "resume": resume}}
    trainer_spec = spec(**extra) if lora else spec(**extra, lora={"enabled": False})
    trainer = OptimizedTrainer(model if model is not None else _llava_5m(), LlavaDataset(16), trainer_spec)
    return trainer, trainer.fit()


def _folder_bytes(path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def test_a_lora_checkpoint_holds_the_adapters_resumes_exactly_and_refuses_another_base(tmp_path):
    base = _llava_5m()
    assert sum(p.numel() for p in base.parameters()) >= 5_000_000
    _run(tmp_path, "full", 2, lora=False)
    lora, _ = _run(tmp_path, "lora", 4)
    full_bytes = _folder_bytes(tmp_path / "full" / "step_00000002")
    lora_bytes = _folder_bytes(tmp_path / "lora" / "step_00000002")
    assert lora_bytes <= 0.10 * full_bytes, (lora_bytes, full_bytes)

    import shutil  # resume from step 2 of the same run: the same adapters as the uninterrupted run's step 4
    shutil.rmtree(tmp_path / "lora" / "step_00000004")
    resumed, result = _run(tmp_path, "lora", 4)
    assert result.resumed_from is not None and result.resumed_from.name == "step_00000002"
    ours, theirs = dict(resumed.engine.module.named_parameters()), dict(lora.engine.module.named_parameters())
    assert all(torch.equal(ours[n], p) for n, p in theirs.items() if p.requires_grad)

    changed = _llava_5m()
    with torch.no_grad():
        changed.model.language_model.layers[3].mlp.up_proj.weight[0, 0] += 1e-3  # one frozen element
    shutil.rmtree(tmp_path / "lora" / "step_00000004")
    with pytest.raises(SpecError, match=r"frozen base weights differ from the checkpoint's \(fingerprint"):
        _run(tmp_path, "lora", 4, model=changed)


# ---- compile: the adapted model compiles and trains -----------------------------------------------------------------
def test_a_compiled_lora_model_trains_the_adapters_and_leaves_the_base():
    from vlmfast.models import build_tiny_vlm_task

    torch._dynamo.reset()  # no earlier test's cache entries towards the recompile limit
    model, data, collate = build_tiny_vlm_task(seed=0, num_samples=16)
    trainer = OptimizedTrainer(model, data, spec(max_steps=2, batch_size=4, micro_batch_size=4,
                                                 compile={"enabled": True, "backend": "aot_eager"}),
                               collate_fn=collate)
    start = {n: p.detach().clone() for n, p in trainer.engine.module.named_parameters()}
    result = trainer.fit()
    compiled = next(s for s in trainer.strategies if s.name == "compile").result
    assert compiled.compiled and compiled.graphs >= 1 and compiled.fallbacks == {}  # really compiled, no eager
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in result.history)
    after = dict(trainer.engine.module.named_parameters())
    moved = {n for n, p in after.items() if not torch.equal(p, start[n])}
    assert moved == {n for n, p in after.items() if p.requires_grad} and any("lora_A" in n for n in moved)
    torch._dynamo.reset()


# ---- export: folders the Hugging Face ecosystem loads --------------------------------------------------------------
def _logits(model, batch) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**{k: v for k, v in batch.items() if k != "labels"}).logits


def test_the_adapter_folder_the_merged_folder_and_a_plain_model_load_back_with_the_trained_logits(tmp_path):
    case = build_case("llava")
    batch = case.collate_fn(case.samples)
    trainer = OptimizedTrainer(copy.deepcopy(case.model), case.samples,
                               spec(max_steps=2, lora={"modules_to_save": ["multi_modal_projector"]},
                                    linear_cross_entropy={"enabled": True}),  # a replaced forward is not exported
                               collate_fn=case.collate_fn)
    trainer.fit()
    trained = _logits(trainer.engine.module, batch)

    adapter = trainer.export(tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in adapter.iterdir()}
    loaded = peft.PeftModel.from_pretrained(copy.deepcopy(case.model), str(adapter))  # a fresh base
    torch.testing.assert_close(_logits(loaded, batch), trained, rtol=1e-5, atol=1e-5)

    merged = trainer.export(tmp_path / "merged", merge=True)
    assert (merged / "model.safetensors").exists() and (merged / "config.json").exists()
    plain = type(case.model).from_pretrained(str(merged))
    torch.testing.assert_close(_logits(plain, batch), trained, rtol=1e-5, atol=1e-5)
    assert peft.PeftModel in type(trainer.engine.module).__mro__  # merging ran on a copy

    full = OptimizedTrainer(copy.deepcopy(case.model), case.samples, spec(max_steps=1, lora={"enabled": False}),
                            collate_fn=case.collate_fn)
    full.fit()
    folder = full.export(tmp_path / "full", processor=case.collate_fn.processor)
    assert (folder / "model.safetensors").exists() and (folder / "processor_config.json").exists()
    reloaded = type(case.model).from_pretrained(str(folder))
    torch.testing.assert_close(_logits(reloaded, batch), _logits(full.engine.module, batch), rtol=1e-5, atol=1e-5)


def test_any_other_module_exports_its_state_dict_as_safetensors(tmp_path):
    from conftest import TinyCausalLM, TokenDataset
    from safetensors.torch import load_file

    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(16), spec(max_steps=1, lora={"enabled": False},
                                                                       batch_size=4, micro_batch_size=4))
    trainer.fit()
    saved = load_file(str(trainer.export(tmp_path / "plain") / "model.safetensors"))
    assert all(torch.equal(saved[n], p) for n, p in trainer.engine.module.state_dict().items())


# ---- QLoRA: a 4-bit base through bitsandbytes on CUDA, refused elsewhere before any work -------------------------
class _Untouchable(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 8

    def __getitem__(self, i):
        raise AssertionError("the data was read before the refusal")


def test_qlora_is_refused_before_any_work_without_cuda_or_bitsandbytes(monkeypatch):
    import importlib.util

    from conftest import tiny_llava

    model = tiny_llava()
    qlora = spec(lora={"quantize": "4bit"}, device="cpu")
    with pytest.raises(SpecError, match=r"lora\.quantize: 4bit \(QLoRA\) needs a CUDA device and bitsandbytes \(pip "
                       r"install bitsandbytes\), but the device is cpu.*lora\.quantize: none"):
        OptimizedTrainer(model, _Untouchable(), qlora)
    assert not any("lora" in n for n, _ in model.named_modules())  # not adapted, not quantized
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "bitsandbytes" else
                        real(name, *a))
    with pytest.raises(SpecError, match="bitsandbytes is not installed"):
        OptimizedTrainer(model, _Untouchable(), qlora)
    from vlmfast.strategies.lora import LoRASpec, apply_lora

    with pytest.raises(SpecError, match="needs a CUDA device"):  # the hook refuses too
        apply_lora(model, LoRASpec(enabled=True, quantize="4bit"))


@pytest.mark.parametrize("extra, message", [
    ({"lora": {"enabled": False, "quantize": "4bit"}}, "set lora.enabled: true"),
    ({"engine": "fsdp"}, "lora.quantize: 4bit is not supported with engine: fsdp"),
    ({"engine": "deepspeed"}, "lora.quantize: 4bit is not supported with engine: deepspeed"),
    ({"save": {"dir": "ckpt", "export": {"dir": "out", "merge": True}}}, "merge it onto the full-precision base"),
])
def test_qlora_settings_that_cannot_work_are_refused_by_the_spec(extra, message):
    with pytest.raises((SpecError, ValueError), match=message):
        spec(**{"lora": {"quantize": "4bit"}, **extra})


def check_qlora(tmp_path, device: str = "cuda") -> None:
    """A LLaVA of 5.6M parameters with its language model in 4 bits (nf4) trains its adapters, the 4-bit base stays
    as it was, and a resume finds the same base. Run by the GPU test; by hand also on CPU, with bitsandbytes' CPU
    kernels and the CUDA refusal lifted (docs/lora.md)."""
    import shutil

    import bitsandbytes as bnb
    from conftest import LlavaDataset

    from vlmfast.strategies.lora import frozen_fingerprint

    qlora = spec(max_steps=4, batch_size=4, micro_batch_size=4, device=device, loss={"shift_labels": "yes"},
                 precision="bf16" if device == "cuda" else "fp32", optimizer={"name": "adamw", "lr": 1e-3},
                 save={"dir": str(tmp_path / "ckpt"), "every_steps": 2},
                 lora={"quantize": "4bit", "modules_to_save": ["multi_modal_projector"]})
    trainer = OptimizedTrainer(_llava_5m(), LlavaDataset(16), qlora)
    model = trainer.engine.module
    layers = {n: m for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    quantized = [n for n, m in layers.items() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(quantized) == 6 * 7 and all(".language_model." in n for n in quantized), quantized  # 7 per layer
    assert all(layers[n].weight.dtype == torch.uint8 for n in quantized)  # packed 4-bit
    assert type(layers["base_model.model.model.vision_tower.encoder.layers.0.mlp.fc1"]) is nn.Linear  # not the tower
    assert type(layers["base_model.model.lm_head"]) is nn.Linear  # nor the output head
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    fingerprint = frozen_fingerprint(model)
    result = trainer.fit()
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in result.history)
    moved = {n for n, p in model.named_parameters() if not torch.equal(p, start[n])}
    assert moved == {n for n, p in model.named_parameters() if p.requires_grad}  # adapters and projector only
    assert frozen_fingerprint(model) == fingerprint and "base in 4bit (nf4)" in "\n".join(result.report.strategies)

    shutil.rmtree(tmp_path / "ckpt" / "step_00000004")  # resume at step 2 onto a freshly quantized base
    resumed = OptimizedTrainer(_llava_5m(), LlavaDataset(16), qlora)
    again = resumed.fit()
    assert again.resumed_from is not None and again.resumed_from.name == "step_00000002"
    theirs = dict(resumed.engine.module.named_parameters())
    for name, value in model.named_parameters():
        if value.requires_grad:
            torch.testing.assert_close(theirs[name], value, rtol=1e-5, atol=1e-6)
    with pytest.raises(ValueError, match="merge it onto the full-precision base"):
        trainer.export(tmp_path / "merged", merge=True)
    assert (trainer.export(tmp_path / "adapter") / "adapter_model.safetensors").exists()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_qlora_trains_the_adapters_on_a_4bit_base_and_resumes_on_it(tmp_path):
    pytest.importorskip("bitsandbytes")
    check_qlora(tmp_path)


# ---- 2 gloo ranks (DDP, FSDP2, ZeRO-2, ZeRO-3) equal one process, no find_unused_parameters ------------------------
# ---- under FSDP2 and ZeRO-2 a checkpoint holds the trainable state alone and resumes bit-exactly --------------------
# ---- under ZeRO-3 it holds the whole state (engine.keeps_trainable_only is False) and resumes bit-exactly -----------
ENGINES = {"ddp": {}, "fsdp": {"engine": "fsdp"}, "zero2": {"engine": "deepspeed", "deepspeed": {"zero_stage": 2}},
           "zero3": {"engine": "deepspeed", "deepspeed": {"zero_stage": 3}}}
TRAINABLE_ONLY = ("fsdp", "zero2")  # the engines whose LoRA checkpoints hold the adapters alone
SAVING = (*TRAINABLE_ONLY, "zero3")  # the engines whose LoRA checkpoints are checked here (one process and DDP: above)


def _dtype_for(engine: dict | None) -> torch.dtype:
    """float64 (exact comparisons), except under ZeRO-3, which partitions fp32/bf16/fp16 parameters only (refused
    before DeepSpeed sees them: test_a_float64_model_under_zero3_is_refused_before_deepspeed_sees_it)."""
    return torch.float32 if (engine or {}).get("deepspeed", {}).get("zero_stage") == 3 else torch.float64


def force_fp16_capable_accelerator() -> None:
    """Make DeepSpeed's accelerator say it supports fp16, as on a CPU with AVX-512-FP16 (and every GPU): ZeRO-3's
    zero.Init then picks its dtype another way, so every CI machine runs the case those machines run."""
    from deepspeed.accelerator import get_accelerator

    get_accelerator().is_fp16_supported = lambda: True


def _lora_trainer(batch_size: int, engine: dict | None = None, save: str | None = None,
                  change_base: bool = False, dtype: torch.dtype | None = None) -> OptimizedTrainer:
    from conftest import TinyCausalLM, TokenDataset

    torch.manual_seed(0)
    model = TinyCausalLM().to(dtype or _dtype_for(engine))
    if change_base:
        with torch.no_grad():
            model.embed.weight[0, 0] += 1e-3  # one frozen element
    saving = {"save": {"dir": save, "every_steps": 2}} if save else {}  # step 2, and the final step 3
    trainer_spec = spec(max_steps=3, batch_size=batch_size, micro_batch_size=2, lora={"r": 4},
                        optimizer={"momentum": 0.9}, **saving, **(engine or {}))  # momentum: optimizer state to save
    return OptimizedTrainer(model, TokenDataset(32), trainer_spec)


def _trained(trainer: OptimizedTrainer) -> dict[str, torch.Tensor]:
    with _gathered(trainer.engine.module):
        params = trainer.engine.module.named_parameters()
        return {n: _full(p).detach().clone() for n, p in params if p.requires_grad} | {"frozen": sum(
            float(_full(p).double().sum()) for _, p in trainer.engine.module.named_parameters() if not p.requires_grad)}


def _lora_tiny(batch_size: int, engine: dict | None = None, save: str | None = None,
               dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    trainer = _lora_trainer(batch_size, engine, save, dtype=dtype)
    trainer.fit()
    kind = type(trainer.model).__name__
    assert "PeftModel" in kind if batch_size == 8 else kind in ("DistributedDataParallel", "FSDPPeftModel",
                                                                "DeepSpeedEngine"), kind
    with _gathered(trainer.engine.module):
        frozen = [(n, _full(p)) for n, p in trainer.engine.module.named_parameters() if not p.requires_grad]
        frozen_bytes = sum(p.numel() * p.element_size() for _, p in frozen)
    return _trained(trainer) | {"frozen_names": sorted(n for n, _ in frozen), "frozen_bytes": frozen_bytes}


def _gathered(module: nn.Module):
    """ZeRO-3's partitioned parameters whole for the block (each rank holds a slice and an empty placeholder
    otherwise), read as tests/test_deepspeed.py reads them; a no-op for the other engines."""
    from contextlib import nullcontext

    partitioned = [p for p in module.parameters() if hasattr(p, "ds_id")]
    if not partitioned:
        return nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(partitioned)  # a collective: every rank reads


def _full(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # an FSDP2 DTensor: gathered


def _checkpoint_contents(folder) -> tuple[set[str], int]:
    """Every string key in every file of a checkpoint (DeepSpeed's shards too), and the bytes of its floating-point
    tensors."""
    from pathlib import Path

    keys, floats = set(), 0

    def walk(obj) -> None:
        nonlocal floats
        if isinstance(obj, dict):
            keys.update(k for k in obj if isinstance(k, str))
            for value in obj.values():
                walk(value)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                walk(value)
        elif isinstance(obj, torch.Tensor) and obj.is_floating_point():
            floats += obj.numel() * obj.element_size()

    for f in Path(folder).rglob("*.pt"):
        walk(torch.load(f, map_location="cpu", weights_only=False))  # this test's own files
    return keys, floats


def _resume(batch_size: int, name: str, directory: str, change_base: bool = False):
    """The run resumed from its step 2 (step 3 removed), or the SpecError of a resume onto a changed base."""
    import shutil

    from vlmfast.engines.collectives import barrier

    if torch.distributed.get_rank() == 0:
        shutil.rmtree(f"{directory}/{name}/step_00000003", ignore_errors=True)
    barrier()
    trainer = _lora_trainer(batch_size, ENGINES[name], f"{directory}/{name}", change_base)
    try:
        result = trainer.fit()
    except SpecError as exc:
        return str(exc)
    return result.resumed_from.name, _trained(trainer)


def _all_engines(batch_size: int, directory: str) -> tuple[dict, dict]:
    """Each engine in turn, in one launch (the process group is set up once): its run, then the resumed run and, under
    FSDP2 and ZeRO-2, what the step-2 checkpoint holds and a resume onto a base with one frozen element changed.
    ZeRO-3 comes last: its engine replaces torch.nn.functional.linear for the rest of the process (DeepSpeed's
    zero.Init, memory_efficient_linear), which changed the bits of FSDP2's resume when it ran after ZeRO-3."""
    runs, checks = {}, {}
    force_fp16_capable_accelerator()
    for name, engine in ENGINES.items():
        runs[name] = _lora_tiny(batch_size, engine, f"{directory}/{name}" if name in SAVING else None)
        if name in TRAINABLE_ONLY:
            checks[name] = {"contents": _checkpoint_contents(f"{directory}/{name}/step_00000002"),
                            "changed_base": _resume(batch_size, name, directory, change_base=True)}
        if name in SAVING:
            checks[name] = checks.get(name, {}) | {"resumed": _resume(batch_size, name, directory)}
    return runs, checks


@pytest.mark.timeout(300)
def test_two_ranks_under_ddp_fsdp2_zero2_and_zero3_train_the_adapters_as_one_process_with_the_global_batch(tmp_path):
    from conftest import spawn_two_ranks

    ranks = spawn_two_ranks(_all_engines, tmp_path, "lora_engines", 4, str(tmp_path))
    references = {dtype: _lora_tiny(8, dtype=dtype) for dtype in (torch.float64, torch.float32)}
    tolerances = {torch.float64: 1e-6, torch.float32: 1e-5}  # norm-relative: 2 ranks sum in another order
    for runs, checks in ranks:
        for engine, params in runs.items():
            dtype = _dtype_for(ENGINES[engine])
            reference = dict(references[dtype])
            frozen, frozen_names, frozen_bytes = (reference.pop(key) for key in ("frozen", "frozen_names",
                                                                                 "frozen_bytes"))
            assert params.pop("frozen") == frozen, engine  # the base never moves
            assert params.pop("frozen_names") == frozen_names and params.pop("frozen_bytes") == frozen_bytes, engine
            assert sorted(params) == sorted(reference) and any("lora_B" in n for n in params), engine
            diff = torch.cat([(params[n] - p).double().flatten() for n, p in reference.items()]).norm()
            scale = torch.cat([p.double().flatten() for p in reference.values()]).norm()
            assert diff <= tolerances[dtype] * scale, f"{engine}: off by {float(diff / scale):.1e}"
            if engine not in checks:
                continue
            check = checks[engine]
            resumed_from, resumed = check["resumed"]
            assert resumed_from == "step_00000002", engine
            assert all(torch.equal(resumed[n], p) for n, p in params.items()), engine  # bit-exact
            assert resumed["frozen"] == frozen, engine
            if engine not in TRAINABLE_ONLY:
                continue  # ZeRO-3: the whole state is saved (docs/lora.md, "Not yet")
            trainable_bytes = sum(p.numel() * p.element_size() for p in reference.values())
            keys, floats = check["contents"]
            assert not keys & set(frozen_names), (engine, sorted(keys & set(frozen_names))[:3])  # no frozen tensor
            assert all(n in keys for n in reference), engine  # the adapters are there
            # weights, momentum and ZeRO's fp32 master partition of the adapters: no unnamed copy of the base either
            assert floats <= 3 * trainable_bytes < frozen_bytes, (engine, floats, trainable_bytes, frozen_bytes)
            assert "frozen base weights differ from the checkpoint's (fingerprint" in check["changed_base"], engine


def test_a_float64_model_under_zero3_is_refused_before_deepspeed_sees_it(monkeypatch):
    """On an fp16-capable accelerator (every GPU, a CPU with AVX-512-FP16: forced here so any machine checks it)
    DeepSpeed's zero.Init asserted 'Invalid data type torch.float64'; vlmfast refuses first, naming the dtype."""
    deepspeed = pytest.importorskip("deepspeed")
    monkeypatch.setattr(deepspeed.accelerator.get_accelerator(), "is_fp16_supported", lambda: True)
    with pytest.raises(SpecError, match=r"deepspeed.zero_stage: 3 partitions float32, bfloat16 or float16 parameters; "
                       r".* is torch.float64: convert the model first \(model.float\(\)"):
        _lora_trainer(4, ENGINES["zero3"], dtype=torch.float64)


def test_the_free_space_check_expects_a_lora_checkpoint_of_the_trainable_state_only():
    """save.dir's free-space check estimates the checkpoint a run will write: for a LoRA run, the trainable
    parameters and their optimizer states, not the frozen base (which was 35x the checkpoint at 36M parameters)."""
    from vlmfast.checkpoints.save_dir import estimate_checkpoint_bytes

    base, adapter = torch.nn.Linear(256, 256), torch.nn.Linear(256, 4, bias=False)
    base.requires_grad_(False)
    model = torch.nn.Sequential(base, adapter)
    adapter_bytes = adapter.weight.numel() * 4
    assert estimate_checkpoint_bytes(model, "adamw", trainable_only=True) == adapter_bytes * 3  # weights + 2 states
    assert estimate_checkpoint_bytes(model, "adamw") == adapter_bytes * 3 + (256 * 256 + 256) * 4
