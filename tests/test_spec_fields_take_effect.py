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
