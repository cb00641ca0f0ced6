"""Two gloo ranks: OOM on one rank (forward, backward, repeatedly) and a rank that dies or hangs.

Every test runs the ranks in fresh processes with a deadline (`run_ranks` kills what is left) under a pytest
timeout, so a regression shows up as a failure, never as a CI job that hangs.
"""

from __future__ import annotations

import os
import re
import time
from contextlib import ExitStack

import pytest
import torch
from _faults import make_spec, params_of, run_ranks
from conftest import TinyCausalLM, TokenDataset

from vlmfast import Callback, OptimizedTrainer
from vlmfast.testing import simulated_oom

# (max micro-batch, phase, ranks) per simulated limit; several limits can hold at once.
OOM_SCENARIOS = {
    "forward_on_rank0": [(4, "forward", [0])],
    "backward_on_rank1": [(4, "backward", [1])],
    "repeatedly_on_both": [(8, "forward", [0]), (4, "backward", [1])],
}


def _oom_worker(limits: list[tuple[int, str, list[int]]], micro_batch_size: int, grow_after: int | None) -> dict:
    torch.manual_seed(0)
    spec = make_spec(
        max_steps=8,
        batch_size=16,
        micro_batch_size=micro_batch_size,
        oom={"enabled": True, "grow_after_steps": grow_after},
    )
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(64), spec)
    with ExitStack() as stack:
        states = [stack.enter_context(simulated_oom(n, phase=phase, ranks=ranks)) for n, phase, ranks in limits]
        result = trainer.fit()
    counts = [s.count for s in states]
    return {
        "params": params_of(trainer.model),
        "moves": [(e["from"], e["to"]) for e in trainer.micro_batching.events],
        "ooms": counts,
        "mbs": [m["micro_batch_size"] for m in result.history],
    }


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> list[dict]:
    """Both ranks at micro-batch 4 from the start, no OOM."""
    outcomes = run_ranks(_oom_worker, tmp_path_factory.mktemp("reference"), [], 4, None, timeout_s=90)
    assert all(o.error is None and o.exitcode == 0 for o in outcomes), outcomes
    return [o.result for o in outcomes]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("scenario", list(OOM_SCENARIOS))
def test_oom_on_one_rank_both_shrink_together_and_match_the_reference(scenario, reference, tmp_path):
    grow_after = 2 if scenario.startswith("repeatedly") else None  # grow back, hit the OOM again, shrink again
    outcomes = run_ranks(_oom_worker, tmp_path, OOM_SCENARIOS[scenario], 16, grow_after, timeout_s=90)
    assert all(o.exitcode == 0 and o.error is None for o in outcomes), outcomes  # nobody hung or failed
    ranks = [o.result for o in outcomes]
    assert ranks[0]["moves"] == ranks[1]["moves"] and ranks[0]["mbs"] == ranks[1]["mbs"]  # shrank together
    oom_ranks = {r for _, _, rs in OOM_SCENARIOS[scenario] for r in rs}
    assert all(sum(ranks[r]["ooms"]) > 0 for r in oom_ranks)
    if grow_after:
        assert sum(sum(r["ooms"]) for r in ranks) >= 3 and len(ranks[0]["moves"]) >= 4, ranks[0]["moves"]
    else:
        assert ranks[0]["mbs"] == [4] * 8 and ranks[0]["moves"] == [(16, 8), (8, 4)]
    for name, value in ranks[0]["params"].items():  # gradients averaged: one model on both ranks
        assert torch.equal(ranks[1]["params"][name], value), name
    for name, value in reference[0]["params"].items():  # and the same one as a run that never ran out of memory
        torch.testing.assert_close(ranks[0]["params"][name], value, rtol=1e-6, atol=1e-6)


# ---- a rank that dies or hangs ---------------------------------------------------------------------------------
class FailAtStep(Callback):
    """On rank 1 at step `step`: exit at once (a crash, the OOM killer) or hang alive; records when."""

    def __init__(self, step: int, how: str, stamp: str) -> None:
        self.step, self.how, self.stamp = step, how, stamp

    def on_step_end(self, trainer, metrics) -> None:
        if trainer.rank != 1 or metrics["step"] != self.step:
            return
        with open(self.stamp, "w") as f:
            f.write(str(time.time()))
        if self.how == "dies":
            os._exit(17)
        time.sleep(600)  # hangs until the test's deadline kills it


def _failing_rank_worker(how: str, timeout_minutes: float, stamp: str) -> int:
    spec = make_spec(max_steps=40, ddp={"timeout_minutes": timeout_minutes})
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(64), spec, callbacks=[FailAtStep(3, how, stamp)])
    trainer.fit()
    return trainer.state.step


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("how", "expected", "bound_s"),
    [
        ("dies", "another rank died", 10.0),  # its sockets close: noticed at the next collective
        ("hangs", r"no answer from another rank within ddp.timeout_minutes \(0.05 min\)", 3.0 + 15.0),
    ],
)
def test_a_rank_that_dies_or_hangs_makes_the_others_fail_clearly_and_in_bounded_time(how, expected, bound_s, tmp_path):
    stamp = tmp_path / "failed_at"
    rank0, rank1 = run_ranks(_failing_rank_worker, tmp_path, how, 0.05, str(stamp), timeout_s=60, grace_s=3)
    assert rank1.exitcode == (17 if how == "dies" else None)  # died, or hung until the deadline killed it
    assert rank0.exitcode == 0 and rank0.result is None, "rank 0 must not finish the run without its peer"
    assert rank0.error_type == "RankFailureError", rank0.error
    assert re.search(expected, rank0.error), rank0.error
    assert "ddp.timeout_minutes" in rank0.error and "resume from the last checkpoint" in rank0.error
    assert rank0.ended_at - float(stamp.read_text()) < bound_s
