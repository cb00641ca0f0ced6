"""Balanced ranks (data.rank_balance): the deal as a pure function, and 2 gloo ranks that train exactly as one process
with the global batch while each rank gets an even share of the estimated cost."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import TinyCausalLM, spawn_two_ranks

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.data.rank_balance import CostModel, RankBalancedBatchSampler, deal, imbalance, positional_shares


# ---- the deal, in one process -----------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", range(20))
def test_every_sample_is_dealt_once_deterministically_within_the_lpt_bound(seed):
    rng = random.Random(seed)
    world = rng.choice([2, 3, 4, 8])
    costs = [rng.paretovariate(1.2) for _ in range(world * rng.randint(1, 16))]  # long-tailed
    shares = deal(costs, world)
    assert sorted(i for share in shares for i in share) == list(range(len(costs)))  # each once
    assert deal(costs, world) == shares  # the same on every call (and so on every rank)
    loads = [sum(costs[i] for i in share) for share in shares]
    assert max(loads) <= sum(costs) / world + max(costs) + 1e-9  # LPT: at most the mean plus the costliest
    assert imbalance(costs, shares) <= imbalance(costs, positional_shares(len(costs), world)) + 1e-9


def test_the_weighted_per_rank_losses_sum_to_the_one_process_loss():
    """Token-weighted: each rank's share of the loss is its tokens' loss sum over the global token count."""
    rng = random.Random(0)
    tokens = [rng.randint(8, 512) for _ in range(16)]
    losses = [rng.random() * n for n in tokens]  # each sample's summed token loss
    one_process = sum(losses) / sum(tokens)
    for world in (2, 4, 8):
        shares = deal(CostModel(per_token=1.0, per_token_pair=1e-3).costs(tokens, [0] * 16), world)
        per_rank = [sum(losses[i] for i in share) / sum(tokens) for share in shares]
        assert sum(per_rank) == pytest.approx(one_process, rel=1e-12)


def test_the_sampler_deals_the_positional_global_batch_and_resumes_at_a_batch():
    costs = [float(i % 7 + 1) ** 2 for i in range(48)]
    shares = {r: list(RankBalancedBatchSampler(costs, 4, seed=3, rank=r, world_size=2)) for r in range(2)}
    order = RankBalancedBatchSampler(costs, 4, seed=3)._order()
    for b in range(len(shares[0])):  # the same samples as the positional deal's global batch b, dealt by cost
        assert sorted(shares[0][b] + shares[1][b]) == sorted(order[b * 8:(b + 1) * 8])
    later = RankBalancedBatchSampler(costs, 4, seed=3, rank=1, world_size=2)
    later.set_position(0, 2 * 4)
    assert list(later) == shares[1][2:]


def test_the_spec_refuses_balance_with_length_grouping():
    with pytest.raises(ValueError, match=r"rank_balance with data\.group_by_length"):
        TrainSpec(data={"rank_balance": "cost", "group_by_length": "length"})


# ---- 2 ranks: exact, and balanced --------------------------------------------------------------------------------
class LongTailed(torch.utils.data.Dataset):
    """Token samples of 4 to 120 tokens, long-tailed; ``lengths`` is the metadata the deal reads."""

    def __init__(self, n: int = 48, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lengths = [int(4 + 116 * float(u) ** 4) for u in torch.rand(n, generator=g)]
        self.ids = [torch.randint(1, 50, (n_tokens,), generator=g) for n_tokens in self.lengths]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def pad(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), -100)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for r, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[r, :n], labels[r, :n], mask[r, :n] = s["input_ids"], s["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _spec(batch_size: int, balance: str, **extra) -> TrainSpec:
    return TrainSpec(max_steps=3, batch_size=batch_size, micro_batch_size=2, device="cpu", seed=0,
                     optimizer={"name": "sgd", "lr": 0.5}, log={"progress": "off"},
                     data={"rank_balance": balance, "rank_balance_cost": {"per_token": 1.0, "per_token_pair": 0.01}},
                     **extra)


def _params(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().double().clone() for n, p in trainer.engine.module.named_parameters()}


COMPOSED = {"cost+token-budget": {"micro_batch_tokens": 160}}  # shares split by tokens: the same gradient


def _two_rank_runs(checkpoints: str) -> dict:
    out = {}
    for balance in ("off", "cost", *COMPOSED):
        torch.manual_seed(0)
        spec = _spec(4, balance.split("+")[0], **COMPOSED.get(balance, {}))
        trainer = OptimizedTrainer(TinyCausalLM().double(), LongTailed(), spec, collate_fn=pad)
        result = trainer.fit()
        out[balance] = {"params": _params(trainer), "history": result.history}
    save = {"dir": checkpoints, "every_steps": 2, "resume": "auto"}  # stopped after step 2, then resumed to 3
    for steps in (2, 3):
        torch.manual_seed(0)
        trainer = OptimizedTrainer(TinyCausalLM().double(), LongTailed(), _spec(4, "cost", save=save)
                                   .model_copy(update={"max_steps": steps}), collate_fn=pad)
        result = trainer.fit()
    out["resumed"] = {"params": _params(trainer), "from": str(result.resumed_from)}
    return out


def test_two_ranks_with_cost_balance_train_as_one_process_with_the_global_batch(tmp_path):
    ranks = spawn_two_ranks(_two_rank_runs, tmp_path, "balance", str(tmp_path / "checkpoints"))
    torch.manual_seed(0)
    one = OptimizedTrainer(TinyCausalLM().double(), LongTailed(), _spec(8, "off"), collate_fn=pad)
    one.fit()
    reference = _params(one)
    scale = torch.cat([p.flatten() for p in reference.values()]).norm()
    for rank in ranks:
        for balance in ("off", "cost", *COMPOSED):  # composed with a token budget: the same
            diff = torch.cat([(rank[balance]["params"][n] - p).flatten() for n, p in reference.items()]).norm()
            assert diff <= 1e-6 * scale, (balance, float(diff / scale))
    balanced = ranks[0]["cost"]["history"]
    dealt = [h["balance/imbalance"] for h in balanced]
    positional = [h["balance/imbalance_positional"] for h in balanced]
    assert all(d <= p + 1e-9 for d, p in zip(dealt, positional, strict=True)) and sum(dealt) < sum(positional)
    assert [h["balance/imbalance"] for h in ranks[1]["cost"]["history"]] == dealt  # every rank dealt alike
    assert "balance/imbalance" not in ranks[0]["off"]["history"][0]
    for rank in ranks:  # per-rank compute up to the last gradient, and the spread the ranks agreed on
        assert all(h["balance/compute_s"] > 0 for h in rank["cost"]["history"])
    spread = [[h["balance/straggler_s"] for h in rank["cost"]["history"]] for rank in ranks]
    assert spread[0] == spread[1] and all(s >= 0 for s in spread[0])
    assert "balance/compute_s" not in ranks[0]["off"]["history"][0]  # log.straggler off, no balance: not measured
    for rank in ranks:  # resumed at step 2: the same deal of step 3, bit-exact
        assert rank["resumed"]["from"].endswith("step_00000002")
        assert all(torch.equal(rank["resumed"]["params"][n], p) for n, p in rank["cost"]["params"].items())


def test_the_compute_clock_stops_at_the_last_gradient_not_at_what_waits_after_it():
    """What DDP's final all-reduce wait would add after backward (here a 0.3 s sleep) is not a rank's compute."""
    import time

    from vlmfast.train.straggler import ComputeClock

    model = TinyCausalLM()
    clock = ComputeClock(model, torch.device("cpu"))
    batch = {"input_ids": torch.randint(1, 50, (2, 8)), "labels": torch.randint(1, 50, (2, 8))}
    clock.start()
    model(**batch)["loss"].backward()
    done = time.perf_counter()
    time.sleep(0.3)
    assert clock.seconds() <= done - clock._start + 1e-6  # up to the last gradient, not the sleep after it
    assert clock.seconds() > 0
    clock.remove()
