"""Every pass-through spec field really reaches the object it configures (a test fails if a field is ignored)."""

from __future__ import annotations

import math
import os
import signal

import pytest
import torch
from conftest import TinyCausalLM, TokenDataset

from vlmfast import Callback, NonFiniteLossError, OptimizedTrainer, TrainSpec
from vlmfast.data.batch import batch_size_of
from vlmfast.data.micro_batches import split_micro_batches
from vlmfast.spec import DDPSpec, SchedulerSpec
from vlmfast.strategies.optimizer import lr_multiplier
from vlmfast.strategies.precision import enable_tf32


def trainer_for(**fields):
    base = {"max_steps": 4, "batch_size": 8, "log": {"progress": "off"}}
    base.update(fields)
    torch.manual_seed(0)
    return OptimizedTrainer(TinyCausalLM(), TokenDataset(64), TrainSpec(**base))


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("constant", [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]),
        ("linear", [0.25, 0.5, 0.75, 1.0, 1.0, 0.55]),  # decay starts after warm-up (as Hugging Face's)
        ("cosine", [0.25, 0.5, 0.75, 1.0, 1.0, 0.55]),
    ],
)
def test_scheduler_shapes(name, expected):
    spec = SchedulerSpec(name=name, warmup_steps=4, min_lr_ratio=0.1)
    got = [lr_multiplier(step, spec, max_steps=6) for step in range(6)]
    assert got == pytest.approx(expected)
    midway = lr_multiplier(5, SchedulerSpec(name=name, min_lr_ratio=0.0), max_steps=10)
    assert midway == pytest.approx({"constant": 1.0, "linear": 0.5, "cosine": 0.5 * (1 + math.cos(math.pi / 2))}[name])


def test_scheduler_drives_the_optimizer_lr():
    trainer = trainer_for(optimizer={"lr": 0.1}, scheduler={"name": "linear", "warmup_steps": 2})
    result = trainer.fit()
    assert [m["lr"] for m in result.history] == pytest.approx([0.05, 0.1, 0.1, 0.05])  # the rate each step used


@pytest.mark.parametrize(
    ("optimizer", "check"),
    [
        ({"name": "sgd", "momentum": 0.9}, lambda o: isinstance(o, torch.optim.SGD) and o.defaults["momentum"] == 0.9),
        ({"name": "adafactor"}, lambda o: isinstance(o, torch.optim.Adafactor)),
        ({"implementation": "fused"}, lambda o: o.defaults["fused"] is True),
        ({"implementation": "foreach"}, lambda o: o.defaults["foreach"] is True),
        ({"implementation": "for_loop"}, lambda o: o.defaults["foreach"] is False and not o.defaults["fused"]),
        ({"betas": [0.8, 0.95], "eps": 1e-6},
         lambda o: o.defaults["betas"] == (0.8, 0.95) and o.defaults["eps"] == 1e-6),
    ],
)
def test_optimizer_fields_reach_the_optimizer(optimizer, check):
    assert check(trainer_for(optimizer=optimizer).optimizer)


def test_data_fields_reach_the_dataloader():
    loader = trainer_for(data={"num_workers": 1, "pin_memory": True, "persistent_workers": True,
                               "prefetch_factor": 3, "drop_last": False, "timeout_s": 7}).loader.loader
    assert (loader.num_workers, loader.pin_memory, loader.persistent_workers, loader.prefetch_factor,
            loader.drop_last, loader.timeout) == (1, True, True, 3, False, 7)


def test_unshuffled_data_keeps_the_dataset_order():
    loader = trainer_for(data={"shuffle": False}).loader
    first = split_micro_batches(next(loader), 8)[0]  # the loader yields samples, collated per micro-batch
    assert torch.equal(first["input_ids"], TokenDataset(64).batch["input_ids"][:8])


def test_ddp_fields_reach_distributed_data_parallel(tmp_path):
    from vlmfast.engines import wrap_ddp

    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        spec = DDPSpec(bucket_cap_mb=1.5, gradient_as_bucket_view=False, static_graph=True,
                       find_unused_parameters=True)
        ddp = wrap_ddp(TinyCausalLM(), spec, torch.device("cpu"))
        assert ddp.bucket_bytes_cap == int(1.5 * 1024 * 1024)
        assert (ddp.gradient_as_bucket_view, ddp.static_graph, ddp.find_unused_parameters) == (False, True, True)
    finally:
        torch.distributed.destroy_process_group()


def test_eval_every_steps_and_max_batches():
    calls = []
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(64), TrainSpec(
        max_steps=4, batch_size=8, eval={"every_steps": 2, "max_batches": 1}, log={"progress": "off"}),
        eval_data=TokenDataset(32, seed=3))
    original = trainer.accumulation.plan
    trainer.accumulation.plan = lambda batch, size, **kw: (calls.append(batch_size_of(batch))
                                                           or original(batch, size, **kw))
    result = trainer.fit()
    assert [m["step"] for m in result.eval_history] == [2, 4, 4]  # every 2 steps, and once at the end
    assert len(calls) == 4 + 3  # 4 training batches + one eval batch per evaluation (max_batches 1)


