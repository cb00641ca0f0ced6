"""Resume anywhere (issue 37): a run stopped on N ranks continues on M ranks, or with another engine, on the same
trajectory, as long as the global batch (ranks x batch_size) is unchanged. float64, no dropout: every continuation
ends within 1e-6 (norm-relative) of the uninterrupted run, Adam's moments and step counts included; one 2-rank launch
holds every 2-rank case."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import Float64, TinyCausalLM, TokenDataset, spawn_two_ranks

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.checkpoints.store import load_checkpoint
from vlmfast.engines.portable_state import state_transfer_refusal
from vlmfast.engines.zero_load import gather_full_state
from vlmfast.engines.zero_state import full_state_from_zero
from vlmfast.spec import SpecError

GLOBAL_BATCH, STEPS = 8, 4


def spec(directory: Path, world_size: int, engine: str = "ddp", resume: str = "never", lora: bool = False,
         zero_stage: int = 2, steps: int = STEPS) -> TrainSpec:
    return TrainSpec(max_steps=steps, batch_size=GLOBAL_BATCH // world_size, engine=engine, seed=0,
                     optimizer={"lr": 1e-2}, log={"progress": "off", "dir": str(directory / "log")},
                     save={"dir": str(directory), "every_steps": 2, "resume": resume},
                     lora={"enabled": lora, "r": 4}, deepspeed={"zero_stage": zero_stage})


def train(directory: Path, world_size: int, engine: str = "ddp", resume: str = "never",
          lora: bool = False, zero_stage: int = 2, dtype: torch.dtype = torch.float64,
          steps: int = STEPS) -> OptimizedTrainer:
    torch.manual_seed(0)  # the same initial weights on every rank and in every run
    trainer = OptimizedTrainer(TinyCausalLM().to(dtype), TokenDataset(64),
                               spec(directory, world_size, engine, resume, lora, zero_stage, steps))
    trainer.fit_result = trainer.fit()
    return trainer


def _two_rank_cases(root: str, single_run: str) -> dict:
    """On each of 2 ranks: DDP and FSDP2 runs from scratch (their step-2 checkpoints are resumed elsewhere), then
    1 -> 2 ranks, DDP -> FSDP2 and FSDP2 -> DDP continuations from step 2, a LoRA run and the tiny VLM's run with
    packing, rank balance and the token budget (both resumed on one rank by the tests); last (DeepSpeed patches
    torch for the rest of the process) a ZeRO-2 run, resumed on one rank by the test, and the DDP -> ZeRO-3
    (float32: ZeRO-3 partitions no float64), ZeRO-2 -> ZeRO-1 and FSDP2 -> ZeRO-0 (fp32) continuations; ZeRO-1/3's
    final fp32 masters and Adam state are gathered here with DeepSpeed's accessors (every rank takes part)."""
    root_path = Path(root)
    train(root_path / "ddp2", 2)
    train(root_path / "fsdp2", 2, engine="fsdp")
    resharded = train(root_path / "one_to_two", 2, resume=str(Path(single_run) / "step_00000002"))
    train(root_path / "ddp_to_fsdp", 2, engine="fsdp", resume=str(root_path / "ddp2" / "step_00000002"))
    train(root_path / "fsdp_to_ddp", 2, resume=str(root_path / "fsdp2" / "step_00000002"))
    train(root_path / "lora_fsdp2", 2, engine="fsdp", lora=True)  # resumed on one rank by the test
    vlm, seen = train_vlm(root_path / "vlm2", 2)  # packed, balanced, budgeted: resumed on one rank by the test
    vlm_case = {"steps": seen.steps, "packed": seen.packed, "history": vlm.fit_result.history}
    train(root_path / "zero2", 2, engine="deepspeed", zero_stage=2)  # float64 weights, fp32 masters in DeepSpeed
    into_zero = {}
    for case, stage, source, dtype in (("ddp_to_zero3", 3, "ddp2", torch.float32),  # a numbered optimizer state
                                       ("zero2_to_zero1", 1, "zero2", torch.float64),  # merged (named), then loaded
                                       ("fsdp_to_zero0", 0, "fsdp2", torch.float32)):  # ZeRO-0 reduces no float64
        trainer = train(root_path / case, 2, engine="deepspeed", zero_stage=stage, dtype=dtype,
                        resume=str(root_path / source / "step_00000002"))
        if stage:  # ZeRO-0 has no partitions: its step-4 checkpoint is read by the test
            into_zero[case] = gather_full_state(trainer.engine.engine, trainer.engine.module)
    return {"resharded": resharded.resharded, "into_zero": into_zero, "vlm": vlm_case}


