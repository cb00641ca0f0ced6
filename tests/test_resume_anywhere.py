"""Resume anywhere (issue 37): a run stopped on N ranks continues on M ranks, or with another engine, on the same
trajectory, as long as the global batch (ranks x batch_size) is unchanged. float64, no dropout: every continuation
ends within 1e-6 (norm-relative) of the uninterrupted run, Adam's moments and step counts included; one 2-rank launch
holds every 2-rank case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TinyCausalLM, TokenDataset, spawn_two_ranks

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.checkpoints.store import load_checkpoint
from vlmfast.engines.portable_state import state_transfer_refusal
from vlmfast.spec import SpecError

GLOBAL_BATCH, STEPS = 8, 4


def spec(directory: Path, world_size: int, engine: str = "ddp", resume: str = "never", lora: bool = False,
         zero_stage: int = 2) -> TrainSpec:
    return TrainSpec(max_steps=STEPS, batch_size=GLOBAL_BATCH // world_size, engine=engine, seed=0,
                     optimizer={"lr": 1e-2}, log={"progress": "off", "dir": str(directory / "log")},
                     save={"dir": str(directory), "every_steps": 2, "resume": resume},
                     lora={"enabled": lora, "r": 4}, deepspeed={"zero_stage": zero_stage})


def train(directory: Path, world_size: int, engine: str = "ddp", resume: str = "never",
          lora: bool = False, zero_stage: int = 2) -> OptimizedTrainer:
    torch.manual_seed(0)  # the same initial weights on every rank and in every run
    trainer = OptimizedTrainer(TinyCausalLM().double(), TokenDataset(64),
                               spec(directory, world_size, engine, resume, lora, zero_stage))
    trainer.fit_result = trainer.fit()
    return trainer


def _two_rank_cases(root: str, single_run: str) -> dict:
    """On each of 2 ranks: DDP and FSDP2 runs from scratch (their step-2 checkpoints are resumed elsewhere), then
    1 -> 2 ranks, DDP -> FSDP2 and FSDP2 -> DDP continuations from step 2; last (DeepSpeed patches torch for the
    rest of the process) a ZeRO-2 run, resumed on one rank by the test."""
    root_path = Path(root)
    train(root_path / "ddp2", 2)
    train(root_path / "fsdp2", 2, engine="fsdp")
    resharded = train(root_path / "one_to_two", 2, resume=str(Path(single_run) / "step_00000002"))
    train(root_path / "ddp_to_fsdp", 2, engine="fsdp", resume=str(root_path / "ddp2" / "step_00000002"))
    train(root_path / "fsdp_to_ddp", 2, resume=str(root_path / "fsdp2" / "step_00000002"))
    train(root_path / "lora_fsdp2", 2, engine="fsdp", lora=True)  # resumed on one rank by the test
    train(root_path / "zero2", 2, engine="deepspeed", zero_stage=2)  # float64 weights, fp32 masters in DeepSpeed
    return {"resharded": resharded.resharded}


def final_state(directory: Path) -> tuple[dict[str, torch.Tensor], list[tuple[float, float, float]]]:
    """The step-4 checkpoint's weights, and Adam's per-parameter (step, |exp_avg|, |exp_avg_sq|), sorted: the same
    whether the optimizer state numbers its parameters (one process, DDP) or names them (FSDP2)."""
    state = load_checkpoint(directory / f"step_{STEPS:08d}")["engine"]
    moments = sorted((float(s["step"]), float(s["exp_avg"].norm()), float(s["exp_avg_sq"].norm()))
                     for s in state["optimizer"]["state"].values())
    return state["model"], moments


def assert_same_run(actual: Path, expected: Path) -> None:
    weights, moments = final_state(actual)
    reference, reference_moments = final_state(expected)
    assert weights.keys() == reference.keys()
    difference = torch.cat([(weights[k].double() - reference[k].double()).flatten() for k in reference]).norm()
    scale = torch.cat([reference[k].double().flatten() for k in reference]).norm()
    assert difference <= 1e-6 * scale, f"{actual.name}: weights off by {difference / scale:.2e} of their norm"
    assert [m[0] for m in moments] == [m[0] for m in reference_moments] == [float(STEPS)] * len(moments)
    flat = [value for moment in moments for value in moment[1:]]
    assert flat == pytest.approx([v for m in reference_moments for v in m[1:]], rel=1e-6), \
        f"{actual.name}: Adam's moments differ"


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("anywhere")
    train(root / "single", 1)  # the uninterrupted reference: 1 rank x 8
    ranks = spawn_two_ranks(_two_rank_cases, root, "cases", str(root), str(root / "single"))
    assert ranks[0]["resharded"]["from_world_size"] == 1 and ranks[0]["resharded"]["world_size"] == 2
    return root


@pytest.mark.timeout(600)
@pytest.mark.parametrize("case", ["ddp2", "fsdp2", "one_to_two", "ddp_to_fsdp", "fsdp_to_ddp"])
def test_two_rank_runs_and_continuations_end_where_one_process_does(runs, case):
    assert_same_run(runs / case, runs / "single")


@pytest.mark.timeout(600)
def test_lora_adapters_move_from_two_fsdp2_ranks_to_one_process(runs, tmp_path):
    train(tmp_path / "single", 1, lora=True)  # the uninterrupted LoRA run
    trainer = train(tmp_path / "resumed", 1, resume=str(runs / "lora_fsdp2" / "step_00000002"), lora=True)
    assert trainer.resharded["from_engine"] == "fsdp"
    weights, _ = final_state(tmp_path / "resumed")
    assert weights and all("lora_" in name for name in weights)  # the adapters alone: the base is fingerprinted
    assert_same_run(tmp_path / "resumed", tmp_path / "single")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("source", ["ddp2", "fsdp2"])
def test_a_two_rank_run_continues_on_one_rank_with_the_global_batch(runs, source, tmp_path):
    trainer = train(tmp_path, 1, resume=str(runs / source / "step_00000002"))
    assert trainer.resharded["from_world_size"] == 2 and trainer.resharded["from_engine"] == source[:-1]
    assert_same_run(tmp_path, runs / "single")
    events = [json.loads(line) for line in (tmp_path / "log" / "metrics.jsonl").read_text().splitlines()
              if '"event"' in line]
    assert [(e["event"], e["step"], e["world_size"], e["from_world_size"], e["batch_size"]) for e in events] == [
        ("resumed", 2, 1, 2, 8)]
    assert "from 2 x 4 with engine" in trainer.fit_result.report.extra["resumed"]  # the run report says it


@pytest.mark.timeout(600)
def test_a_zero2_checkpoint_of_two_ranks_continues_on_one_ddp_rank(runs, tmp_path):
    """The ZeRO-2 shards (fp32 master slices, Adam's flat exp_avg / exp_avg_sq slices per rank) are merged into the full
    state: the continuation ends where the uninterrupted float64 run does (DeepSpeed's fp32 masters round the
    step-2 state to float32: far below 1e-6), Adam's moments and step counts carried over."""
    trainer = train(tmp_path, 1, resume=str(runs / "zero2" / "step_00000002"))
    assert trainer.resharded["from_engine"] == "deepspeed" and trainer.resharded["from_world_size"] == 2
    assert_same_run(tmp_path, runs / "single")


def test_a_deepspeed_checkpoint_does_not_move_to_another_engine_or_rank_count_and_says_both_sides():
    ddp, zero = TrainSpec(batch_size=8), TrainSpec(batch_size=8, engine="deepspeed")
    assert state_transfer_refusal({"engine": "ddp"}, 2, TrainSpec(batch_size=4, engine="fsdp"), 2) is None
    assert state_transfer_refusal({"engine": "deepspeed", "deepspeed": {"zero_stage": 1}}, 2, ddp, 1) is None
    zero3 = {"engine": "deepspeed", "deepspeed": {"zero_stage": 3}}
    assert "engine 'deepspeed' (ZeRO-3) -> 'ddp'" in state_transfer_refusal(zero3, 1, ddp, 1)
    assert "engine 'ddp' -> 'deepspeed'" in state_transfer_refusal({"engine": "ddp"}, 1, zero, 1)
    assert "on 2 rank(s) -> 1" in state_transfer_refusal({"engine": "deepspeed"}, 2, zero, 1)


def test_a_resume_with_another_global_batch_is_refused_before_any_step(runs, tmp_path):
    with pytest.raises(SpecError, match=r"global batch is 1 rank\(s\) x batch_size 8 = 8 samples, this run's 1 x 4"):
        torch.manual_seed(0)
        trainer = OptimizedTrainer(TinyCausalLM().double(), TokenDataset(64), spec(tmp_path, 1, resume=str(
            runs / "single" / "step_00000002")).model_copy(update={"batch_size": 4}))
        trainer.fit()


class Indexed(torch.utils.data.Dataset):
    """Sample i is its index; long-tailed lengths and 0-2 images for rank balance and length grouping."""

    def __init__(self, n: int = 40) -> None:
        self.lengths = [8 + (i * 37) % 97 for i in range(n)]
        self.modality_lengths = [n if i % 3 else -n for i, n in enumerate(self.lengths)]
        self.image_counts = [i % 3 for i in range(n)]

    def __len__(self) -> int:
        return len(self.lengths)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"index": torch.tensor(i)}


