"""DDP comm hooks on CPU (gloo): PowerSGD and fp16 send fewer bytes, still train, and bad settings fail early."""

from __future__ import annotations

import itertools

import pytest
import torch
from conftest import TinyCausalLM, token_batch
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook import PowerSGDState, batched_powerSGD_hook
from torch.nn.parallel import DistributedDataParallel

from vlmfast.engines.comm_hooks import (
    batched_powersgd_supported,
    count_bytes,
    register_comm_hook,
    register_comm_hook_from_spec,
)
from vlmfast.spec import DDPSpec

STEPS = 15
# Every matrix 64x64 (embedding, mixer, head): PowerSGD rank 2 sends (64 + 64) * 2 numbers instead of 4096.
MODEL = {"vocab": 64, "dim": 64}
SCENARIOS = {
    "none": {},
    "fp16": {"hook": "fp16"},
    "powersgd": {"hook": "powersgd", "rank": 2, "start_iter": 2},
    "powersgd_fp16": {"hook": "powersgd", "rank": 2, "start_iter": 2, "wrapper": "fp16"},
    # One bucket per parameter: on gloo, torch's PowerSGD alone would race between buckets and abort or hang.
    "powersgd_many_buckets": {"hook": "powersgd", "rank": 2, "start_iter": 2, "bucket_cap_mb": 0.005},
}


# ---- two processes (gloo): one spawn runs every scenario, the tests read the saved results ----------------------
def _train(ddp: DistributedDataParallel, rank: int, counter=None) -> dict:
    """A plain loop; each rank sees its own data, so the all-reduce really changes the gradients."""
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-2)
    batch = token_batch(8, vocab=MODEL["vocab"], seed=rank)
    losses, sent, first_grads = [], [], None
    for _ in range(STEPS):
        loss = ddp(**batch)["loss"]
        loss.backward()  # DDP waits for every hook future before backward returns: the step's bytes are all in
        if counter is not None:
            sent.append(counter.take())
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in ddp.module.named_parameters()}
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    params = {n: p.detach().clone() for n, p in ddp.module.named_parameters()}
    return {"losses": losses, "bytes": sent, "grads": first_grads, "params": params}


def _worker(rank: int, rendezvous: str, out: str) -> None:
    # A file rendezvous: no TCP port to pick, so parallel test runs cannot collide.
    torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=2)
    torch.set_num_threads(1)  # two processes on a small machine
    try:
        results = {}
        for name, options in SCENARIOS.items():
            torch.manual_seed(0)
            options = dict(options)
            ddp = DistributedDataParallel(TinyCausalLM(**MODEL), bucket_cap_mb=options.pop("bucket_cap_mb", 25))
            counter = count_bytes(ddp, **options)
            results[name] = _train(ddp, rank, counter)
        torch.manual_seed(0)
        ddp = DistributedDataParallel(TinyCausalLM(**MODEL))
        results["builtin_state"] = register_comm_hook(ddp, "none")  # DDP's own all-reduce stays
        results["builtin"] = _train(ddp, rank)
        register_comm_hook(ddp, "fp16")  # DDP allows one hook: "none" must not have used the slot
        torch.save(results, f"{out}.{rank}")
    finally:
        torch.distributed.destroy_process_group()


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("comm_hooks")
    torch.multiprocessing.spawn(_worker, args=(str(tmp / "rdzv"), str(tmp / "out")), nprocs=2)
    return [torch.load(f"{tmp / 'out'}.{rank}") for rank in range(2)]


@pytest.mark.timeout(120)
def test_powersgd_sends_under_a_tenth_after_start_iter_and_still_trains(two_ranks):
    plain, compressed = two_ranks[0]["none"], two_ranks[0]["powersgd"]
    assert compressed["bytes"][:2] == plain["bytes"][:2]  # plain all-reduce until start_iter
    assert len(set(plain["bytes"])) == 1 and plain["bytes"][0] > 0
    assert all(b < 0.1 * plain["bytes"][0] for b in compressed["bytes"][2:]), compressed["bytes"]
    losses = compressed["losses"]
    assert all(b < a for a, b in itertools.pairwise(losses[1:])), losses  # keeps falling once compression starts
    assert losses[-1] < 0.4 * losses[0], losses


@pytest.mark.timeout(120)
def test_powersgd_with_many_buckets_runs_on_gloo_and_sends_the_same(two_ranks):
    one, many = two_ranks[0]["powersgd"], two_ranks[0]["powersgd_many_buckets"]
    assert many["bytes"] == one["bytes"]  # per-tensor compression: the bucket layout does not change the total
    assert many["losses"][-1] < 0.4 * many["losses"][0], many["losses"]


@pytest.mark.timeout(120)
def test_fp16_wrapper_halves_powersgd_factors(two_ranks):
    fp32, fp16 = two_ranks[0]["powersgd"]["bytes"], two_ranks[0]["powersgd_fp16"]["bytes"]
    assert [2 * b for b in fp16] == fp32


@pytest.mark.timeout(120)
def test_fp16_on_gloo_halves_the_bytes_and_keeps_gradients_close(two_ranks):
    plain, half = two_ranks[0]["none"], two_ranks[0]["fp16"]
    assert [2 * b for b in half["bytes"]] == plain["bytes"]  # gloo all-reduces fp16: the bytes really halve
    for name, grad in plain["grads"].items():
        torch.testing.assert_close(half["grads"][name], grad, atol=1e-3, rtol=1e-3)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario", [*SCENARIOS, "builtin"])
