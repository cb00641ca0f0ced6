"""MemoryMonitor: memory timeline, leak warnings, allocator-history snapshots and the timeline plot.

Usage::

    monitor = MemoryMonitor(spec.memory, device, log_dir=spec.log.dir)
    OptimizedTrainer(model, data, spec, callbacks=[monitor]).fit()
    monitor.leak_warnings, monitor.timeline          # memory_timeline.png is in log_dir

    # or in a hand-written loop:
    monitor.start()
    for step in range(1, steps + 1):
        train_step(); monitor.observe(step)
    monitor.finish()

A leak is reported by logging a warning and by ``warnings.warn(message, MemoryLeakWarning)``. MemoryLeakWarning is
a ResourceWarning, which Python hides by default, so a user sees the log line once while tests (``pytest.warns``)
and ``-W error::ResourceWarning`` still catch it.
"""

from __future__ import annotations

import dataclasses
import logging
import pickle
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from vlmfast.common.safe_files import library_output, open_for_writing
from vlmfast.memory.allocator import OOMSnapshots
from vlmfast.memory.leaks import LeakDetector, LeakWarning, TensorKind, live_tensor_census, tensor_growth
from vlmfast.memory.stats import GB, memory_stats
from vlmfast.spec import MemorySpec
from vlmfast.train.callbacks import Callback, OptimizedTrainer

if TYPE_CHECKING:
    from vlmfast.train.state import FitResult

log = logging.getLogger(__name__)

HISTORY_MAX_ENTRIES = 100_000  # allocator events kept by record_history: enough for several steps of a large model
TIMELINE_MAX_POINTS = 10_000  # beyond this, every other point is dropped: the monitor must not leak itself
SNAPSHOT_VIEWER = "https://pytorch.org/memory_viz"


class MemoryLeakWarning(ResourceWarning):
    """Category of the warning a :class:`MemoryMonitor` issues when memory grows steadily."""


