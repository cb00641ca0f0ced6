"""The step-time hiccup of a checkpoint: save.async true vs false, on CPU, a model with >= 200 MB of state.

The model is a stack of 1024x1024 linear layers (about 17 M parameters: 67 MB of weights plus AdamW's two states,
so ~200 MB per checkpoint). One run trains `--steps` steps with a checkpoint every `--save-every` steps, through
OptimizedTrainer as users run it. A save's time falls into the next step's `step_time` (the trainer saves after
measuring a step); with save.async the background write runs during the following steps. So a save's hiccup is the
largest step time among the `--window` steps after it, minus the median step time of the steps far from any save.
Runs alternate between sync and async (interleaved rounds); each figure is the median over all saves of its kind.

Usage::

    python benchmarks/async_checkpoint.py                     # 3 rounds of 2 x 240 steps, 1 torch thread
    python benchmarks/async_checkpoint.py --rounds 5 --dir /mnt/nvme/tmp
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from _common import median, write_result
from torch import nn

from vlmfast import OptimizedTrainer, TrainSpec, run_checkpoints
from vlmfast.checkpoints.store import list_checkpoints


class Stack(nn.Module):
    """`layers` linear layers of `width`; returns the mean squared error against the target."""

    def __init__(self, layers: int, width: int) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(width, width), nn.Tanh()) for _ in range(layers)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.layers(x), y)


class Pairs(torch.utils.data.Dataset):
    def __init__(self, n: int, width: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def one_run(asynchronous: bool, args: argparse.Namespace, root: Path) -> dict[str, Any]:
    save_dir = root / ("async" if asynchronous else "sync")
    shutil.rmtree(save_dir, ignore_errors=True)
    torch.manual_seed(0)
    model = Stack(args.layers, args.width)
    spec = TrainSpec(max_steps=args.steps, batch_size=args.batch_size, optimizer={"lr": 1e-4},
                     save={"dir": str(save_dir), "every_steps": args.save_every, "keep_last": 2,
                           "async": asynchronous},
                     log={"progress": "off"}, memory={"leak_check": False, "timeline_plot": False},
                     profile={"timing": False, "mfu": False, "plots": False})
    trainer = OptimizedTrainer(model, Pairs(256, args.width), spec,
                               loss_fn=lambda m, batch: m(batch[0], batch[1]))
    blocked: list[float] = []
    real_save = run_checkpoints.save_trainer

    def timed_save(*args: Any, **kwargs: Any) -> Path:  # how long the training thread waits in each save
        start = time.perf_counter()
        try:
            return real_save(*args, **kwargs)
        finally:
            blocked.append(time.perf_counter() - start)

    run_checkpoints.save_trainer = timed_save
    try:
        result = trainer.fit()
    finally:
        run_checkpoints.save_trainer = real_save
    times = {m["step"]: m["step_time"] for m in result.history}
    saves = [s for s in range(args.save_every, args.steps, args.save_every)]
    near = {s + k for s in saves for k in range(1, args.window + 1)}
    calm = [t for step, t in times.items() if step not in near and step > args.warmup]
    base = median(calm)
    hiccups = [max(times[s + k] for k in range(1, args.window + 1) if s + k in times) - base for s in saves]
    state_bytes = sum(p.stat().st_size for p in list_checkpoints(save_dir)[-1].rglob("*") if p.is_file())
    copy_s = trainer._async_checkpointer.last_copy_s if asynchronous else None
    shutil.rmtree(save_dir, ignore_errors=True)
    waited = trainer._async_checkpointer.last_wait_s if asynchronous else None
    return {"median_step_s": base, "hiccups_s": hiccups, "checkpoint_bytes": state_bytes, "host_copy_s": copy_s,
            "last_save_waited_for_previous_s": waited,
            "blocked_s": blocked[:len(saves)]}  # the periodic saves (the final one waits for its write by design)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--save-every", type=int, default=60, help="far enough apart for the background write to "
                        "end before the next save on a busy machine (else the next save waits for it)")
    parser.add_argument("--window", type=int, default=6, help="steps after a save that can carry its cost")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dir", default=None, help="folder for the checkpoints (default: a temporary folder)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    root = Path(args.dir or tempfile.mkdtemp(prefix="vlmfast-async-bench-"))
    runs: dict[str, list[dict[str, Any]]] = {"sync": [], "async": []}
    for round_index in range(args.rounds):
        order = (False, True) if round_index % 2 == 0 else (True, False)  # interleaved, alternating first
        for asynchronous in order:
            run = one_run(asynchronous, args, root)
            runs["async" if asynchronous else "sync"].append(run)
            print(f"round {round_index + 1} {'async' if asynchronous else 'sync '}: median step "
                  f"{run['median_step_s'] * 1e3:.0f} ms, hiccups "
                  f"{', '.join(f'{h * 1e3:.0f}' for h in run['hiccups_s'])} ms, the step waited "
                  f"{', '.join(f'{b * 1e3:.0f}' for b in run['blocked_s'])} ms", flush=True)
    summary = {}
    for kind, results in runs.items():
        hiccups = [h for r in results for h in r["hiccups_s"]]
        summary[kind] = {"median_hiccup_s": median(hiccups), "max_hiccup_s": max(hiccups),
                         "median_blocked_s": median([b for r in results for b in r["blocked_s"]]),
                         "median_step_s": median([r["median_step_s"] for r in results]),
                         "checkpoint_mb": results[0]["checkpoint_bytes"] / 1e6}
    summary["async"]["median_host_copy_s"] = median([r["host_copy_s"] for r in runs["async"]])
    ratio = summary["sync"]["median_hiccup_s"] / max(summary["async"]["median_hiccup_s"], 1e-9)
    print(f"checkpoint {summary['sync']['checkpoint_mb']:.0f} MB; hiccup median sync "
          f"{summary['sync']['median_hiccup_s'] * 1e3:.0f} ms, async {summary['async']['median_hiccup_s'] * 1e3:.0f} "
          f"ms: {ratio:.1f}x smaller; the step waited {summary['sync']['median_blocked_s'] * 1e3:.0f} ms (sync) vs "
          f"{summary['async']['median_blocked_s'] * 1e3:.0f} ms (async: the host copy)")
    path = write_result("async_checkpoint", torch.device("cpu"),
                        {"args": vars(args), "summary": summary, "ratio_sync_over_async": ratio, "runs": runs,
                         "load_average": list(__import__("os").getloadavg()), "time": time.time()}, args.out)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
