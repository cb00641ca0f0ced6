"""Memory monitoring: memory_stats names, the leak detector, a real leak in a training run, the census, the plot."""

from __future__ import annotations

import random
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import TinyCausalLM, TokenDataset

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.memory.leaks import MB, LeakDetector, TensorKind, live_tensor_census, tensor_growth
from vlmfast.memory.monitor import MemoryLeakWarning, MemoryMonitor
from vlmfast.memory.plots import plot_memory_timeline
from vlmfast.memory.stats import memory_stats
from vlmfast.spec import MemorySpec

BASE = 2_000 * MB


def feed(detector, values, first_step=1):
    """Update the detector with one value per step; return the warnings."""
    return [w for step, value in enumerate(values, first_step) if (w := detector.update(step, value)) is not None]


# ---- memory_stats ---------------------------------------------------------------------------------------------
def test_memory_stats_on_cpu_reads_rss_and_peak():
    stats = memory_stats(torch.device("cpu"))
    assert set(stats) == {"mem/rss_gb", "mem/peak_gb"}
    assert 0 < stats["mem/rss_gb"] <= stats["mem/peak_gb"] + 1e-3


def test_memory_stats_on_cuda_adds_fragmentation_retries_and_ooms(monkeypatch):
    fake = {"allocated_bytes.all.current": 3 * 1024**3, "reserved_bytes.all.current": 4 * 1024**3,
            "allocated_bytes.all.peak": 5 * 1024**3, "num_alloc_retries": 7, "num_ooms": 1}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: fake)
    stats = memory_stats(torch.device("cuda", 0))
    assert stats == {"mem/allocated_gb": 3.0, "mem/reserved_gb": 4.0, "mem/peak_gb": 5.0,
                     "mem/fragmentation": 0.25, "mem/alloc_retries": 7, "mem/num_ooms": 1}
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: {})  # CUDA not initialised yet
    assert memory_stats(torch.device("cuda", 0))["mem/fragmentation"] == 0.0


# ---- LeakDetector ---------------------------------------------------------------------------------------------
def test_steady_growth_warns_once_with_the_rate():
    detector = LeakDetector(warmup_steps=10, window_steps=20, threshold_mb_per_step=1.0)
    # optimizer state at step 1, then 5 MB/step
    values = [BASE] + [BASE + 3_000 * MB + 5 * MB * step for step in range(2, 41)]
    leaks = feed(detector, values)
    assert len(leaks) == 1
    leak = leaks[0]
    assert leak.rate_mb_per_step == pytest.approx(5.0)
    assert (leak.first_step, leak.last_step, leak.window_steps) == (11, 30, 20)
    assert leak.total_growth_mb == pytest.approx(95.0)
    message = leak.message()
    assert "5.0 MB/step" in message and "steps 11-30" in message and "+95.0 MB" in message
    assert "total += loss" in message and "handle.remove()" in message and "list" in message and "caches" in message


def test_a_persistent_leak_warns_at_most_once_per_window():
    detector = LeakDetector(warmup_steps=10, window_steps=20, threshold_mb_per_step=1.0)
    leaks = feed(detector, [BASE + 5 * MB * step for step in range(1, 81)])
    assert [w.step for w in leaks] == [30, 50, 70]


def test_flat_noisy_memory_does_not_warn():
    rng = random.Random(0)
    for window in (5, 10, 50):
        detector = LeakDetector(warmup_steps=5, window_steps=window, threshold_mb_per_step=1.0)
        assert feed(detector, [BASE + rng.uniform(-20, 20) * MB for _ in range(500)]) == []


def test_a_single_jump_does_not_warn():
    rng = random.Random(1)
    for jump_at in range(15, 60, 3):
        detector = LeakDetector(warmup_steps=10, window_steps=20, threshold_mb_per_step=1.0)
        values = [BASE + (800 * MB if step >= jump_at else 0) + rng.uniform(-2, 2) * MB for step in range(1, 100)]
        assert feed(detector, values) == [], jump_at


def test_leak_in_noise_and_sparse_readings_are_detected():
    rng = random.Random(2)
    detector = LeakDetector(warmup_steps=5, window_steps=50, threshold_mb_per_step=1.0)
    leaks = feed(detector, [BASE + (3 * step + rng.uniform(-20, 20)) * MB for step in range(1, 60)])
    assert len(leaks) == 1 and leaks[0].rate_mb_per_step == pytest.approx(3.0, abs=0.5)
    sparse = LeakDetector(warmup_steps=20, window_steps=50, threshold_mb_per_step=1.0)  # readings every 10 steps
    leaks = [w for step in range(10, 400, 10) if (w := sparse.update(step, BASE + 2 * MB * step))]
    assert leaks and leaks[0].rate_mb_per_step == pytest.approx(2.0)


# ---- tensor census --------------------------------------------------------------------------------------------
def test_tensor_census_names_the_kind_that_grew():
    before = live_tensor_census()
    kept = [torch.zeros(123, 457, dtype=torch.float16) for _ in range(7)]
    growth = tensor_growth(before, live_tensor_census())
    kind = TensorKind((123, 457), "torch.float16", "cpu")
    top = growth[0]
    assert top.kind == kind and top.count == 7 and top.bytes == 7 * 123 * 457 * 2
    assert str(top) == "+7 x float16[123, 457] on cpu (+0.8 MB)"
    del kept