Moments = list[tuple[float, float, float]]


def final_state(directory: Path, steps: int = STEPS) -> tuple[dict[str, torch.Tensor], Moments]:
    """The last (step-4) checkpoint's weights, and Adam's per-parameter (step, |exp_avg|, |exp_avg_sq|), sorted: the
    same whether the optimizer state numbers its parameters (one process, DDP) or names them (FSDP2)."""
    state = load_checkpoint(directory / f"step_{steps:08d}")["engine"]
    moments = sorted((float(s["step"]), float(s["exp_avg"].norm()), float(s["exp_avg_sq"].norm()))
                     for s in state["optimizer"]["state"].values())
    return state["model"], moments


def assert_same_run(actual: Path, expected: Path) -> None:
    assert_same_state(actual.name, *final_state(actual), expected)


def assert_same_state(label: str, weights: dict[str, torch.Tensor], moments: Moments,
                      expected: Path, steps: int = STEPS) -> None:
    reference, reference_moments = final_state(expected, steps)
    assert weights.keys() == reference.keys()
    difference = torch.cat([(weights[k].double() - reference[k].double()).flatten() for k in reference]).norm()
    scale = torch.cat([reference[k].double().flatten() for k in reference]).norm()
    assert difference <= 1e-6 * scale, f"{label}: weights off by {difference / scale:.2e} of their norm"
    assert [m[0] for m in moments] == [m[0] for m in reference_moments] == [float(steps)] * len(moments)
    flat = [value for moment in moments for value in moment[1:]]
    assert flat == pytest.approx([v for m in reference_moments for v in m[1:]], rel=1e-6), \
        f"{label}: Adam's moments differ"


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
@pytest.mark.parametrize("case", ["ddp_to_zero3", "zero2_to_zero1"])
def test_a_full_state_continues_in_deepspeed_zero_with_its_moments_and_step_counts(runs, case):
    """A DDP checkpoint (numbered optimizer state) of step 2 loaded into ZeRO-3, a ZeRO-2 one (merged into a named
    full state, as FSDP2's) into ZeRO-1, on 2 ranks (vlmfast.engines.zero_load): the fp32 masters, Adam's exp_avg /
    exp_avg_sq and steps at step 4 are the uninterrupted float64 run's within 1e-6 (measured: ZeRO-3 in float32
    ~1e-7, the rounding of float32 itself): moments or steps reset at the resume would be off by far more."""
    gathered = torch.load(runs / "cases.0", weights_only=False)["into_zero"][case]
    moments = sorted((float(s["step"]), float(s["exp_avg"].double().norm()), float(s["exp_avg_sq"].double().norm()))
                     for s in gathered["optimizer"]["state"].values())
    assert_same_state(case, gathered["model"], moments, runs / "single")


def test_zero0_in_fp32_takes_a_full_state_and_gives_one_back(runs):
    """FSDP2 (named optimizer state) -> ZeRO-0 in fp32 on 2 ranks (DeepSpeed steps vlmfast's own optimizer: loaded as
    DDP loads it); its step-4 checkpoint read back as the full state another engine loads (the module and the
    optimizer state DeepSpeed saved beside it) is the uninterrupted float64 run's within 1e-6."""
    state = full_state_from_zero(runs / "fsdp_to_zero0" / f"step_{STEPS:08d}" / "deepspeed")
    moments = sorted((float(s["step"]), float(s["exp_avg"].double().norm()), float(s["exp_avg_sq"].double().norm()))
                     for s in state["optimizer"]["state"].values())
    assert_same_state("fsdp_to_zero0", state["model"], moments, runs / "single")