def test_every_hook_keeps_the_replicas_identical(two_ranks, scenario):
    for name, value in two_ranks[0][scenario]["params"].items():
        torch.testing.assert_close(two_ranks[1][scenario]["params"][name], value, rtol=0, atol=0)


@pytest.mark.timeout(120)
def test_none_is_a_no_op_and_the_counted_baseline_equals_ddp_builtin(two_ranks):
    assert two_ranks[0]["builtin_state"] is None
    for name, value in two_ranks[0]["builtin"]["params"].items():  # torch's allreduce_hook = DDP's own all-reduce
        torch.testing.assert_close(two_ranks[0]["none"]["params"][name], value, rtol=1e-6, atol=1e-6)


# ---- validation: one rank is enough, nothing is communicated -----------------------------------------------------
@pytest.fixture
def one_rank_ddp(tmp_path):
    torch.distributed.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        yield DistributedDataParallel(TinyCausalLM(**MODEL))
    finally:
        torch.distributed.destroy_process_group()


def test_bf16_hook_on_gloo_names_the_field(one_rank_ddp):
    with pytest.raises(ValueError, match=r"ddp.comm_hook='bf16' needs the NCCL backend .* over 'gloo'"):
        register_comm_hook(one_rank_ddp, "bf16")


def test_bf16_wrapper_on_gloo_names_the_field(one_rank_ddp):
    with pytest.raises(ValueError, match=r"ddp.comm_wrapper='bf16' needs the NCCL backend"):
        register_comm_hook(one_rank_ddp, "powersgd", start_iter=2, wrapper="bf16")


@pytest.mark.skipif(torch.version.cuda is not None, reason="DDP accepts bf16 hooks on CUDA builds with NCCL")
def test_why_bf16_is_checked_gloo_accepts_bf16_but_ddp_refuses_the_hook(one_rank_ddp):
    """gloo on CPU all-reduces bf16 in this torch; it is DDP that refuses bf16 hooks without NCCL."""
    tensor = torch.ones(3, dtype=torch.bfloat16)
    torch.distributed.all_reduce(tensor)
    with pytest.raises(TypeError, match="NCCL"):
        one_rank_ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)


@pytest.mark.parametrize("start_iter", [0, 1])
def test_powersgd_start_iter_below_2_is_refused_with_the_reason(one_rank_ddp, start_iter):
    with pytest.raises(ValueError, match=r"ddp.powersgd.start_iter must be >= 2.*rebuilds its gradient buckets"):
        register_comm_hook(one_rank_ddp, "powersgd", start_iter=start_iter)


def _steps(ddp: DistributedDataParallel, n: int) -> None:
    batch = token_batch(4, vocab=MODEL["vocab"])
    for _ in range(n):
        ddp(**batch)["loss"].backward()


def test_batched_powersgd_check_matches_what_torchs_hook_does(one_rank_ddp):
    """torch's batched hook raises at its first compressed step in this torch; the early check must say so."""
    state = PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2)
    one_rank_ddp.register_comm_hook(state, batched_powerSGD_hook)  # torch's hook directly, no vlmfast check
    if batched_powersgd_supported():
        _steps(one_rank_ddp, 3)
    else:
        _steps(one_rank_ddp, 2)  # plain all-reduce until start_iter
        with pytest.raises(AssertionError):
            _steps(one_rank_ddp, 1)


@pytest.mark.skipif(batched_powersgd_supported(), reason="this torch's batched_powerSGD_hook works")
def test_batched_powersgd_is_refused_early_where_torchs_hook_is_broken(one_rank_ddp):
    with pytest.raises(ValueError, match=r"ddp.comm_hook='batched_powersgd' fails in torch .* Use ddp.comm_hook: "):
        register_comm_hook(one_rank_ddp, "batched_powersgd", start_iter=2)


def test_wrapper_without_powersgd_is_refused():
    with pytest.raises(ValueError, match=r"ddp.comm_wrapper='fp16' only applies to PowerSGD"):
        register_comm_hook(torch.nn.Linear(2, 2), "fp16", wrapper="fp16")


def test_a_model_without_ddp_is_refused_unless_the_hook_is_none():
    with pytest.raises(TypeError, match=r"needs a DistributedDataParallel model, got Linear"):
        register_comm_hook(torch.nn.Linear(2, 2), "powersgd")
    assert register_comm_hook(torch.nn.Linear(2, 2), "none") is None
    assert register_comm_hook_from_spec(torch.nn.Linear(2, 2), DDPSpec()) is None


def test_from_spec_passes_every_powersgd_field(one_rank_ddp):
    spec = DDPSpec(comm_hook="powersgd", comm_wrapper="fp16", powersgd={
        "rank": 3, "start_iter": 5, "warm_start": False, "error_feedback": False, "min_compression_rate": 4.0})
    state = register_comm_hook_from_spec(one_rank_ddp, spec)
    assert isinstance(state, PowerSGDState)
    assert (state.matrix_approximation_rank, state.start_powerSGD_iter, state.min_compression_rate) == (3, 5, 4.0)
    assert (state.warm_start, state.use_error_feedback) == (False, False)
    assert state.process_group is one_rank_ddp.process_group


def test_fp16_returns_the_process_group_it_communicates_over(one_rank_ddp):
    assert register_comm_hook(one_rank_ddp, "fp16") is one_rank_ddp.process_group
