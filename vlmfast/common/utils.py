"""Small helpers shared by the trainer and the strategies."""

from __future__ import annotations

import contextlib
import logging
import os
import random
import threading
from collections.abc import Iterator

import numpy as np
import torch

PRECISION_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}  # spec name -> dtype


def unwrap_model(model: torch.nn.Module) -> torch.nn.Module:
    """The user's module inside a DDP / DeepSpeed wrapper (`.module`), or the model itself."""
    return getattr(model, "module", model)


def resolve_device(name: str) -> torch.device:
    """'auto' -> the current CUDA device when available, else CPU; anything else as torch reads it."""
    if name == "auto":
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch (all devices)."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def derived_seed(seed: int, step: int, rank: int) -> int:
    """A rank's seed at a step, from the run's seed: for generators that cannot be carried over (a resume on another
    number of ranks). Usage: ``seed_everything(derived_seed(spec.seed, state.step, rank))``"""
    return (seed * 1_000_003 + step * 8_191 + rank * 131_071 + 1) % 2**63


def rng_state() -> dict:
    """Every RNG state that can change a training trajectory, as tensors and ints (loadable with weights_only)."""
    version, mt_state, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "state": torch.tensor(mt_state, dtype=torch.int64), "gauss": gauss},
        "numpy": {"kind": kind, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": pos,
                  "has_gauss": has_gauss, "cached": cached},
        "torch": torch.get_rng_state(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what :func:`rng_state` captured."""
    py = state["python"]
    random.setstate((py["version"], tuple(py["state"].tolist()), py["gauss"]))
    npy = state["numpy"]
    np.random.set_state((npy["kind"], npy["keys"].numpy().astype(np.uint32), npy["pos"], npy["has_gauss"],
                         npy["cached"]))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


@contextlib.contextmanager
def notice_if_slow(message: str, after_s: float = 10.0, logger: logging.Logger | None = None) -> Iterator[None]:
    """Log `message` (a warning) if the block is still running after `after_s` seconds: for waits that are silent
    and long only sometimes (DeepSpeed compiling its ops on first use). Nothing is logged for a quick block.

    Usage: ``with notice_if_slow("DeepSpeed is building its ops ..."): deepspeed.initialize(...)``
    """
    done = threading.Event()
    logger = logger or logging.getLogger("vlmfast")

    def watch() -> None:
        if not done.wait(after_s):
            logger.warning("%s", message)

    watcher = threading.Thread(target=watch, name="vlmfast-notice", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        done.set()


# torch.profiler's C++ side (kineto) prints "USDT: ... SyncActivityProfilerHandler.cpp:52] profiler_start" (and
# profiler_stop) on stderr each time a profiler starts and stops; those lines are its level 5, and it reads
# KINETO_LOG_LEVEL once, when this process first uses a profiler. Level 6 keeps all of its log off the terminal.
KINETO_QUIET_LEVEL = "6"


def quiet_profiler_log() -> None:
    """Keep kineto's log lines off stderr, unless the user set KINETO_LOG_LEVEL: call it before any profiler starts.

    Usage: ``quiet_profiler_log(); with torch.profiler.profile(...): ...``
    """
    os.environ.setdefault("KINETO_LOG_LEVEL", KINETO_QUIET_LEVEL)
