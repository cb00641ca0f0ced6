"""Balanced ranks (data.rank_balance): the deal as a pure function, and 2 gloo ranks that train exactly as one process
with the global batch while each rank gets an even share of the estimated cost, composed with the token budget,
packing, length grouping, modality sync, the vision cache, DDP, FSDP2 and ZeRO-2 (one launch runs them all)."""

from __future__ import annotations

import copy
import functools
import importlib.util
import random

import pytest
import torch
from conftest import Float64, TinyCausalLM, spawn_two_ranks

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.data.rank_balance import CostModel, RankBalancedBatchSampler, deal, imbalance, positional_shares
from vlmfast.data.samplers import LengthGroupedSampler


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


def test_with_length_grouping_the_global_batches_are_grouping_s_and_the_deal_splits_them():
    """Grouping decides which samples form each global batch (as LengthGroupedSampler gives the ranks together), the
    deal which rank computes which: the spec takes both."""
    TrainSpec(data={"rank_balance": "cost", "group_by_length": "length"})
    lengths = [int(4 + 116 * (i * 0.37 % 1) ** 4) for i in range(48)]
    costs = [float(n * n) for n in lengths]
    grouped = {r: list(LengthGroupedSampler(lengths, 4, seed=3, rank=r, world_size=2)) for r in range(2)}
    dealt = {r: list(RankBalancedBatchSampler(costs, 4, seed=3, rank=r, world_size=2, group_lengths=lengths))
             for r in range(2)}
    for b in range(len(dealt[0])):
        together = grouped[0][b * 4:(b + 1) * 4] + grouped[1][b * 4:(b + 1) * 4]
        assert sorted(dealt[0][b] + dealt[1][b]) == sorted(together)
    assert any(dealt[0][b] != grouped[0][b * 4:(b + 1) * 4] for b in range(len(dealt[0])))  # dealt, not strided


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


def _spec(batch_size: int, balance: str, data: dict | None = None, **extra) -> TrainSpec:
    cost = {"per_token": 1.0, "per_token_pair": 0.01}
    return TrainSpec(**{"max_steps": 3, "batch_size": batch_size, "micro_batch_size": 2, "device": "cpu", "seed": 0,
                        "optimizer": {"name": "sgd", "lr": 0.5}, "log": {"progress": "off"}, **extra,
                        "data": {"rank_balance": balance, "rank_balance_cost": cost, **(data or {})}})


def _params(trainer) -> dict[str, torch.Tensor]:
    """Every parameter, whole (FSDP2's shards gathered), as float64 copies."""
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().double().clone()
            for n, p in trainer.engine.module.named_parameters()}


COMPOSED = {"cost+token-budget": {"micro_batch_tokens": 160}}  # shares split by tokens: the same gradient


# ---- the compositions: each trained with `off` and `cost` in the one 2-rank launch -------------------------------
class OneImagePerGlobalBatch(torch.utils.data.Dataset):
    """Zoo LLaVA samples with an image only in the first of every 8 (a global batch, unshuffled). Dealt by cost (an
    image costs 1,000 tokens), rank 0 gets that sample alone and rank 1 the 7 text-only ones: rank 1 never runs the
    vision tower unless modality sync stands in for it (else DDP waits for the tower's gradients)."""

    def __init__(self, samples: list[dict]) -> None:
        self.samples = [{**samples[i % 8], "images": samples[0]["images"][:1] if i % 8 == 0 else []}
                        for i in range(16)]
        self.lengths = [len(s["text"].split()) for s in self.samples]
        self.image_counts = [len(s["images"]) for s in self.samples]

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, i: int) -> dict:
        return self.samples[i]


def _lm_task():
    torch.manual_seed(0)
    return TinyCausalLM().double(), LongTailed(), pad


def _vlm_task():
    from vlmfast.models import TinyVLMConfig, build_tiny_vlm_task

    small = TinyVLMConfig(vision_dim=32, text_dim=32, vision_heads=2, text_heads=2, vision_layers=1, text_layers=2)
    model, data, collate = build_tiny_vlm_task(seed=0, num_samples=16, config=small)
    return model.double(), data, Float64(collate)


@functools.cache
def _llava_case():
    from zoo.cases import build_case

    return build_case("llava")


def _llava_task():
    case = _llava_case()  # built once per process, its model copied per run
    return copy.deepcopy(case.model).double(), OneImagePerGlobalBatch(case.samples), case.collate_fn