def test_max_consecutive_skips_stops_a_run_that_keeps_failing():
    def always_nan(model, batch):
        return model(**batch)["loss"] * float("nan")

    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(64), TrainSpec(
        max_steps=10, batch_size=8, loss={"on_nonfinite": "skip", "max_consecutive_skips": 2},
        log={"progress": "off"}), loss_fn=always_nan)
    with pytest.raises(NonFiniteLossError, match=r"step 3: .*3 non-finite step"):
        trainer.fit()


def test_on_interrupt_false_leaves_signals_to_python(tmp_path):
    # Python's own Ctrl-C handler, whatever an earlier test in this process installed (vlmfast must not replace it)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)

    class CtrlC(Callback):
        def on_step_end(self, trainer, metrics):
            os.kill(os.getpid(), signal.SIGINT)

    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(64), TrainSpec(
        max_steps=4, batch_size=8, save={"dir": str(tmp_path), "on_interrupt": False}, log={"progress": "off"}),
        callbacks=[CtrlC()])
    try:
        with pytest.raises(KeyboardInterrupt):
            trainer.fit()
    finally:
        signal.signal(signal.SIGINT, previous)
    assert [p.name for p in tmp_path.iterdir()] == [".vlmfast.lock"]  # no final checkpoint: the guard was off


def test_enable_tf32_sets_the_backend_flags():
    from vlmfast.common.tf32 import restore_tf32_state, tf32_state

    # Through torch's new API only: once it is used, reading the legacy allow_tf32 flags raises (see vlmfast/tf32).
    before = tf32_state()
    try:
        enable_tf32(True)
        assert torch.get_float32_matmul_precision() == "high"  # what Lightning reads: consistent, no error
        assert torch.backends.cuda.matmul.fp32_precision == torch.backends.cudnn.conv.fp32_precision == "tf32"
        enable_tf32(False)
        assert torch.get_float32_matmul_precision() == "highest"
        assert torch.backends.cuda.matmul.fp32_precision == torch.backends.cudnn.conv.fp32_precision == "ieee"
    finally:
        restore_tf32_state(before)


# ---- enabling a strategy: its measured effect, or a logged reason (never nothing) ----------------------------------
# What each strategy claims, measured here on the CPU:
#   vision_cache             epoch 2 served from the cache (hits, the tower skipped), or "off"/"not cached" with why
#   activation_checkpointing fewer bytes saved for backward by one forward of the trainer's model
#   linear_cross_entropy     fewer bytes saved for backward (no logits kept) and the same loss, or refused with why
#   ema                      averaged weights that differ from the trained ones
#   packing                  the model sees fewer rows than samples (packed), or refused naming the key it cannot lay
#                            out (Fuyu's per-sample image_patches)
#   grad_clip                the weights move by at most lr * grad_clip per SGD step (unclipped: ~1000x more)
#   lora                     only the adapters train
# What a CPU cannot show: the wall-clock and GPU-memory gains themselves (compile, attention kernels, the cache's
# tower time on a GPU) - those are the benchmarks' (vlmfast bench) business.
FROZEN_IMAGE_PATH = {"tiny_vlm": ["vision_tower", "multi_modal_projector"],
                     "llava_next": ["model.vision_tower", "model.multi_modal_projector"],  # image_newline trains
                     "fuyu": ["model.vision_embed_tokens"]}


def _tiny_vlm():
    from vlmfast.models import build_tiny_vlm_task

    model, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=8)
    return model, [dataset[i] for i in range(8)], collate


def _llava_next():
    """LLaVA-NeXT: a trainable image_newline inside the image call, so the vision cache cannot serve it."""
    pytest.importorskip("transformers")
    from zoo import build_case

    case = build_case("llava_next")
    return case.model, case.samples, case.collate_fn


def _fuyu():
    """Fuyu: flat image_patches (no image tensor per row) whose layout no known adapter learns from the model's
    inputs, so the vision cache cannot serve it."""
    transformers = pytest.importorskip("transformers")
    from torch.utils.data import default_collate

    config = transformers.FuyuConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                     num_attention_heads=4, patch_size=4, num_channels=3, image_token_id=99,
                                     max_position_embeddings=64)
    config.text_config.vocab_size = 100
    torch.manual_seed(0)
    model = transformers.FuyuForCausalLM(config)
    generator = torch.Generator().manual_seed(0)
    samples = []
    for _ in range(8):
        ids = torch.randint(1, 90, (12,), generator=generator)
        ids[:4] = 99  # the image's 4 patch positions
        samples.append({"input_ids": ids, "attention_mask": torch.ones(12, dtype=torch.long), "labels": ids.clone(),
                        "image_patches": torch.randn(4, 48, generator=generator),
                        "image_patches_indices": torch.arange(4)})
    return model, samples, default_collate


