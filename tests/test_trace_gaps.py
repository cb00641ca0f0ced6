"""The trace reducer of the GPU lease (vlmfast.bench.trace_gaps): exact on a hand-made CUDA-like trace, and it reads
a real torch.profiler trace of CPU steps (the host's operators standing in for the device)."""

from __future__ import annotations

import json

import pytest
import torch

from vlmfast.bench.trace_gaps import reduce_trace


def _event(name, cat, ts, dur, tid=1):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "pid": 1, "tid": tid}


def test_busy_fraction_and_the_longest_gap_with_what_the_host_did_then():
    events = [
        _event("ProfilerStep#4", "user_annotation", 0, 1000),
        _event("ProfilerStep#5", "user_annotation", 1000, 1000),
        _event("ProfilerStep#4", "gpu_user_annotation", 0, 1000, tid=7),  # the GPU-side copy: not a step of its own
        _event("gemm", "kernel", 100, 400, tid=7), _event("gemm", "kernel", 300, 300, tid=7),  # overlap: union 100-600
        _event("memcpy", "gpu_memcpy", 900, 100, tid=7),
        _event("gemm", "kernel", 1000, 900, tid=7),
        _event("cudaStreamSynchronize", "cuda_runtime", 620, 250),  # the host waits in the 600-900 gap
        _event("aten::item", "cpu_op", 610, 270),
    ]
    summary = reduce_trace({"traceEvents": events}, gaps=2)
    assert [s["step"] for s in summary["steps"]] == ["ProfilerStep#4", "ProfilerStep#5"]
    assert summary["steps"][0]["busy_ms"] == pytest.approx(0.6) and summary["steps"][0]["busy_fraction"] == 0.6
    assert summary["steps"][1]["busy_fraction"] == pytest.approx(0.9)
    assert summary["busy_fraction"] == pytest.approx(0.75) and summary["idle_ms_per_step"] == pytest.approx(0.25)
    gap = summary["longest_gaps"][0]
    assert gap["step"] == "ProfilerStep#4" and gap["at_ms"] == pytest.approx(0.6) and gap["ms"] == pytest.approx(0.3)
    assert [h["name"] for h in gap["host"]] == ["aten::item", "cudaStreamSynchronize"]
    assert gap["host_unrecorded_ms"] == pytest.approx(0.03)  # 600-610 and 880-900: no host event
    assert summary["clock"].startswith("device")
    assert len(summary["longest_gaps"]) == 2 and summary["longest_gaps"][1]["ms"] <= gap["ms"]


def test_a_real_cpu_trace_reads_the_host_operators_as_the_device(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    schedule = torch.profiler.schedule(wait=0, warmup=1, active=2, repeat=1)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], schedule=schedule) as prof:
        for _ in range(3):
            model(torch.randn(8, 32)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            prof.step()
    path = tmp_path / "trace.json"
    prof.export_chrome_trace(str(path))
    summary = reduce_trace(path, gaps=3)
    assert len(summary["steps"]) == 2 and "no device events" in summary["clock"]
    assert all(0 < s["busy_fraction"] <= 1 for s in summary["steps"])
    assert 1 <= len(summary["longest_gaps"]) <= 3
    assert len(json.dumps(summary)) < 16_000  # a small file, whatever the trace's size


def test_a_trace_without_steps_is_refused_with_what_to_do():
    with pytest.raises(ValueError, match=r"no ProfilerStep#N spans.*prof\.step"):
        reduce_trace({"traceEvents": [_event("gemm", "kernel", 0, 10)]})