class MemoryMonitor(Callback):
    """Records memory per step, warns on steady growth, plots the timeline, dumps allocator snapshots.

    Usage: ``OptimizedTrainer(..., callbacks=[MemoryMonitor(spec.memory, device, spec.log.dir)])``

    As a callback it reads the ``mem/*`` metrics the trainer already put in the step metrics, and reads memory
    itself on steps that have none, every `every_steps` steps. The default, every step, costs ~0.1 ms (no device
    sync) and lets the leak detector decide within one window; it needs 20 readings. `device` and `log_dir`
    default to the trainer's. The leak detector watches allocated memory on CUDA and the process RSS on CPU.
    """

    def __init__(self, spec: MemorySpec | None = None, device: torch.device | str | None = None,
                 log_dir: str | Path | None = None, every_steps: int = 1, census: bool = True) -> None:
        self.spec = spec if spec is not None else MemorySpec()
        self.device = torch.device(device) if device is not None else None
        self.log_dir = Path(log_dir) if log_dir is not None else None
        self.every_steps = every_steps
        self.census = census  # count live tensors at the window start and on a warning (one gc pass each)
        self.timeline: list[dict[str, float]] = []
        self.leak_warnings: list[LeakWarning] = []
        self.plot_path: Path | None = None
        self.detector = (LeakDetector(self.spec.leak_warmup_steps, self.spec.leak_window_steps,
                                      self.spec.leak_threshold_mb_per_step) if self.spec.leak_check else None)
        self._census: tuple[int, Counter[TensorKind]] | None = None
        self._last_step = 0
        self.oom_snapshots: OOMSnapshots | None = None  # the allocator's state at an OOM, kept by its observer
        self._recording = False
        self._write_files = True

    # ---- callback hooks -------------------------------------------------------------------------------------
    def on_fit_start(self, trainer: OptimizedTrainer) -> None:
        """Take device and log_dir from the trainer where not given; start recording history."""
        spec = getattr(trainer, "spec", None)
        if self.device is None:
            self.device = getattr(trainer, "device", None)
        if self.log_dir is None and spec is not None and spec.log.dir is not None:
            self.log_dir = Path(spec.log.dir)
        self._write_files = getattr(trainer, "is_main_process", True)
        self.start()

    def on_step_end(self, trainer: OptimizedTrainer, metrics: dict[str, Any]) -> None:
        """Use the step's ``mem/*`` metrics, or read memory every `every_steps` steps; check for a leak."""
        step = int(metrics["step"])
        stats = {key: value for key, value in metrics.items() if key.startswith("mem/")}
        if stats:
            self.observe(step, stats)
        elif step % self.every_steps == 0:
            self.observe(step)

    def on_fit_end(self, trainer: OptimizedTrainer, result: FitResult) -> None:
        """Stop recording history and write the timeline plot."""
        self.finish()

    # ---- the same, for a hand-written loop --------------------------------------------------------------------
    def start(self) -> None:
        """Start allocator-history recording when ``spec.record_history`` is on (CUDA only)."""
        device = self._device()
        if not self.spec.record_history:
            return
        if device.type != "cuda":
            log.info("memory.record_history needs a CUDA device; ignored on %s", device)
            return
        # Every allocation and free (with its stack) goes into a ring buffer that dump_snapshot writes out.
        torch.cuda.memory._record_memory_history(max_entries=HISTORY_MAX_ENTRIES, device=device)
        self._recording = True
        self.oom_snapshots = OOMSnapshots()  # the OOM handler runs after empty_cache: snapshot at the failure
        self.oom_snapshots.attach()

    def observe(self, step: int, stats: dict[str, float] | None = None) -> LeakWarning | None:
        """Record one reading (``memory_stats`` when `stats` is None) and return a leak warning if one is due."""
        stats = stats if stats is not None else memory_stats(self._device())
        self._record(step, stats)
        used_gb = stats.get("mem/allocated_gb", stats.get("mem/rss_gb"))
        if self.detector is None or used_gb is None:
            return None
        self.detector.source = "allocated CUDA memory" if "mem/allocated_gb" in stats else "process RSS"
        leak = self.detector.update(step, used_gb * GB)
        self._last_step = step
        if leak is None:
            self._maybe_take_census()
            return None
        return self._report(self._with_census(leak))

    def finish(self) -> Path | None:
        """Stop history recording; write ``memory_timeline.png`` to log_dir when ``spec.timeline_plot``."""
        if self._recording:
            torch.cuda.memory._record_memory_history(enabled=None)
            self._recording = False
        if self.oom_snapshots is not None:
            self.oom_snapshots.detach()
        if not (self.spec.timeline_plot and self.log_dir is not None and self.timeline and self._write_files):
            return None
        from vlmfast.memory.plots import plot_memory_timeline

        events = [(w.step, "leak warning") for w in self.leak_warnings]
        title = f"Memory timeline ({self._device()})"
        try:
            self.plot_path = plot_memory_timeline(self.timeline, self.log_dir / "memory_timeline.png", title, events)
        except OSError as exc:  # a full log disk: a warning, never the end of a run
            log.warning("cannot write the memory timeline to %s (%s)", self.log_dir, exc.strerror or exc)
            return None
        log.info("memory timeline written to %s", self.plot_path)
        return self.plot_path

    def dump_snapshot(self, path: str | Path | None = None) -> Path | None:
        """Write the CUDA allocator snapshot (open it at https://pytorch.org/memory_viz); None on CPU.

        Meant for the OOM handler: with ``record_history`` on, the snapshot shows every allocation and its stack
        leading up to the failure. When an OOM happened since the last call, the snapshot written is the one the
        allocator's OOM observer took at the failure (:class:`vlmfast.memory.allocator.OOMSnapshots`), not the
        state after the handler freed memory. `path` defaults to ``log_dir/memory_snapshot.pickle``.
        """
        device = self._device()
        if device.type != "cuda":
            log.info("no allocator snapshot on %s: snapshots exist for CUDA devices only", device)
            return None
        if path is None:
            if self.log_dir is None:
                raise ValueError("dump_snapshot needs a path, or a MemoryMonitor with log_dir set")
            path = self.log_dir / "memory_snapshot.pickle"
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        at_failure = self.oom_snapshots.take() if self.oom_snapshots is not None else None
        if at_failure is not None:
            with open_for_writing(path, "wb", what="memory snapshot") as f:  # as torch.cuda.memory._dump_snapshot
                pickle.dump(at_failure, f)
        else:
            with library_output(path, what="memory snapshot") as tmp:  # torch writes by name: a folder of our own
                torch.cuda.memory._dump_snapshot(str(tmp))
        history = "" if self._recording else " (segments only: set memory.record_history for allocation stacks)"
        when = " taken at the out-of-memory failure" if at_failure is not None else ""
        log.warning("CUDA memory snapshot%s written to %s%s; open it at %s", when, path, history, SNAPSHOT_VIEWER)
        return path

    # ---- internals --------------------------------------------------------------------------------------------
    def _device(self) -> torch.device:
        if self.device is None:
            self.device = torch.device("cpu")  # a hand-written loop that named no device
        return self.device

    def _record(self, step: int, stats: dict[str, float]) -> None:
        self.timeline.append({"step": step, **stats})
        if len(self.timeline) > TIMELINE_MAX_POINTS:
            del self.timeline[1::2]  # halve the resolution, keep the shape of the curve

    def _maybe_take_census(self) -> None:
        # The baseline is taken once, when memory first looks like it grows (not at the window start: a pass over
        # gc.get_objects() costs more than a short run's steps), so a warning can name what grew since then.
        detector = self.detector
        if self.census and self._census is None and detector is not None and detector.suspect:
            self._census = (self._last_step, live_tensor_census())

    def _with_census(self, leak: LeakWarning) -> LeakWarning:
        if not self.census or self._census is None:
            return leak
        since, before = self._census
        started = time.perf_counter()
        after = live_tensor_census()
        log.debug("tensor census took %.3f s", time.perf_counter() - started)
        self._census = (leak.step, after)  # the next warning reports growth since this one
        return dataclasses.replace(leak, tensor_growth=tuple(tensor_growth(before, after)), census_since_step=since)

    def _report(self, leak: LeakWarning) -> LeakWarning:
        self.leak_warnings.append(leak)
        message = leak.message()
        log.warning("step %d: %s", leak.step, message)
        warnings.warn(message, MemoryLeakWarning, stacklevel=2)
        return leak
