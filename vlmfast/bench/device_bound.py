"""A GPU-bound training run, stood in for on a CPU: does a tool's data path keep the device busy?

On a GPU the host only launches work, and the step's time is the device's. Any host stall (a worker fork, an epoch
restart, a load on the critical path) shows up as idle device time. This benchmark reproduces that on a CPU: the
model's step costs ``step_ms`` of GIL-free time (``time.sleep`` in forward and backward, like a host waiting on
CUDA), the data is the ``gpu`` bench size's (224-px rendered scenes, captions, batch 32), and ``ballast_gb`` of
resident memory stands in for a CUDA process's host memory (forking a large process is what stalls). The limit is
``batch / step_ms``; each contender's samples/s is reported as a fraction of it, with p50, p90, the slowest step's
index and the worker processes started while steps ran.

Layouts: ``end`` (the run ends exactly at the end of the data: the first H200 lease's bench), ``mid`` (it ends
mid-epoch), ``epochs`` (it spans at least 3 epochs). Contenders, all with the same workers: the hand-written loop
(a DataLoader with persistent workers, as a careful user writes it), Accelerate, the Hugging Face Trainer, vlmfast.

Usage::

    python benchmarks/device_bound.py --step-ms 150 --ballast-gb 2 --workers 4 --rounds 3 --out result.json
    results = run_device_bound(DeviceBoundSettings(step_ms=150, workers=4))
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import multiprocessing.process
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader, Dataset

CONTENDERS = ("hand-written", "accelerate", "hf-trainer", "vlmfast")
LAYOUTS = {"end": 1.0, "mid": 1.5, "epochs": 1 / 3}  # data size as a share of the run's samples


@dataclass(frozen=True)
class DeviceBoundSettings:
    """What one comparison runs: step cost, host ballast, workers, steps, layouts, rounds, contenders."""

    step_ms: float = 150.0
    ballast_gb: float = 2.0
    workers: int = 4
    batch_size: int = 32
    image_size: int = 224  # the `gpu` size's
    steps: int = 20  # timed steps, after `warmup`
    warmup: int = 3
    layouts: tuple[str, ...] = tuple(LAYOUTS)
    rounds: int = 3
    contenders: tuple[str, ...] = CONTENDERS


class _SleepInBackward(torch.autograd.Function):
    """Identity whose backward sleeps: the backward half of a device step, GIL-free."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, seconds: float) -> Tensor:
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        time.sleep(ctx.seconds)
        return grad, None


@dataclass
class _Output:
    loss: Tensor
    logits: Tensor


class DeviceStandIn(nn.Module):
    """A model whose step costs `step_ms` of GIL-free time (a third in forward, two thirds in backward) and whose
    tiny loss reads the batch, so every tool's forward, loss and backward paths run. Usage: ``DeviceStandIn(150)``"""

    def __init__(self, step_ms: float) -> None:
        super().__init__()
        self.step_s = step_ms / 1e3
        self.scale = nn.Linear(1, 1)

    def forward(self, input_ids: Tensor, labels: Tensor | None = None, pixel_values: Tensor | None = None,
                **_: Any) -> _Output:
        time.sleep(self.step_s / 3)
        # reads the batch, cheaply: the host's work is the tool's and the data path's, not the stand-in's
        features = input_ids[:, :1].float() / 1e3
        if pixel_values is not None:
            features = features + pixel_values.flatten()[0] * 0
        logits = self.scale(features)
        loss = _SleepInBackward.apply(logits.pow(2).mean(), 2 * self.step_s / 3)
        return _Output(loss=loss, logits=logits)


class _Rows(Dataset):
    """The first `count` samples of the `gpu` size's caption data (rendered per read, as in training)."""

    def __init__(self, count: int, image_size: int) -> None:
        from vlmfast.models import ShapesCaptionDataset

        self.base = ShapesCaptionDataset(num_samples=count, seed=0, max_objects=8)
        self.image_size = image_size

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = self.base[index]
        return {k: sample[k] for k in ("image", "input_ids") if k in sample}