# ---- MemoryMonitor in a real (CPU) training run ---------------------------------------------------------------
LEAKED: list[torch.Tensor] = []
LEAK_SHAPE = (1024, 1024)  # float32: 4 MB a step, far above the RSS noise of a tiny model


def leaky_loss(model, batch):
    # torch.ones touches every page, so the leak shows in RSS (torch.empty would only reserve address space)
    LEAKED.append(torch.ones(LEAK_SHAPE))
    return model(**batch)["loss"]


def clean_loss(model, batch):
    return model(**batch)["loss"]


def run_monitored(loss_fn, tmp_path):
    spec = TrainSpec(max_steps=40, batch_size=8, optimizer={"lr": 1e-2},
                     memory={"leak_warmup_steps": 5, "leak_window_steps": 25, "leak_threshold_mb_per_step": 1.0},
                     log={"progress": "off", "memory_every_steps": 1, "dir": str(tmp_path)})
    torch.manual_seed(0)
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(64), spec, loss_fn=loss_fn)  # the spec's monitor
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit()
    return trainer.memory_monitor, [w for w in caught if issubclass(w.category, MemoryLeakWarning)]


def test_monitor_warns_on_a_real_leak_and_names_rate_and_tensor_kind(tmp_path, caplog):
    LEAKED.clear()
    try:
        with caplog.at_level("WARNING", logger="vlmfast"):
            monitor, caught = run_monitored(leaky_loss, tmp_path)
    finally:
        LEAKED.clear()
    assert len(monitor.leak_warnings) == 1 and len(caught) == 1
    leak = monitor.leak_warnings[0]
    assert leak.source == "process RSS"
    assert leak.rate_mb_per_step == pytest.approx(4.0, rel=0.25)
    assert "float32[1024, 1024] on cpu" in str(caught[0].message)
    assert "possible memory leak" in caplog.text
    assert len(monitor.timeline) == 40 and {"step", "mem/rss_gb", "mem/peak_gb"} <= set(monitor.timeline[0])
    assert monitor.plot_path == tmp_path / "memory_timeline.png" and monitor.plot_path.stat().st_size > 0


def test_monitor_stays_quiet_without_a_leak(tmp_path):
    monitor, caught = run_monitored(clean_loss, tmp_path)
    assert monitor.leak_warnings == [] and caught == []


def test_monitor_reads_memory_itself_when_the_metrics_have_none():
    monitor = MemoryMonitor(MemorySpec(leak_check=False, timeline_plot=False), "cpu", every_steps=3)
    trainer = SimpleNamespace()
    monitor.on_fit_start(trainer)
    for step in range(1, 10):
        monitor.on_step_end(trainer, {"step": step, "loss": 1.0})
    assert [row["step"] for row in monitor.timeline] == [3, 6, 9]
    assert monitor.finish() is None


def test_record_history_and_snapshot_call_the_cuda_allocator(monkeypatch, tmp_path):
    calls = []
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda *a, **k: calls.append(("record", k)))
    def dump(path):
        calls.append(("dump", Path(path).name))
        Path(path).write_bytes(b"snapshot")

    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", dump)
    monitor = MemoryMonitor(MemorySpec(record_history=True, timeline_plot=False), "cuda:0", tmp_path)
    monitor.start()
    assert monitor.dump_snapshot() == tmp_path / "memory_snapshot.pickle"
    monitor.finish()
    # torch writes by name into a private folder (vlmfast.common.safe_files.library_output), then it is moved into place
    assert calls == [("record", {"max_entries": 100_000, "device": torch.device("cuda:0")}),
                     ("dump", "memory_snapshot.pickle"), ("record", {"enabled": None})]
    assert (tmp_path / "memory_snapshot.pickle").read_bytes() == b"snapshot"
    assert [p.name for p in tmp_path.iterdir()] == ["memory_snapshot.pickle"]


def test_snapshot_is_a_logged_no_op_on_cpu(tmp_path, caplog):
    monitor = MemoryMonitor(MemorySpec(record_history=True), "cpu", tmp_path)
    with caplog.at_level("INFO", logger="vlmfast"):
        monitor.start()
        assert monitor.dump_snapshot(tmp_path / "s.pickle") is None
    assert "CUDA" in caplog.text and not (tmp_path / "s.pickle").exists()


# ---- plot -----------------------------------------------------------------------------------------------------
def test_timeline_plot_is_a_valid_png(tmp_path):
    timeline = [{"step": s, "mem/allocated_gb": 1 + 0.01 * s, "mem/reserved_gb": 1.5 + 0.01 * s,
                 "mem/peak_gb": 2.0 + 0.01 * s} for s in range(1, 101)]
    path = plot_memory_timeline([*timeline, {"step": 101, "loss": 1.0}], tmp_path / "sub" / "timeline.png",
                                title="Memory timeline (cuda:0)", events=[(60, "leak warning")])
    data = path.read_bytes()
    assert path == tmp_path / "sub" / "timeline.png" and len(data) > 1000
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