TOWER = ["vision_tower", "multi_modal_projector"]
TASKS = {"lm": _lm_task, "vlm": _vlm_task, "llava": _llava_task}
# name: (task, spec fields, data fields); each trained on 2 ranks with rank_balance off and cost
COMPOSITIONS = {
    "grouping": ("lm", {}, {"group_by_length": "length"}),
    "packing": ("vlm", {"packing": {"enabled": True, "max_tokens": 64}, "micro_batch_size": 1}, {}),
    # 16 samples, 8 per step: step 3 is epoch 2, every image's features read from the store whichever rank wrote them
    "vision-cache": ("vlm", {"optimizer": {"name": "sgd", "lr": 0.5, "freeze": TOWER},
                             "vision_cache": {"enabled": True}}, {}),
    # LLaVA reads the tower's hidden_states[-2]: its last layer and post_layernorm never get a gradient (frozen, as in
    # test_rank_symmetry.py, so that only the modality mismatch is tested)
    "modality-sync": ("llava", {"max_steps": 2, "optimizer": {"name": "sgd", "lr": 0.5,
                                                              "freeze": ["post_layernorm", "encoder.layers.1"]}},
                      {"shuffle": False, "rank_balance_cost": {"per_token": 1.0, "per_image": 1000.0}}),
}
# the deal under the sharding engines: trained with `cost` only, compared to the DDP runs' `off` and `cost`
ENGINES = {"fsdp2": {"engine": "fsdp"}, "zero2": {"engine": "deepspeed", "deepspeed": {"zero_stage": 2}}}
if importlib.util.find_spec("deepspeed") is None:
    del ENGINES["zero2"]


def _trained(history: list[dict]) -> list[tuple[int, int]]:
    """(samples, real tokens) this rank trained at each step, as the loop counted them."""
    return [(h["samples"], h["tokens"]) for h in history]