def global_batches(data_spec: dict, world_size: int, steps: int, start: dict | None = None) -> list[set[int]]:
    """The samples of each step over all ranks (each rank's loader built as that rank's trainer builds it)."""
    from vlmfast.data import ResumableLoader
    from vlmfast.spec import DataSpec

    per_rank = []
    for rank in range(world_size):
        loader = ResumableLoader(Indexed(), GLOBAL_BATCH // world_size, DataSpec(**data_spec), seed=3, rank=rank,
                                 world_size=world_size)
        if start is not None:
            loader.load_state_dict(start)
        loader.start(steps)
        per_rank.append([set(next(loader)["index"].tolist()) for _ in range(steps)])
        loader.close()
    return [set().union(*(batches[step] for batches in per_rank)) for step in range(steps)]


@pytest.mark.parametrize("data_spec", [
    {}, {"group_by_length": "modality_length"}, {"rank_balance": "tokens"},
    {"rank_balance": "cost", "group_by_length": "length"}], ids=["plain", "grouped", "balanced", "balanced-grouped"])
def test_every_step_deals_the_same_global_batch_on_any_rank_count_and_after_a_resume(data_spec):
    one = global_batches(data_spec, 1, 12)  # 40 samples, 8 per step: 5 steps an epoch, so 2.4 epochs
    assert all(len(batch) == GLOBAL_BATCH for batch in one)
    assert global_batches(data_spec, 2, 12) == one == global_batches(data_spec, 4, 12)
    resumed = global_batches(data_spec, 4, 5, start={"epoch": 1, "batch_in_epoch": 2})  # 1 rank's position, on 4
    assert resumed == one[7:12], "sample by sample, the continuation on 4 ranks takes the uninterrupted run's batches"
