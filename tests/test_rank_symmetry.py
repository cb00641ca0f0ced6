"""Ranks never desynchronise: whatever each rank's data, every rank runs the same micro-batches and collectives.

Two gloo ranks per engine (DDP with `sync_each_micro_batch`, ZeRO-2, ZeRO-3, FSDP2), one spawned pair running every
scenario in turn (process start-up is most of the cost):

- a zero-token micro-batch on one rank (an image-and-prompt-only sample): a loop that skipped it would run a different
  number of backward passes (and of reductions) per rank;
- packing where the ranks' shards have very different lengths, so they pack into different numbers of rows;
- images on one rank and none on the other (Hugging Face LLaVA from the zoo, which skips its vision tower on a
  text-only batch): the text-only rank runs the image path with weight 0 (vlmfast.strategies.modality_sync), else
  DDP waits for the tower's gradients and ZeRO-2 / ZeRO-3 / FSDP2 abort with a gloo size mismatch;
- dropout, saved at step 2 and resumed on 2 ranks: bit-identical to the run that never stopped (per-rank RNG);
- the 2-rank checkpoint resumed in one process with the same batch_size: refused, naming the global batches.

Under these engines every backward reduces, so a rank that skips a micro-batch hangs or mismatches. Each run must
finish, leave identical parameters on both ranks, and equal one process with the global batch.
"""

from __future__ import annotations

import os
import re
import socket
import sys

import pytest
import torch
from conftest import TinyCausalLM, TokenDataset, spawn_two_ranks

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.spec import SpecError

ENGINES = {
    "ddp-sync-each": {"ddp": {"sync_each_micro_batch": True}},
    "zero2": {"engine": "deepspeed", "deepspeed": {"zero_stage": 2}},
    "zero3": {"engine": "deepspeed", "deepspeed": {"zero_stage": 3}},
    "fsdp2": {"engine": "fsdp"},
}
PACKING = {"enabled": True, "max_tokens": 32}
PACKED = {"packing": PACKING, "micro_batch_size": 1, "optimizer": {"name": "sgd", "lr": 0.05}}


class PromptOnlySamples(TokenDataset):
    """Samples 1 and 3 carry no loss token: with rank-strided shards they are rank 1's first micro-batch."""

    def __init__(self) -> None:
        super().__init__(64)
        self.batch["labels"][[1, 3]] = -100


class UnevenCaptions(torch.utils.data.Dataset):
    """Tiny-VLM samples whose odd indices (rank 1's shard) keep 3 caption tokens: in rows of 32 tokens rank 0's long
    samples pack one to a row, rank 1's short ones two, so the ranks run 4 and 2 micro-batches of one row."""

    def __init__(self, dataset: torch.utils.data.Dataset) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return 32

    def __getitem__(self, i: int) -> dict:
        sample = dict(self.dataset[i])
        if i % 2:
            sample["input_ids"] = sample["input_ids"][:3]
        return sample


class ImagesOnRankZero(torch.utils.data.Dataset):
    """Zoo LLaVA samples with images only at indices 0 and 2 (mod 8): with rank-strided shards and micro-batches of
    2, rank 0's first micro-batch of each step has images and every other micro-batch (all of rank 1's) has none."""

    def __init__(self, samples: list[dict]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return 16

    def __getitem__(self, i: int) -> dict:
        sample = self.samples[i % 8]
        return {**sample, "images": sample["images"] if i % 8 in (0, 2) else []}


def llava_task():
    from zoo.cases import build_case

    case = build_case("llava")
    return case.model, ImagesOnRankZero(case.samples), case.collate_fn


# LLaVA reads the tower's hidden_states[-2] and never its pooler: those parameters get no gradient on any rank, which
# DDP refuses whatever the data (freeze them, or find_unused_parameters); frozen here so that only the modality
# mismatch is tested.
LLAVA = {"max_steps": 2, "optimizer": {"name": "sgd", "lr": 0.5, "freeze": ["post_layernorm", "encoder.layers.1"]}}


def spec(batch_size: int, **overrides) -> dict:
    return {"max_steps": 3, "batch_size": batch_size, "micro_batch_size": batch_size // 2,
            "optimizer": {"name": "sgd", "lr": 0.5}, "data": {"shuffle": False}, "log": {"progress": "off"},
            **overrides}


def packing_task():
    from vlmfast.models import build_tiny_vlm_task

    model, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=32)
    return model, UnevenCaptions(dataset), collate


