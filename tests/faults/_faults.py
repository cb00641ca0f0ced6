"""Helpers of the fault-injection suite: small specs, training runs, and ranks that may die or hang."""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from conftest import TinyCausalLM, TokenDataset

from vlmfast import OptimizedTrainer, TrainSpec


def make_spec(**overrides: Any) -> TrainSpec:
    """12 steps of 8 samples in micro-batches of 2; nested dicts in `overrides` merge into the defaults."""
    base: dict[str, Any] = {
        "max_steps": 12,
        "batch_size": 8,
        "micro_batch_size": 2,
        "optimizer": {"lr": 1e-2},
        "log": {"progress": "off"},
    }
    for key, value in overrides.items():
        merge = isinstance(value, dict) and isinstance(base.get(key), dict)
        base[key] = {**base[key], **value} if merge else value
    return TrainSpec(**base)


def train(spec: TrainSpec, model: torch.nn.Module | None = None, data: Any = None, **kwargs: Any):
    """A fresh trainer on the tiny LM (same init every time: the trainer seeds), fitted; returns (trainer, result)."""
    torch.manual_seed(1234)
    trainer = OptimizedTrainer(model or TinyCausalLM(dropout=0.1), data or TokenDataset(64), spec, **kwargs)
    return trainer, trainer.fit()


@contextlib.contextmanager
def tiny_filesystem(path: Path, size: str) -> Iterator[Path]:
    """A tmpfs of `size` mounted at `path` (needs root and mount rights: the test is skipped elsewhere; the tests that
    inject ENOSPC cover the same code everywhere)."""
    import pytest

    path.mkdir()
    if os.geteuid() != 0:
        pytest.skip("mounting a tiny file system needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True)
    if done.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    model = getattr(model, "module", model)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def losses(result: Any) -> list[float]:
    return [m["loss"] for m in result.history]


# ---- several ranks that may die or hang ------------------------------------------------------------------------
@dataclass
class RankOutcome:
    """How one rank ended: its exit code (None: killed at the deadline), return value or error, and when."""

    rank: int
    exitcode: int | None
    result: Any = None
    error: str | None = None
    error_type: str | None = None
    ended_at: float | None = None  # time.time() when the worker returned or raised


def run_ranks(
    worker: Callable[..., Any],
    tmp_path: Path,
    *args: Any,
    timeout_s: float = 90.0,
    grace_s: float = 20.0,
    world_size: int = 2,
) -> list[RankOutcome]:
    """Run `worker(*args)` on `world_size` gloo ranks (fresh processes, the environment torchrun sets).

    Unlike torch.multiprocessing.spawn it neither kills the other ranks when one exits (a dead rank is the fault
    under test) nor waits forever: ranks still running after `timeout_s`, or `grace_s` after another rank exited,
    are killed and reported with exitcode None.
    """
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = multiprocessing.get_context("spawn")
    outputs = [tmp_path / f"rank{rank}.pt" for rank in range(world_size)]
    processes = [
        context.Process(target=_rank_main, args=(rank, world_size, port, worker, args, str(out)))
        for rank, out in enumerate(outputs)
    ]
    for process in processes:
        process.start()
    _wait(processes, timeout_s, grace_s)
    outcomes = []
    for rank, (process, out) in enumerate(zip(processes, outputs, strict=True)):
        if process.is_alive():
            process.kill()
            process.join()
            outcomes.append(RankOutcome(rank, None))
            continue
        saved = torch.load(out, weights_only=False) if out.exists() else {}
        outcomes.append(RankOutcome(rank, process.exitcode, **saved))
    return outcomes


def _wait(processes: list, timeout_s: float, grace_s: float) -> None:
    """Until all exit, `timeout_s` passes, or `grace_s` passes after the first one exited (a hung peer)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(p.is_alive() for p in processes):
        if any(not p.is_alive() for p in processes):
            deadline = min(deadline, time.monotonic() + grace_s)
        time.sleep(0.05)


def _rank_main(rank: int, world_size: int, port: int, worker: Callable[..., Any], args: tuple, out: str) -> None:
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
    torch.set_num_threads(1)  # two ranks on a small CI machine
    try:
        saved = {"result": worker(*args)}
    except Exception as exc:
        saved = {"error": str(exc), "error_type": type(exc).__name__}
    saved["ended_at"] = time.time()
    torch.save(saved, out)
    # No destroy_process_group: with a dead peer it can block; the process ends here either way.
    os._exit(0)