@pytest.mark.timeout(600)
def test_a_zero3_checkpoint_of_two_ranks_continues_on_one_ddp_rank(runs, tmp_path):
    """ZeRO-3's shards (each parameter cut into padded slices per rank, Adam's flat state over them per sub-group)
    merged with DeepSpeed's zero_to_fp32._zero3_merge_trainable_params: the step-4 state of the DDP -> ZeRO-3 run
    (float32) continued on one float64 DDP rank to step 6 ends within 1e-6 of the uninterrupted 6-step run."""
    train(tmp_path / "single", 1, steps=6)
    trainer = train(tmp_path / "resumed", 1, steps=6, resume=str(runs / "ddp_to_zero3" / f"step_{STEPS:08d}"))
    assert trainer.resharded["from_engine"] == "deepspeed" and trainer.fit_result.history[0]["step"] == STEPS + 1
    weights, moments = final_state(tmp_path / "resumed", 6)
    assert_same_state("zero3_to_ddp", weights, moments, tmp_path / "single", 6)


@pytest.mark.timeout(600)
def test_samples_and_tokens_seen_are_summed_over_ranks(runs):
    """Two ranks hold different token counts in a step; the run's counters are their sum (one all-reduce with the
    loss), the single process's figures, not rank 0's x 2."""
    seen = [load_checkpoint(runs / run / f"step_{STEPS:08d}")["trainer"] for run in ("single", "ddp2", "fsdp2")]
    assert [(s["samples_seen"], s["tokens_seen"]) for s in seen] == [(seen[0]["samples_seen"],
                                                                     seen[0]["tokens_seen"])] * 3
    steps = [json.loads(line) for line in (runs / "ddp2" / "log" / "metrics.jsonl").read_text().splitlines()
             if '"global_tokens"' in line]
    assert sum(m["global_tokens"] for m in steps) == seen[0]["tokens_seen"]
    assert any(m["tokens"] * 2 != m["global_tokens"] for m in steps), "the ranks' shares should differ here"


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


def test_impossible_engine_pairs_are_refused_naming_both_sides():
    ddp, zero = TrainSpec(batch_size=8), TrainSpec(batch_size=8, engine="deepspeed")
    assert state_transfer_refusal({"engine": "ddp"}, 2, TrainSpec(batch_size=4, engine="fsdp"), 2) is None
    assert state_transfer_refusal({"engine": "deepspeed", "deepspeed": {"zero_stage": 1}}, 2, ddp, 1) is None
    zero0 = {"engine": "deepspeed", "deepspeed": {"zero_stage": 0}, "precision": "bf16"}  # DeepSpeed's bf16 wrapper
    assert "engine 'deepspeed' (ZeRO-0, precision bf16) -> 'ddp'" in state_transfer_refusal(zero0, 1, ddp, 1)
    assert state_transfer_refusal({**zero0, "precision": "fp32"}, 1, ddp, 1) is None
    assert state_transfer_refusal({"engine": "deepspeed", "deepspeed": {"zero_stage": 3}}, 2, ddp, 1) is None
    assert state_transfer_refusal({"engine": "ddp"}, 1, zero, 2) is None  # into ZeRO-1/2/3: vlmfast.engines.zero_load
    into_zero0 = TrainSpec(batch_size=8, engine="deepspeed", deepspeed={"zero_stage": 0}, precision="bf16")
    assert "engine 'fsdp' -> 'deepspeed' (ZeRO-0) with precision bf16" in state_transfer_refusal(
        {"engine": "fsdp"}, 1, into_zero0, 1)
    assert state_transfer_refusal({"engine": "fsdp"}, 1, into_zero0.model_copy(update={"precision": "fp32"}), 1) is None
    factored = TrainSpec(batch_size=8, engine="deepspeed", optimizer={"name": "adafactor"})
    assert "engine 'ddp' -> 'deepspeed' (ZeRO-2): optimizer.name 'adafactor'" in state_transfer_refusal(
        {"engine": "ddp"}, 1, factored, 1)
    assert state_transfer_refusal({"engine": "deepspeed"}, 2, zero, 1) is None  # ZeRO-2 shards merged, loaded
    assert "engine 'deepspeed' (ZeRO-0) on 2 rank(s) -> ZeRO-2 on 1" in state_transfer_refusal(zero0, 2, zero, 1)


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


# ---- the tiny VLM with packing, rank balance and the token budget, 2 ranks -> 1 -------------------------------------
def _fingerprint(pixels: torch.Tensor) -> tuple[float, float]:
    return round(float(pixels.double().sum()), 6), round(float(pixels.double().square().sum()), 6)