FAMILIES = {"tiny_vlm": _tiny_vlm, "llava_next": _llava_next, "fuyu": _fuyu}
STRATEGIES = {"vision_cache": lambda tmp: {"vision_cache": {"enabled": True, "dir": str(tmp / "cache")}},
              "activation_checkpointing": lambda tmp: {"activation_checkpointing": {"enabled": True}},
              "linear_cross_entropy": lambda tmp: {"linear_cross_entropy": {"enabled": True}},
              "ema": lambda tmp: {"ema": {"enabled": True, "decay": 0.5}},
              "packing": lambda tmp: {"packing": {"enabled": True}},
              "grad_clip": lambda tmp: {"grad_clip": 1e-3},
              "lora": lambda tmp: {"lora": {"enabled": True, "r": 2}}}


def _strategy_run(family: str, fields: dict):
    model, samples, collate = FAMILIES[family]()
    spec = TrainSpec(max_steps=3, batch_size=4, device="cpu", log={"progress": "off"}, **fields,
                     optimizer={"name": "sgd", "lr": 0.01, "freeze": FROZEN_IMAGE_PATH[family]})
    trainer = OptimizedTrainer(model, samples, spec, collate_fn=collate)
    return trainer, samples, collate


def _saved_bytes(model, batch) -> int:
    from vlmfast.hooks import saved_tensor_bytes

    return saved_tensor_bytes(lambda: model(**batch).loss)


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("family", list(FAMILIES))
def test_enabling_a_strategy_has_its_measured_effect_or_a_logged_reason(tmp_path, caplog, family, strategy):
    caplog.set_level("WARNING")
    try:
        _check_strategy_effect(family, strategy, tmp_path, caplog)
    except ValueError as exc:  # refused (at set-up or on the first batch): the error names the strategy and why
        assert strategy in str(exc), exc


def _check_strategy_effect(family: str, strategy: str, tmp_path, caplog) -> None:
    trainer, samples, collate = _strategy_run(family, STRATEGIES[strategy](tmp_path))
    batch = collate(samples[:4])
    if strategy in ("activation_checkpointing", "linear_cross_entropy"):
        plain, _, _ = _strategy_run(family, {})
        assert _saved_bytes(trainer.model, batch) < _saved_bytes(plain.model, batch)
        if strategy == "linear_cross_entropy":
            with torch.no_grad():
                ours, theirs = trainer.model(**batch).loss, plain.model(**batch).loss
            assert float(ours) == pytest.approx(float(theirs), rel=1e-5)
        return
    said_by_step_1: list[str] = []

    class FirstStep(Callback):
        def on_step_end(self, trainer, metrics) -> None:
            if metrics["step"] == 1:
                said_by_step_1.extend(r.getMessage() for r in caplog.records)

    trainer.callbacks.append(FirstStep())
    rows: list[int] = []
    trainer.model.register_forward_pre_hook(lambda m, a, k: rows.append(k["input_ids"].shape[0]), with_kwargs=True)
    start = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    result = trainer.fit()
    if strategy == "packing":  # 4 samples a step, in fewer rows
        assert max(rows) < 4, rows
        return
    if strategy in ("grad_clip", "lora"):
        moved = {n: (p.detach() - start[n]).norm() for n, p in trainer.model.named_parameters() if n in start}
        if strategy == "lora":
            trained = sorted(n for n, d in moved.items() if d > 0)
            assert trained and all("lora_" in n for n in trained), trained[:5]
            return
        step_bound = 0.01 * 1e-3  # lr * grad_clip; the gradients' norm is 1.5 to 4.4 here
        assert 0 < float(torch.stack(list(moved.values())).norm()) <= 3 * step_bound * 1.001
        return
    line = next(s for s in result.report.strategies if s.startswith(strategy))
    if strategy == "ema":
        ema = next(s for s in trainer.strategies if s.name == "ema").ema
        assert any(not torch.equal(a, p) for a, p in zip(ema.average, ema.parameters, strict=True)), line
        return
    served = sum(h["vision_cache/hits"] for h in result.history[2:])  # epoch 2: 8 samples, 4 a step
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("vision_cache")]
    if family == "tiny_vlm":
        assert served == 4 and not said, (line, said)
        return
    if family == "llava_next":  # image_newline trains after the tower: the tower's own output is cached, said once
        assert served > 0 and len(said) == 1 and said[0] in said_by_step_1, said
        assert "caching the frozen model.vision_tower.forward instead" in said[0], said
        return
    # The cache cannot serve Fuyu: it said why once, before the first step, in the log, the report (the strategy
    # line) and the metrics.
    assert served == 0 and len(said) == 1, said
    assert said[0] in said_by_step_1, said_by_step_1  # said during the first step (its first forward), not after
    reason = "its layout was never learned"
    assert reason in said[0] and reason in line, (said, line)
    first = result.history[0]
    assert first["vision_cache/off"] == 1 or first["vision_cache/bypassed"] > 0, first