def full_params(trainer: OptimizedTrainer) -> dict[str, torch.Tensor]:
    """Every parameter, whole (gathered from ZeRO-3 partitions and FSDP2 shards), as float32 copies."""
    module = trainer.engine.module
    if trainer.spec.engine == "deepspeed" and trainer.spec.deepspeed.zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            return {n: p.detach().float().clone() for n, p in module.named_parameters()}
    return {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().float().clone()
            for n, p in module.named_parameters()}


def run(model, data, spec_dict: dict, collate=None) -> dict:
    trainer = OptimizedTrainer(model, data, TrainSpec(**spec_dict), collate_fn=collate)
    result = trainer.fit()
    stand_ins = next((s.stand_ins for s in trainer.strategies if s.name == "modality_sync"), None)
    return {"params": full_params(trainer), "losses": [m["loss"] for m in result.history], "stand_ins": stand_ins}


def _worker(engine: dict, save_dir: str) -> dict:
    out = {}
    torch.manual_seed(0)
    out["zero_token"] = run(TinyCausalLM(), PromptOnlySamples(), spec(4, **engine))
    model, data, collate = packing_task()
    out["packing"] = run(model, data, spec(4, **engine, **PACKED), collate)
    model, data, collate = llava_task()
    out["modalities"] = run(model, data, spec(4, **engine, **LLAVA), collate)
    # Dropout: the run that never stops saves at step 2; the resumed one continues from there on 2 ranks.
    saving = spec(4, **engine, max_steps=4, save={"dir": save_dir, "every_steps": 2, "keep_last": 5})
    torch.manual_seed(0)
    out["dropout"] = run(TinyCausalLM(dropout=0.3), TokenDataset(64), saving)
    resumed = {**saving, "save": {**saving["save"], "dir": f"{save_dir}-resumed",
                                  "resume": f"{save_dir}/step_00000002"}}
    torch.manual_seed(1)  # a different initial state: everything must come from the checkpoint
    out["dropout_resumed"] = run(TinyCausalLM(dropout=0.3), TokenDataset(64), resumed)
    if int(os.environ["RANK"]) == 0:
        out["one_rank_resume"] = _resume_on_one_rank(resumed)
    return out


def _resume_on_one_rank(resumed: dict) -> str:
    """Leave the 2-rank group and resume the same checkpoint as a 1-process run (in this fresh process)."""
    if "deepspeed" in sys.modules:  # DeepSpeed keeps its own references to the 2-rank group: released with it
        sys.modules["deepspeed"].comm.destroy_process_group()
    else:
        torch.distributed.destroy_process_group()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_PORT=str(port))
    try:
        run(TinyCausalLM(dropout=0.3), TokenDataset(64), resumed)
    except SpecError as exc:
        return str(exc)
    return "resumed without complaint"


@pytest.fixture(scope="module", params=list(ENGINES))
def two_ranks(request, tmp_path_factory) -> tuple[str, list[dict]]:
    """Every scenario on 2 gloo ranks under one engine: one spawned pair per engine."""
    engine = request.param
    if ENGINES[engine].get("engine") == "deepspeed":
        pytest.importorskip("deepspeed")
    tmp_path = tmp_path_factory.mktemp(engine)
    return engine, spawn_two_ranks(_worker, tmp_path, engine, ENGINES[engine], str(tmp_path / "ckpt"))


def one_process(model, data, spec_dict: dict, collate=None) -> dict:
    trainer = OptimizedTrainer(model, data, TrainSpec(**spec_dict), collate_fn=collate)
    result = trainer.fit()
    return {"params": {n: p.detach().float().clone() for n, p in trainer.model.named_parameters()},
            "losses": [m["loss"] for m in result.history]}