class _Clock:
    """Step ends, and worker processes started after the first step began (any start method)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self.forks_during_training = 0
        self._start = multiprocessing.process.BaseProcess.start

    @contextlib.contextmanager
    def counting_forks(self) -> Iterator[None]:
        clock, start = self, self._start

        def counted(process: Any) -> None:
            if len(clock.stamps) > 1:  # after the first step ended: a stall in the middle of the run
                clock.forks_during_training += 1
            start(process)

        multiprocessing.process.BaseProcess.start = counted  # type: ignore[method-assign]
        try:
            yield
        finally:
            multiprocessing.process.BaseProcess.start = start  # type: ignore[method-assign]

    def begin(self) -> None:
        self.stamps = [time.perf_counter()]

    def step(self) -> None:
        self.stamps.append(time.perf_counter())


def _plain_loader(data: Dataset, collate: Callable, settings: DeviceBoundSettings) -> DataLoader:
    workers = settings.workers
    return DataLoader(data, batch_size=settings.batch_size, shuffle=False, collate_fn=collate, drop_last=True,
                      num_workers=workers, persistent_workers=workers > 0)


def _epochs(loader: Any, steps: int) -> Iterator[Any]:
    """Batches of `loader`, epoch after epoch, `steps` of them (what a user's epoch loop does)."""
    done = 0
    while done < steps:
        for batch in loader:
            yield batch
            done += 1
            if done == steps:
                return


def _hand_written(data: Dataset, collate: Callable, settings: DeviceBoundSettings, clock: _Clock) -> None:
    model = DeviceStandIn(settings.step_ms)
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    clock.begin()
    for batch in _epochs(_plain_loader(data, collate, settings), settings.warmup + settings.steps):
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.step()


def _accelerate(data: Dataset, collate: Callable, settings: DeviceBoundSettings, clock: _Clock) -> None:
    from accelerate import Accelerator

    from vlmfast.bench.runners import _reset_accelerate_state

    _reset_accelerate_state()
    accelerator = Accelerator(cpu=True)
    model = DeviceStandIn(settings.step_ms)
    model, optimizer, loader = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3),
                                                   _plain_loader(data, collate, settings))
    clock.begin()
    for batch in _epochs(loader, settings.warmup + settings.steps):
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.step()
    _reset_accelerate_state()


def _hf_trainer(data: Dataset, collate: Callable, settings: DeviceBoundSettings, clock: _Clock) -> None:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from vlmfast.bench.runners import _reset_accelerate_state

    class Clock(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.begin()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            clock.step()

    class AsDict(nn.Module):
        accepts_loss_kwargs = False

        def __init__(self) -> None:
            super().__init__()
            self.model = DeviceStandIn(settings.step_ms)

        def forward(self, **batch: Tensor) -> dict[str, Tensor]:
            out = self.model(**batch)
            return {"loss": out.loss, "logits": out.logits}

    _reset_accelerate_state()
    workers = settings.workers
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, max_steps=settings.warmup + settings.steps, per_device_train_batch_size=settings.batch_size,
            learning_rate=1e-3, optim="sgd", report_to=[], save_strategy="no", eval_strategy="no",
            logging_strategy="no", disable_tqdm=True, use_cpu=True, remove_unused_columns=False,
            dataloader_drop_last=True, dataloader_num_workers=workers, dataloader_persistent_workers=workers > 0,
            train_sampling_strategy="sequential", max_grad_norm=0.0)
        Trainer(model=AsDict(), args=args, train_dataset=data, data_collator=collate, callbacks=[Clock()]).train()
    _reset_accelerate_state()


def _vlmfast(data: Dataset, collate: Callable, settings: DeviceBoundSettings, clock: _Clock) -> None:
    from vlmfast import Callback, OptimizedTrainer, TrainSpec

    class Clock(Callback):
        def on_fit_start(self, trainer: Any) -> None:
            clock.begin()

        def on_step_end(self, trainer: Any, metrics: dict[str, Any]) -> None:
            clock.step()

    # vlmfast's best data path: its loader (the run's batches in one iteration) and the device prefetch
    spec = TrainSpec(seed=0, max_steps=settings.warmup + settings.steps, batch_size=settings.batch_size,
                     device="cpu", optimizer={"name": "sgd", "lr": 1e-3},
                     data={"shuffle": False, "num_workers": settings.workers, "device_prefetch": True},
                     log={"progress": "off"}, profile={"mfu": False}, memory={"leak_warmup_steps": 0},  # no FLOPs here
                     loss={"shift_labels": True})  # the stand-in's loss reads no labels: nothing to probe
    OptimizedTrainer(DeviceStandIn(settings.step_ms), data, spec, collate_fn=collate, callbacks=[Clock()]).fit()


RUNNERS: dict[str, Callable[[Dataset, Callable, DeviceBoundSettings, _Clock], None]] = {
    "hand-written": _hand_written, "accelerate": _accelerate, "hf-trainer": _hf_trainer, "vlmfast": _vlmfast}


def summarise(stamps: list[float], warmup: int, batch_size: int, step_ms: float) -> dict[str, Any]:
    """Per-step times after warm-up, samples/s as a share of the limit, p50, p90, p90/p50, the slowest step."""
    times = [b - a for a, b in itertools.pairwise(stamps)][warmup:]
    ordered = sorted(times)
    p50 = statistics.median(ordered)
    p90 = ordered[min(len(ordered) - 1, math.ceil(0.9 * len(ordered)) - 1)]
    samples_per_s = batch_size * len(times) / sum(times)
    slowest = max(range(len(times)), key=times.__getitem__)
    return {"step_times_s": times, "samples_per_s": samples_per_s,
            "fraction_of_limit": samples_per_s / (batch_size / (step_ms / 1e3)), "p50_ms": p50 * 1e3,
            "p90_ms": p90 * 1e3, "p90_over_p50": p90 / p50, "slowest_step": warmup + slowest + 1}