def _dealt(trainer, data, steps: int) -> list[tuple[int, int]]:
    """(samples, real tokens) of this rank's share at each step, worked out here from the parts: the epoch's order
    (the seeded permutation, or grouping's), cut into global batches of 8, each dealt by :func:`deal` on the samples'
    metadata; the tokens counted on each sample collated alone, as the loop counts them."""
    from vlmfast.data.batch import count_input_tokens
    from vlmfast.data.packing import packed_batch_counts
    from vlmfast.data.rank_balance import sample_metadata
    from vlmfast.data.samplers import dataset_lengths, grouped_order

    spec, seed, width = trainer.spec.data, trainer.spec.seed, 8
    costs = CostModel(**spec.rank_balance_cost.model_dump()).costs(*sample_metadata(data))
    counts = []
    for step in range(steps):
        epoch, b = divmod(step, len(data) // width)
        if spec.group_by_length != "none":
            order = grouped_order(dataset_lengths(data, spec.group_by_length), width, mode=spec.group_by_length,
                                  seed=seed, epoch=epoch, shuffle=spec.shuffle)
        elif spec.shuffle:  # EpochSampler's permutation
            order = torch.randperm(len(data), generator=torch.Generator().manual_seed(seed * 100_003 + epoch)).tolist()
        else:
            order = list(range(len(data)))
        batch = order[b * width:(b + 1) * width]
        share = [batch[p] for p in deal([costs[i] for i in batch], 2)[trainer.rank]]
        singles = [trainer.collate_fn([data[i]]) for i in share]
        counts.append((len(share), sum(packed_batch_counts(x)[1] if trainer.spec.packing.enabled
                                       else count_input_tokens(x) for x in singles)))
    return counts


def _run(task: str, balance: str, fields: dict, data_fields: dict | None = None) -> dict:
    model, data, collate = TASKS[task]()
    initial = {n: p.detach().double().clone() for n, p in model.named_parameters()}
    trainer = OptimizedTrainer(model, data, _spec(4, balance, data_fields, **fields), collate_fn=collate)
    history = trainer.fit().history
    stand_ins = next((s.stand_ins for s in trainer.strategies if s.name == "modality_sync"), None)
    return {"params": _params(trainer), "initial": initial, "history": history, "trained": _trained(history),
            "dealt": _dealt(trainer, data, trainer.spec.max_steps) if balance != "off" else None,
            "stand_ins": stand_ins}


def _two_rank_runs(root: str) -> dict:
    torch.set_num_threads(1)  # tiny models: one intra-op thread per rank on a shared machine
    out = {}
    for balance in ("off", "cost", *COMPOSED):
        torch.manual_seed(0)
        spec = _spec(4, balance.split("+")[0], **COMPOSED.get(balance, {}))
        trainer = OptimizedTrainer(TinyCausalLM().double(), LongTailed(), spec, collate_fn=pad)
        result = trainer.fit()
        out[balance] = {"params": _params(trainer), "history": result.history, "trained": _trained(result.history)}
    for name, (task, fields, data_fields) in COMPOSITIONS.items():
        for balance in ("off", "cost"):
            if "vision_cache" in fields:  # one store per run, shared by both ranks
                fields = {**fields, "vision_cache": {"enabled": True, "dir": f"{root}/cache-{balance}"}}
            out[f"{name}/{balance}"] = _run(task, balance, fields, data_fields)
    for name, fields in ENGINES.items():
        out[name] = _run("lm", "cost", fields)
    save = {"dir": f"{root}/checkpoints", "every_steps": 2, "resume": "auto"}  # stopped after step 2, resumed to 3
    for steps in (2, 3):
        torch.manual_seed(0)
        trainer = OptimizedTrainer(TinyCausalLM().double(), LongTailed(), _spec(4, "cost", save=save)
                                   .model_copy(update={"max_steps": steps}), collate_fn=pad)
        result = trainer.fit()
    out["resumed"] = {"params": _params(trainer), "from": str(result.resumed_from)}
    return out


def _relative(params: dict, reference: dict, initial: dict | None = None) -> float:
    """||params - reference|| on the scale of the reference (of its update from `initial`, when given)."""
    diff = torch.cat([(params[n] - p).flatten() for n, p in reference.items()]).norm()
    scale = torch.cat([(p - (initial[n] if initial else 0)).flatten() for n, p in reference.items()]).norm()
    return float(diff / scale)


@pytest.mark.timeout(400)
def test_two_ranks_with_cost_balance_train_as_one_process_with_the_global_batch(tmp_path):
    ranks = spawn_two_ranks(_two_rank_runs, tmp_path, "balance", str(tmp_path))
    torch.manual_seed(0)
    one = OptimizedTrainer(TinyCausalLM().double(), LongTailed(), _spec(8, "off"), collate_fn=pad)
    one.fit()
    reference = _params(one)
    for rank in ranks:
        for balance in ("off", "cost", *COMPOSED, *ENGINES):  # composed with a token budget, FSDP2, ZeRO-2: the same
            assert _relative(rank[balance]["params"], reference) <= 1e-6, balance
    balanced = ranks[0]["cost"]["history"]
    dealt = [h["balance/imbalance"] for h in balanced]
    positional = [h["balance/imbalance_positional"] for h in balanced]
    assert all(d <= p + 1e-9 for d, p in zip(dealt, positional, strict=True)) and sum(dealt) < sum(positional)
    assert [h["balance/imbalance"] for h in ranks[1]["cost"]["history"]] == dealt  # every rank dealt alike
    assert "balance/imbalance" not in ranks[0]["off"]["history"][0]
    for rank in ranks:  # the token budget and the engines trained the deal's shares (not the positional ones)
        assert rank["cost"]["trained"] != rank["off"]["trained"]
        for name in (*COMPOSED, *ENGINES):
            assert rank[name]["trained"] == rank["cost"]["trained"], name
            assert [h["balance/imbalance"] for h in rank[name]["history"]] == dealt, name
        for name in ENGINES:
            assert rank[name]["trained"] == rank[name]["dealt"], name
    for rank in ranks:  # per-rank compute up to the last gradient, and the spread the ranks agreed on
        assert all(h["balance/compute_s"] > 0 for h in rank["cost"]["history"])
    spread = [[h["balance/straggler_s"] for h in rank["cost"]["history"]] for rank in ranks]
    assert spread[0] == spread[1] and all(s >= 0 for s in spread[0])
    assert "balance/compute_s" not in ranks[0]["off"]["history"][0]  # log.straggler off, no balance: not measured
    for rank in ranks:  # resumed at step 2: the same deal of step 3, bit-exact
        assert rank["resumed"]["from"].endswith("step_00000002")
        assert all(torch.equal(rank["resumed"]["params"][n], p) for n, p in rank["cost"]["params"].items())

    # Each composition: the same update as `off` (float64, norm-relative 1e-6), while each rank trained exactly its
    # share of the deal (samples and real tokens per step), which differs from the positional deal's on this data.
    for name in COMPOSITIONS:
        for rank in ranks:
            off, cost = rank[f"{name}/off"], rank[f"{name}/cost"]
            assert _relative(cost["params"], off["params"], off["initial"]) <= 1e-6, name
            assert cost["trained"] == cost["dealt"], name
            assert cost["trained"] != off["trained"], name  # a skipped deal would train the positional shares
            assert [h["loss"] for h in cost["history"]] == pytest.approx([h["loss"] for h in off["history"]],
                                                                         rel=1e-6), name
    sync = [rank["modality-sync/cost"] for rank in ranks]
    assert [n for n, _ in sync[0]["trained"]] == [1, 1] and [n for n, _ in sync[1]["trained"]] == [7, 7]
    assert sync[1]["stand_ins"] > 0  # text only on rank 1: the image path ran with weight 0 there
    for rank in ranks:  # epoch 2 (step 3): every image of the share read from the store, whichever rank wrote it
        cached = rank["vision-cache/cost"]
        assert cached["history"][2]["vision_cache/hits"] == cached["trained"][2][0]


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