def assert_ranks_equal_one_process(ranks: list[dict], reference: dict, initial: dict | None = None) -> None:
    """Both ranks hold bit-identical parameters, equal to one process's (the update norm-relative to 1e-5 when the
    initial parameters are given), and the same logged losses."""
    for name in reference["params"]:
        torch.testing.assert_close(ranks[0]["params"][name], ranks[1]["params"][name], rtol=0, atol=0)
    if initial is None:
        for name, value in reference["params"].items():
            torch.testing.assert_close(ranks[0]["params"][name], value, rtol=1e-5, atol=1e-6)
    else:  # the update, on the scale of the whole update (a packed run sums in another order)
        from conftest import assert_gradients_close

        assert_gradients_close({n: p - initial[n] for n, p in ranks[0]["params"].items()},
                               {n: p - initial[n] for n, p in reference["params"].items()}, rtol=1e-5)
    assert ranks[0]["losses"] == pytest.approx(reference["losses"], rel=1e-5)


@pytest.mark.timeout(400)
def test_a_zero_token_micro_batch_on_one_rank_keeps_ranks_in_step(two_ranks):
    torch.manual_seed(0)
    reference = one_process(TinyCausalLM(), PromptOnlySamples(), spec(8))
    assert_ranks_equal_one_process([r["zero_token"] for r in two_ranks[1]], reference)


def packed_rows_per_rank() -> list[list[int]]:
    """Packed rows of each rank's batch of 4 at each of the 3 steps (rank-strided shards, as the loader deals them)."""
    from vlmfast.data.packing import PackingCollator

    model, data, collate = packing_task()
    packer = PackingCollator(max_tokens=PACKING["max_tokens"], collate_fn=collate,
                             image_tokens=model.prepended_image_tokens)
    return [[packer([data[i] for i in range(8 * step + rank, 8 * step + 8, 2)])["input_ids"].shape[0]
             for step in range(3)] for rank in range(2)]


@pytest.mark.timeout(400)
def test_packing_into_different_row_counts_per_rank_keeps_ranks_in_step(two_ranks):
    rows = packed_rows_per_rank()
    assert all(r0 > r1 for r0, r1 in zip(*rows, strict=True)), rows  # rank 0 runs more micro-batches of one row
    model, data, collate = packing_task()
    initial = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    reference = one_process(model, data, spec(8, **PACKED), collate)
    assert_ranks_equal_one_process([r["packing"] for r in two_ranks[1]], reference, initial)


@pytest.mark.timeout(400)
def test_two_rank_resume_with_dropout_is_bit_identical(two_ranks):
    ranks = two_ranks[1]
    for rank in ranks:
        uninterrupted, resumed = rank["dropout"], rank["dropout_resumed"]
        assert resumed["losses"] == uninterrupted["losses"][2:]  # steps 3 and 4, bit for bit
        for name, value in uninterrupted["params"].items():
            torch.testing.assert_close(resumed["params"][name], value, rtol=0, atol=0)


@pytest.mark.timeout(400)
def test_a_two_rank_checkpoint_resumed_on_one_rank_with_half_the_global_batch_is_refused(two_ranks):
    message = two_ranks[1][0]["one_rank_resume"]  # DeepSpeed's shards are merged now: the batch decides, as for all
    halved = r"global batch is 2 rank\(s\) x batch_size (\d+) = (\d+) samples, this run's 1 x \1 = "
    assert re.search(halved, message), message
    assert "set batch_size: " in message and "to continue on 1 rank(s)" in message and "save.resume: never" in message



@pytest.mark.timeout(400)
def test_images_on_one_rank_and_none_on_the_other_keep_ranks_in_step(two_ranks):
    ranks = [r["modalities"] for r in two_ranks[1]]
    # Rank 1 stands in where rank 0's micro-batch has images (the first of each step), and under DDP (every
    # parameter in every backward) on every micro-batch without images, on both ranks
    steps = LLAVA["max_steps"]
    expected = [steps, 2 * steps] if two_ranks[0].startswith("ddp") else [0, steps]
    assert [r["stand_ins"] for r in ranks] == expected
    model, data, collate = llava_task()
    initial = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    reference = one_process(model, data, spec(8, **LLAVA), collate)
    assert_ranks_equal_one_process(ranks, reference, initial)