def run_device_bound(settings: DeviceBoundSettings) -> dict[str, Any]:
    """Every contender in every layout, rounds interleaved; the median round per (layout, contender)."""
    from vlmfast.models import VLMCollator

    collate = VLMCollator(image_size=settings.image_size, pad_id=0)
    run_samples = (settings.warmup + settings.steps) * settings.batch_size
    ballast = torch.ones(int(settings.ballast_gb * 2**30 / 4)) if settings.ballast_gb > 0 else None  # resident
    rows: dict[str, dict[str, list[dict[str, Any]]]] = {layout: {c: [] for c in settings.contenders}
                                                        for layout in settings.layouts}
    for _ in range(settings.rounds):
        for layout in settings.layouts:
            count = max(settings.batch_size, round(run_samples * LAYOUTS[layout] / settings.batch_size)
                        * settings.batch_size)
            for contender in settings.contenders:
                clock = _Clock()
                with clock.counting_forks():
                    RUNNERS[contender](_Rows(count, settings.image_size), collate, settings, clock)
                summary = summarise(clock.stamps, settings.warmup, settings.batch_size, settings.step_ms)
                summary["forks_during_training"] = clock.forks_during_training
                summary["samples_in_data"] = count
                rows[layout][contender].append(summary)
    del ballast
    medians = {layout: {c: _median_round(runs) for c, runs in by.items()} for layout, by in rows.items()}
    return {"settings": asdict(settings), "limit_samples_per_s": settings.batch_size / (settings.step_ms / 1e3),
            "median": medians, "rounds": rows}


def _median_round(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda r: r["samples_per_s"])
    middle = dict(ordered[len(ordered) // 2])
    middle["fraction_of_limit_by_round"] = [r["fraction_of_limit"] for r in runs]
    return middle


def render(result: dict[str, Any]) -> str:
    """A Markdown table per layout: fraction of the limit, p50, p90, p90/p50, slowest step, forks while training."""
    s = result["settings"]
    lines = [f"device-bound stand-in: {s['step_ms']:.0f} ms GIL-free step, batch {s['batch_size']}, "
             f"{s['workers']} workers, {s['ballast_gb']:g} GB ballast, {s['steps']} timed steps, {s['rounds']} "
             f"round(s) interleaved (median round); limit {result['limit_samples_per_s']:.1f} samples/s", ""]
    for layout, by in result["median"].items():
        lines += [f"layout `{layout}`", "",
                  "| contender | of limit | p50 ms | p90 ms | p90/p50 | slowest step | forks while training |",
                  "|---|---|---|---|---|---|---|"]
        for name, row in by.items():
            lines.append(f"| {name} | {row['fraction_of_limit']:.2f} | {row['p50_ms']:.0f} | {row['p90_ms']:.0f} | "
                         f"{row['p90_over_p50']:.2f} | {row['slowest_step']} | {row['forks_during_training']} |")
        lines.append("")
    return "\n".join(lines)


@dataclass
class Verdicts:
    """Issue 33's bar for vlmfast per layout: >= 0.97x the hand loop, >= Accelerate and the HF Trainer, p90/p50 <=
    1.3."""

    lines: list[str] = field(default_factory=list)

    @classmethod
    def of(cls, result: dict[str, Any]) -> Verdicts:
        verdicts = cls()
        for layout, by in result["median"].items():
            if "vlmfast" not in by:
                continue
            ours = by["vlmfast"]
            checks = [("p90/p50 <= 1.3", ours["p90_over_p50"] <= 1.3, f"{ours['p90_over_p50']:.2f}")]
            for peer, bar in (("hand-written", 0.97), ("accelerate", 1.0), ("hf-trainer", 1.0)):
                if peer in by:
                    ratio = ours["samples_per_s"] / by[peer]["samples_per_s"]
                    checks.append((f"vs {peer} >= {bar:g}", ratio >= bar, f"{ratio:.3f}"))
            verdicts.lines += [f"{layout}: {name} -> {value} ({'met' if ok else 'NOT met'})"
                               for name, ok, value in checks]
        return verdicts


def main(argv: list[str] | None = None) -> dict[str, Any]:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--step-ms", type=float, default=150.0)
    parser.add_argument("--ballast-gb", type=float, default=2.0)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--layouts", default=",".join(LAYOUTS))
    parser.add_argument("--contenders", default=",".join(CONTENDERS))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true", help="1 round, 6 timed steps, 0.5 GB ballast: it runs")
    parser.add_argument("--out", help="write the JSON (per-step times included) here")
    args = parser.parse_args(argv)
    settings = DeviceBoundSettings(
        step_ms=args.step_ms, ballast_gb=0.5 if args.quick else args.ballast_gb, workers=args.workers,
        batch_size=args.batch_size, steps=6 if args.quick else args.steps, warmup=args.warmup,
        layouts=tuple(args.layouts.split(",")), rounds=1 if args.quick else args.rounds,
        contenders=tuple(args.contenders.split(",")))
    unknown = set(settings.layouts) - set(LAYOUTS) | set(settings.contenders) - set(CONTENDERS)
    if unknown:
        parser.error(f"unknown layout or contender {sorted(unknown)}: layouts {list(LAYOUTS)}, contenders "
                     f"{list(CONTENDERS)}")
    result = run_device_bound(settings)
    result["verdicts"] = Verdicts.of(result).lines
    print(render(result))
    print("\n".join(result["verdicts"]))
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(result, handle, indent=1)
    return result
