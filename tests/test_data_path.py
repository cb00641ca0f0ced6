"""A data path that never stalls the device (issue 33): worker processes start once, before the first step; nothing
is read past what max_steps needs (mid-epoch and after a resume too); num_workers auto picks the fewest workers that
keep up with the step; and the batches (and each sample's random numbers) are those of one epoch at a time."""

from __future__ import annotations

import json
import multiprocessing.process
import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import Dataset, get_worker_info

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.data import EpochSampler, ResumableLoader
from vlmfast.data import autotune as autotune_module
from vlmfast.data.autotune import autotune_num_workers
from vlmfast.spec import DataSpec

SAMPLES, BATCH = 12, 4  # 3 batches per epoch


class CountedReads(Dataset):
    """Sample i is (x = i, y = i); reads made in DataLoader workers are counted per index, in shared memory."""

    def __init__(self, n: int = SAMPLES) -> None:
        self.reads = torch.zeros(n, dtype=torch.int64).share_memory_()

    def __len__(self) -> int:
        return len(self.reads)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if get_worker_info() is not None:  # the trainer's probes (fingerprint, checks) read in the main process
            self.reads[i] += 1
        return {"x": torch.full((4,), float(i)), "y": torch.tensor(float(i)), "noise": torch.rand(())}


class Regression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 1)

    def forward(self, x, y, noise):
        return ((self.linear(x).squeeze(-1) - y) ** 2).mean()


