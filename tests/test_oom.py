"""OOM fallback: the run survives, settles at a size that fits, and trains exactly as if it had started there."""

from __future__ import annotations

import gc
import os

import pytest
import torch
from conftest import TinyCausalLM, TokenDataset, token_batch

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.hooks import accumulate_gradients
from vlmfast.spec import OOMSpec
from vlmfast.strategies.oom import OOMFallback, OutOfMemoryAtMinimumError, is_oom_error
from vlmfast.testing import simulated_oom


def spec(micro_batch_size=16, **overrides):
    base = {"max_steps": 8, "batch_size": 16, "micro_batch_size": micro_batch_size, "optimizer": {"lr": 1e-2},
            "oom": {"enabled": True}, "log": {"progress": "off"}}
    base.update(overrides)
    return TrainSpec(**base)


def fit(train_spec, limit=None, phase="forward"):
    torch.manual_seed(0)
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(64), train_spec)
    if limit is None:
        return trainer, trainer.fit()
    with simulated_oom(limit, phase=phase) as oom:
        result = trainer.fit()
    assert oom.count > 0
    return trainer, result


def params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def test_simulated_oom_checks_only_the_outermost_call_and_counts():
    model = TinyCausalLM()
    with simulated_oom(4) as oom:
        model(**token_batch(4))  # at the limit: fine
        with pytest.raises(torch.OutOfMemoryError, match="simulated"):
            model(**token_batch(5))
    assert oom.count == 1
    model(**token_batch(8))  # hooks removed on exit


def test_simulated_oom_in_backward():
    model = TinyCausalLM()
    with simulated_oom(4, phase="backward") as oom:
        loss = model(**token_batch(8))["loss"]  # forward passes
        with pytest.raises(torch.OutOfMemoryError):
            loss.backward()
    assert oom.count == 1


@pytest.mark.parametrize("phase", ["forward", "backward"])
def test_fallback_settles_at_the_size_that_fits_and_matches_a_run_started_there(phase):
    trainer, result = fit(spec(16), limit=4, phase=phase)
    reference, _ = fit(spec(4))
    assert trainer.state.micro_batch_size == 4 and trainer.state.accumulation_steps == 4
    assert [m["micro_batch_size"] for m in result.history] == [4] * 8
    assert [(e["from"], e["to"]) for e in trainer.micro_batching.events] == [(16, 8), (8, 4)]
    for name, value in params(reference.model).items():
        torch.testing.assert_close(params(trainer.model)[name], value, rtol=1e-6, atol=1e-6)
    assert "oom fallback: micro_batch_size 16 -> 4" in result.report.to_text()


def test_grows_back_after_clean_steps_and_backs_off_when_growing_fails():
    trainer, result = fit(spec(16, max_steps=12, oom={"enabled": True, "grow_after_steps": 3}), limit=8)
    moves = [(e["from"], e["to"]) for e in trainer.micro_batching.events]
    assert moves == [(16, 8), (8, 16), (16, 8), (8, 16), (16, 8)]  # grows after 3 clean steps, then after 6
    assert trainer.micro_batching.grow_after == 12  # doubled after each failed grow
    assert all(m["micro_batch_size"] == 8 for m in result.history)


def test_below_the_minimum_fails_with_summary_and_advice():
    with pytest.raises(OutOfMemoryAtMinimumError) as info:
        fit(spec(16, oom={"enabled": True, "min_micro_batch_size": 4}), limit=2)
    message = str(info.value)
    assert "out of memory at micro_batch_size 4" in message
    assert "activation_checkpointing.enabled: true" in message and "precision: bf16" in message
    assert "rss_gb" in message


def test_the_chosen_size_is_checkpointed_and_restored(tmp_path):
    save = {"dir": str(tmp_path), "every_steps": 4}
    fit(spec(16, max_steps=4, save=save), limit=4)
    torch.manual_seed(0)
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(64), spec(16, max_steps=8, save=save))
    with simulated_oom(4) as oom:
        result = trainer.fit()
    assert oom.count == 0 and result.history[0]["step"] == 5
    assert trainer.state.micro_batch_size == 4


def test_oom_is_recognised_by_type_then_by_message():
    assert is_oom_error(torch.OutOfMemoryError("x"))
    assert is_oom_error(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling cublasCreate"))
    assert is_oom_error(RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory: you tried"))
    assert not is_oom_error(RuntimeError("shape mismatch"))
    assert not is_oom_error(ValueError("CUDA out of memory"))  # not a RuntimeError: a user's bug, not an OOM


def test_standalone_hook_in_a_hand_written_loop():
    torch.manual_seed(0)
    model = TinyCausalLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    fallback = OOMFallback(OOMSpec(enabled=True), micro_batch_size=8)
    batch = token_batch(8)
    with simulated_oom(2):
        loss = fallback.run(lambda mbs: accumulate_gradients(model, batch, mbs),
                            cleanup=lambda: optimizer.zero_grad(set_to_none=True))
    optimizer.step()
    assert fallback.micro_batch_size == 2 and torch.isfinite(loss)


# ---- two processes (gloo): one rank hits the OOM, both shrink, nobody hangs ------------------------------------
def _init_two_ranks(rank: int, rendezvous: str) -> None:
    # A file rendezvous: no TCP port to pick, so parallel test runs cannot collide.
    torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)


# ---- batch-size finder -----------------------------------------------------------------------------------------
def test_finder_finds_the_largest_size_and_restores_all_state():
    torch.manual_seed(0)
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(64), spec(16))
    trainer.fit()  # a trained model with optimizer state: both must come back unchanged
    before_params = params(trainer.model)
    before_opt = {k: v.clone() for k, v in trainer.optimizer.state_dict()["state"][0].items()}
    position = trainer.loader.state_dict()
    with simulated_oom(5):
        search = trainer.find_micro_batch_size()
    assert search.largest == 5 and search.recommended == 4  # 90 % margin (4.5), a divisor of 16
    assert search.tried[16] is False and search.tried[5] is True and search.tried[6] is False
    for name, value in before_params.items():
        assert torch.equal(params(trainer.model)[name], value), name
    for key, value in before_opt.items():
        assert torch.equal(trainer.optimizer.state_dict()["state"][0][key], value), key
    assert trainer.loader.state_dict() == position