class SeenSamples:
    """Which samples each optimizer step trained on this rank: a forward pre-hook knows each sample by its image (packed
    rows, token-budget micro-batches and the engine's wrapper alike); on_step_end closes the step. `packed`: a call
    got fewer rows than images."""

    def __init__(self, model: torch.nn.Module, data, collate) -> None:
        self.index = {_fingerprint(collate([data[i]])["pixel_values"][0]): i for i in range(len(data))}
        assert len(self.index) == len(data), "every sample's image differs"
        self.steps: list[list[int]] = []
        self.current: set[int] = set()
        self.packed = False
        model.register_forward_pre_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs) -> None:
        pixels, ids = kwargs["pixel_values"], kwargs["input_ids"]
        images = [p for p in pixels.reshape(-1, *pixels.shape[-3:]) if p.any()]  # packed: [rows, images, ...], padded
        self.current |= {self.index[_fingerprint(p)] for p in images}
        self.packed |= ids.shape[0] < len(images)

    def on_fit_start(self, trainer) -> None:
        self.current = set()  # the packing check's forward at build time is no step

    def on_step_end(self, trainer, metrics) -> None:
        self.steps.append(sorted(self.current))
        self.current = set()


def train_vlm(directory: Path, world_size: int, resume: str = "never") -> tuple[OptimizedTrainer, SeenSamples]:
    """4 steps of 8 samples (2 epochs of 16) on the tiny VLM in float64: packed rows (64 tokens), dealt by cost,
    micro-batches cut by a 96-token budget; saved at step 2."""
    from vlmfast.models import TinyVLMConfig, build_tiny_vlm_task

    small = TinyVLMConfig(vision_dim=32, text_dim=32, vision_heads=2, text_heads=2, vision_layers=1, text_layers=2)
    model, data, collate = build_tiny_vlm_task(seed=0, num_samples=16, config=small)
    model, collate = model.double(), Float64(collate)
    seen = SeenSamples(model, data, collate)
    spec = TrainSpec(max_steps=STEPS, batch_size=GLOBAL_BATCH // world_size, seed=0, optimizer={"lr": 1e-2},
                     packing={"enabled": True, "max_tokens": 64}, micro_batch_tokens=96,
                     data={"rank_balance": "cost"}, log={"progress": "off", "dir": str(directory / "log")},
                     save={"dir": str(directory), "every_steps": 2, "resume": resume})
    trainer = OptimizedTrainer(model, data, spec, collate_fn=collate, callbacks=[seen])
    trainer.fit_result = trainer.fit()
    return trainer, seen


@pytest.mark.timeout(600)
def test_the_tiny_vlm_packed_balanced_and_budgeted_continues_from_two_ranks_on_one(runs, tmp_path):
    """Packed rows, shares dealt by cost and micro-batches cut by a token budget on 2 ranks for 4 steps; continued from
    step 2 on one rank, every step trains the uninterrupted run's global batch, sample by sample, and the run ends on
    its weights and Adam state (1e-6)."""
    ranks = [torch.load(runs / f"cases.{rank}", weights_only=False)["vlm"] for rank in range(2)]
    resumed, continued = train_vlm(tmp_path, 1, resume=str(runs / "vlm2" / "step_00000002"))
    assert resumed.resharded["from_world_size"] == 2 and resumed.fit_result.history[0]["step"] == 3
    assert all(not set(a) & set(b) for a, b in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True))
    uninterrupted = [sorted(set(a) | set(b)) for a, b in zip(ranks[0]["steps"], ranks[1]["steps"], strict=True)]
    assert all(len(batch) == GLOBAL_BATCH for batch in uninterrupted)
    assert sorted(uninterrupted[0] + uninterrupted[1]) == list(range(16))  # an epoch: every sample once
    assert continued.steps == uninterrupted[2:], "the continuation on one rank takes the same global batches"
    # each piece was at work: packed rows, the cost deal, more than one micro-batch per step under the budget
    assert ranks[0]["packed"] and ranks[1]["packed"] and continued.packed
    history = ranks[0]["history"]
    assert "balance/imbalance" in history[0] and all(h["accumulation_steps"] > 1 for h in history)
    assert all(h["accumulation_steps"] > 1 for h in resumed.fit_result.history)
    assert_same_run(tmp_path, runs / "vlm2")