class StopAt:
    """A callback that asks the run to stop after `step` (the final checkpoint is written)."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_step_end(self, trainer: OptimizedTrainer, metrics: dict[str, Any]) -> None:
        trainer.should_stop = metrics["step"] >= self.step


def spec(**overrides: Any) -> TrainSpec:
    data = {"num_workers": 1, "device_prefetch": True} | overrides.pop("data", {})
    return TrainSpec(**{"max_steps": 9, "batch_size": BATCH, "data": data, "log": {"progress": "off"}} | overrides)


def test_worker_processes_start_once_before_the_first_step_over_three_epochs(monkeypatch):
    started_at: list[int] = []
    trainer: OptimizedTrainer | None = None
    start = multiprocessing.process.BaseProcess.start

    def counted_start(self):  # every start method goes through BaseProcess.start in the parent
        started_at.append(trainer.state.step if trainer is not None else -1)
        return start(self)

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", counted_start)
    trainer = OptimizedTrainer(Regression(), CountedReads(), spec(data={"num_workers": 2}))  # 9 steps: 3 epochs
    result = trainer.fit()
    assert len(result.history) == 9 and trainer.loader.state_dict() == {"epoch": 2, "batch_in_epoch": 3}
    assert started_at == [0, 0], f"worker starts at steps {started_at}: workers must start once, before step 1"


@pytest.mark.parametrize("max_steps", [9, 5])  # the run ends exactly at the end of the data; mid-epoch
def test_no_sample_is_read_past_what_max_steps_needs(max_steps):
    data = CountedReads()
    OptimizedTrainer(Regression(), data, spec(max_steps=max_steps)).fit()
    assert int(data.reads.sum()) == max_steps * BATCH, data.reads.tolist()


def test_a_resumed_run_reads_only_the_batches_it_still_needs(tmp_path):
    save = {"dir": str(tmp_path), "every_steps": 100}
    first = CountedReads()
    OptimizedTrainer(Regression(), first, spec(max_steps=7, save=save), callbacks=[StopAt(2)]).fit()
    assert int(first.reads.sum()) <= 7 * BATCH  # stopped by a callback: it had read ahead, never past step 7
    second = CountedReads()
    trainer = OptimizedTrainer(Regression(), second, spec(max_steps=7, save=save))
    result = trainer.fit()
    assert result.resumed_from is not None and trainer.state.step == 7
    assert int(second.reads.sum()) == 5 * BATCH, second.reads.tolist()


class StubLoader:
    """A loader whose batches take 80 ms / workers of a fake clock (in the process: 80 ms)."""

    def __init__(self, workers: int, clock: list[float], started: list[int]) -> None:
        self.per_batch = 0.080 / max(workers, 1)
        self.clock = clock
        started.append(workers)

    def __iter__(self):
        while True:
            self.clock[0] += self.per_batch
            yield {}


def test_num_workers_auto_picks_the_fewest_workers_that_keep_up_with_the_step(monkeypatch):
    clock, started = [0.0], []
    monkeypatch.setattr(autotune_module.time, "perf_counter", lambda: clock[0])
    monkeypatch.setattr(autotune_module, "max_worker_count", lambda limit: (limit, "autotune_max_workers"))  # any CPU
    make = lambda n: StubLoader(n, clock, started)  # noqa: E731
    # a 100 ms step needs 10 batches/s, x1.5: 15; 1 worker loads 12.5/s, 2 workers 25/s
    choice = autotune_num_workers(make, budget_s=5.0, max_workers=8, step_s=0.100)
    assert choice.num_workers == 2 and choice.step_s == 0.100, choice.reason
    assert started == [0, 1, 2], "no count above the first that keeps up is ever started"
    assert "the fewest that load 25.0 batches/s" in choice.reason
    started.clear()
    slow_step = autotune_num_workers(make, budget_s=5.0, max_workers=8, step_s=0.5)  # 3 batches/s: 1 worker
    assert slow_step.num_workers == 1
    started.clear()
    unknown = autotune_num_workers(make, budget_s=5.0, max_workers=8)  # no step time: the fewest near the fastest
    assert unknown.num_workers == 8 and started == [0, 1, 2, 4, 8]


def batches_of(loader: ResumableLoader, count: int) -> list[tuple[list[int], list[float]]]:
    out = []
    for _ in range(count):
        batch = next(loader)
        out.append((batch["y"].long().tolist(), batch["noise"].tolist()))
    return out


def test_the_batches_are_each_epochs_permutation_and_their_random_numbers_do_not_depend_on_workers_or_resume():
    data, seed = CountedReads(), 3
    sampler = EpochSampler(SAMPLES, seed=seed, shuffle=True)
    expected = []
    for epoch in range(3):  # one epoch at a time, as a per-epoch DataLoader iteration takes them
        sampler.set_position(epoch, 0)
        order = list(sampler)
        expected += [order[b * BATCH:(b + 1) * BATCH] for b in range(SAMPLES // BATCH)]
    one = ResumableLoader(data, BATCH, DataSpec(num_workers=1), seed)
    one.start(9)
    reference = batches_of(one, 9)
    with pytest.raises(StopIteration):  # nothing past the run's 9 batches
        next(one)
    one.close()
    assert [ids for ids, _ in reference] == expected
    three = ResumableLoader(data, BATCH, DataSpec(num_workers=3), seed)
    three.start(9)
    assert batches_of(three, 9) == reference, "a sample's random numbers depend on its seed, epoch and index only"
    three.close()
    resumed = ResumableLoader(data, BATCH, DataSpec(num_workers=2), seed)
    resumed.load_state_dict({"epoch": 1, "batch_in_epoch": 1})
    resumed.start(5)
    assert batches_of(resumed, 5) == reference[4:]
    resumed.close()


def test_the_device_bound_stand_in_runs_every_layout_and_counts_forks_while_training(tmp_path):
    from vlmfast.bench.device_bound import main

    out = tmp_path / "device_bound.json"
    result = main(["--step-ms", "20", "--ballast-gb", "0", "--workers", "1", "--batch-size", "4", "--steps", "6",
                   "--warmup", "1", "--rounds", "1", "--contenders", "hand-written,vlmfast", "--out", str(out)])
    assert set(result["median"]) == {"end", "mid", "epochs"}
    epochs = result["median"]["epochs"]
    assert epochs["vlmfast"]["samples_in_data"] == 8  # 7 steps of 4 over 8 samples: 3.5 epochs
    for row in (row for by in result["median"].values() for row in by.values()):
        assert len(row["step_times_s"]) == 6 and 0 < row["fraction_of_limit"] <= 1.05
        assert row["p90_over_p50"] >= 1 and 2 <= row["slowest_step"] <= 7
    assert epochs["vlmfast"]["forks_during_training"] == 0  # its workers start once, before the first step
    assert any(line.startswith("epochs: vs hand-written") for line in result["verdicts"])
    assert json.loads(out.read_text())["median"]["end"]["hand-written"]["step_times_s"]


class SlowReads(CountedReads):
    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        time.sleep(0.005)  # 20 ms per batch of 4 in one process
        return super().__getitem__(i)


class SlowStep(Regression):
    def forward(self, x, y, noise):
        time.sleep(0.03)  # forward 30 ms: a step of ~90 ms, ~11 batches/s
        return super().forward(x, y, noise)


def test_the_trainer_sizes_auto_workers_by_its_estimated_step_and_reports_why():
    trainer = OptimizedTrainer(SlowStep(), SlowReads(), spec(max_steps=2, data={
        "num_workers": "auto", "autotune_budget_s": 1.5, "device_prefetch": False}))
    choice = trainer.loader.autotune
    assert choice.step_s is not None and 0.06 <= choice.step_s <= 1.0  # 3 x 30 ms, and a loaded machine's slack
    assert choice.num_workers == 1, choice.reason  # 1 worker loads ~50 batches/s, the step needs ~17 with margin
    assert "ms per step, estimated before training" in choice.reason
    result = trainer.fit()
    assert any(line.startswith("data: num_workers auto picked 1 workers") for line in result.report.strategies)


def test_vlmfast_bench_runs_the_stand_in_with_device_bound():
    from vlmfast.bench.cli import build_parser

    args = build_parser().parse_args(["--device-bound", "150", "--quick"])
    assert args.device_bound == 150.0 and args.run.__name__ == "run_bench"


@pytest.mark.parametrize("persistent", [True, False])
def test_a_closed_loader_reads_on_from_its_position_with_new_workers(persistent):
    """The doctor reads a few batches after training (fit closed the loader) and puts the position back."""
    from vlmfast.data.prefetch import DevicePrefetcher

    data = DataSpec(num_workers=1, persistent_workers=persistent)
    loader = DevicePrefetcher(ResumableLoader(CountedReads(), BATCH, data, seed=0), torch.device("cpu"))
    loader.start(2)
    first = [next(loader)["y"].tolist() for _ in range(2)]
    loader.close()  # as fit() does at its end
    position = loader.state_dict()
    after = [next(loader)["y"].tolist() for _ in range(3)]  # no limit now: on into the next epoch
    loader.load_state_dict(position)
    assert [next(loader)["y"].tolist() for _ in range(3)] == after and first[1] != after[0]
    loader.close()