def test_finder_propagates_errors_that_are_not_oom():
    class Broken(TinyCausalLM):
        def forward(self, input_ids, labels=None, attention_mask=None):
            raise RuntimeError("shape mismatch in user code")

    trainer = OptimizedTrainer(Broken(), TokenDataset(64), spec(16))
    with pytest.raises(RuntimeError, match="shape mismatch"):
        trainer.find_micro_batch_size()


def _finder_worker(rank: int, rendezvous: str, out: str) -> None:
    _init_two_ranks(rank, rendezvous)
    try:
        torch.manual_seed(0)
        trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(64), spec(16))
        with simulated_oom(6, ranks=[1]):  # rank 1 has less memory: both ranks must settle on its size
            torch.save(trainer.find_micro_batch_size().largest, f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.timeout(120)
def test_finder_ranks_agree_on_the_smallest_fit(tmp_path):
    torch.multiprocessing.spawn(_finder_worker, args=(str(tmp_path / "rdzv"), str(tmp_path / "n")), nprocs=2)
    assert [torch.load(f"{tmp_path / 'n'}.{rank}") for rank in range(2)] == [6, 6]


def test_expandable_segments_is_set_before_cuda_starts(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "max_split_size_mb:128")
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    OOMFallback(OOMSpec(enabled=True, expandable_segments=True), micro_batch_size=8)
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:128,expandable_segments:True"


class _LazyActivations(torch.utils.data.Dataset):
    """[seq, dim] float32 samples made on demand (a stored data set of this size would take GiBs of host memory)."""

    def __init__(self, n: int, seq: int, dim: int) -> None:
        self.n, self.seq, self.dim = n, seq, dim

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor]:
        return (torch.randn(self.seq, self.dim, generator=torch.Generator().manual_seed(i)),)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_real_cuda_oom_is_survived():
    """A real allocator OOM in forward/backward, where the fallback retries: sized so it cannot happen elsewhere.

    4 Linear(4096, 4096) = 67M parameters: weights, gradients and AdamW's two moments take 16 bytes each (1.0 GiB),
    plus 0.13 GiB of bf16 weight copies under autocast. Saved activations are ~88 MiB per sample of [1024, 4096]
    (fp32 input 16, its bf16 cast 8, four bf16 layer inputs 32, the fp32 output and its square 32): 5.5 GiB at
    micro-batch 64, 0.7 GiB at 8. The cap leaves 2 GiB above the model states, so micro-batch 64 must run out of
    memory in forward/backward and a smaller one fits together with the optimizer step's states (an OOM in
    optimizer.step() would escape fit(): the fallback does not cover it).
    """
    dim, seq, layers = 4096, 1024, 4
    params = layers * (dim * dim + dim)
    cap = 16 * params + layers * dim * dim * 2 + 2 * 2**30
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total))
    torch.cuda.reset_peak_memory_stats()
    ooms_before = torch.cuda.memory_stats().get("num_ooms", 0)
    baseline = torch.cuda.memory_allocated()
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(dim, dim) for _ in range(layers)])

        def loss_fn(model, batch):
            return model(batch[0]).float().pow(2).mean()

        train_spec = TrainSpec(max_steps=3, batch_size=64, micro_batch_size=64, device="cuda", precision="bf16",
                               oom={"enabled": True}, log={"progress": "off"})
        trainer = OptimizedTrainer(model, _LazyActivations(192, seq, dim), train_spec, loss_fn=loss_fn)
        trainer.fit()  # the optimizer steps (and their first AdamW states) fit under the cap
        assert trainer.state.micro_batch_size < 64 and trainer.micro_batching.events
        assert trainer.micro_batching.events[0]["reason"] == "out of memory"
        assert torch.cuda.memory_stats()["num_ooms"] > ooms_before  # the allocator really failed, nothing simulated
        assert torch.cuda.max_memory_reserved() <= cap
        # Nothing of the failed attempt outlives it: once the run is gone, allocated memory is back at its baseline
        # (a traceback or a retry that kept a tensor would hold hundreds of MiB here).
        del trainer, model
        gc.collect()
        leftover = torch.cuda.memory_allocated() - baseline
        assert leftover <= 2**20, f"{leftover / 2**20:.0f} MiB still allocated after the run ended"
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()
