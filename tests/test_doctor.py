"""`vlmfast doctor`: the diagnosis rules on measured evidence, end to end on data-bound and compute-bound jobs."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import TinyCausalLM, TokenDataset
from torch import nn

from vlmfast.models import build_tiny_vlm_task
from vlmfast.profiling.doctor import (
    Evidence,
    diagnose,
    doctor_spec,
    format_findings,
    format_trials,
    one_flag_at_a_time,
    with_changes,
)
from vlmfast.profiling.doctor_cli import add_doctor_command, run_doctor
from vlmfast.spec import TrainSpec
from vlmfast.train.loop import OptimizedTrainer


class SleepyTokens(TokenDataset):
    """A dataset whose __getitem__ sleeps: a deliberately data-bound job."""

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        time.sleep(0.010)
        return super().__getitem__(i)


class MatmulModel(nn.Module):
    """Compute-heavy, data-light: a deep MLP over in-memory features."""

    def __init__(self, dim: int = 1024, depth: int = 8) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[nn.Sequential(nn.Linear(dim, dim), nn.GELU()) for _ in range(depth)])

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return nn.functional.mse_loss(self.layers(x), y)


class Features(torch.utils.data.Dataset):
    def __init__(self, n: int = 256, dim: int = 1024) -> None:
        self.x, self.y = torch.randn(n, dim), torch.randn(n, dim)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[i], "y": self.y[i]}


def sleepy_job() -> tuple[nn.Module, torch.utils.data.Dataset, None]:
    torch.manual_seed(0)
    return TinyCausalLM(), SleepyTokens(n=64), None


def compute_job() -> tuple[nn.Module, torch.utils.data.Dataset, None]:
    torch.manual_seed(0)
    return MatmulModel(), Features(), None


SPEC = TrainSpec(batch_size=4, log={"progress": "off"})


def _evidence(**phases_ms: float) -> Evidence:
    step = sum(phases_ms.values())
    sample = {"perf/step_time": step / 1e3, **{f"perf/{k}_time": v / 1e3 for k, v in phases_ms.items()}}
    return Evidence(samples=[sample, dict(sample)], spec=SPEC)


# ---- rules on synthetic evidence ----------------------------------------------------------------------------
def test_data_bound_evidence_ranks_data_loading_first_with_its_share() -> None:
    findings = diagnose(_evidence(data_wait=60, forward=15, backward=20, optimizer=5))
    assert findings[0].key == "data_loading"
    assert findings[0].at_stake == pytest.approx(0.6)
    assert "60%" in findings[0].evidence and findings[0].change == {"data.num_workers": "auto"}


def test_compute_bound_evidence_does_not_blame_data() -> None:
    findings = diagnose(_evidence(data_wait=2, forward=40, backward=50, optimizer=8))
    assert "data_loading" not in [f.key for f in findings]
    assert "no bottleneck" in format_findings([], _evidence(data_wait=2, forward=40, backward=58))


def test_memory_padding_precision_and_communication_rules() -> None:
    ev = _evidence(forward=40, backward=50, comm=30, optimizer=5)
    ev.device, ev.world_size, ev.device_memory_gb, ev.peak_memory_gb, ev.padding_fraction = "cuda", 4, 80.0, 76.0, 0.5
    keys = {f.key: f for f in diagnose(ev)}
    assert keys["oom_risk"].change == {"activation_checkpointing.enabled": True}
    assert "95%" in keys["oom_risk"].evidence
    assert keys["precision"].change == {"precision": "bf16"}
    assert keys["communication"].change == {"ddp.comm_hook": "bf16"}
    assert keys["padding"].change  # packing or grouping by length, whichever this version's spec has
    assert diagnose(ev)[0].key == "oom_risk"  # a crash outranks a slowdown
    roomy = _evidence(forward=40, backward=50)
    roomy.spec = with_changes(SPEC, {"micro_batch_size": 1})
    roomy.device_memory_gb, roomy.peak_memory_gb = 80.0, 8.0
    assert {f.key: f.change for f in diagnose(roomy)}["memory_headroom"] == {"micro_batch_size": 2}


def test_attention_and_host_sync_rules_use_trace_and_sync_counts() -> None:
    ev = _evidence(forward=45, backward=50, optimizer=5)
    ev.top_ops = [{"name": "aten::_softmax", "share": 0.3, "clock": "device"},
                  {"name": "aten::bmm", "share": 0.2, "clock": "device"}, {"name": "aten::mm", "share": 0.4}]
    for sample in ev.samples:
        sample["perf/host_syncs"] = 6.0
    keys = {f.key: f for f in diagnose(ev)}
    assert "50%" in keys["attention"].evidence
    assert "6 synchronising" in keys["host_syncs"].evidence


def test_spec_changes_are_validated_and_errors_name_the_field() -> None:
    assert with_changes(SPEC, {"data.num_workers": 2}).data.num_workers == 2
    with pytest.raises(ValueError, match="micro_batch_size"):
        with_changes(SPEC, {"micro_batch_size": 5})  # larger than batch_size 4
    with pytest.raises(ValueError, match="no timed steps"):
        diagnose(Evidence(samples=[], spec=SPEC))
    with pytest.raises(ValueError, match="--steps"):
        doctor_spec(SPEC, steps=2)


def test_lora_is_advised_when_full_fine_tuning_states_fill_the_memory_and_its_share_reported_when_on() -> None:
    from vlmfast.profiling.doctor import model_state_estimates

    pytest.importorskip("peft")
    from conftest import tiny_llava

    full, lora = model_state_estimates(tiny_llava(text_hidden=64), SPEC)  # the estimator on meta copies
    assert 0 < lora < 0.5 * full  # a tiny model: its adapters and frozen weights are a large share
    ev = _evidence(forward=40, backward=50, optimizer=10)
    ev.device, ev.device_memory_gb, ev.peak_memory_gb = "cuda", 80.0, 76.0  # 95%: close to OOM
    ev.trainable_params = ev.total_params = 7_000_000_000
    ev.model_state_gb, ev.lora_model_state_gb = 60.0, 14.0
    finding = {f.key: f for f in diagnose(ev)}["lora"]
    assert finding.change == {"lora.enabled": True} and with_changes(SPEC, finding.change).lora.enabled
    assert "7.00B of 7.00B parameters train (100%)" in finding.evidence
    assert "~14.00 GiB with LoRA r 8" in finding.evidence
    assert not finding.trial  # a different training: never timed as a speed flag
    assert [t.label for t in one_flag_at_a_time(lambda spec: ev, SPEC, [finding])] == ["baseline"]
    ev.model_state_gb = 20.0  # activations fill the memory: LoRA would not help much
    assert "lora" not in {f.key for f in diagnose(ev)}
    on = _evidence(forward=40, backward=50)
    on.spec = with_changes(SPEC, {"lora.enabled": True})
    on.trainable_params, on.total_params = 20_000_000, 7_000_000_000
    assert "LoRA r 8: 20,000,000 of 7,000,000,000 parameters train (0.29%)" in format_findings([], on)


def test_one_flag_at_a_time_measures_each_change_alone() -> None:
    calls = []

    def run(spec: TrainSpec) -> Evidence:  # a job whose step time falls with workers; bf16 cannot run here
        calls.append(spec)
        if spec.precision == "bf16":
            raise RuntimeError("no bf16 here")
        workers = spec.data.num_workers if isinstance(spec.data.num_workers, int) else 4
        return _evidence(data_wait=60 / (1 + workers), forward=40)

    findings = diagnose(_evidence(data_wait=60, forward=40))
    findings[0].change = {"data.num_workers": 3}
    from vlmfast.profiling.doctor import Finding

    findings.append(Finding("precision", "fp32", 0.1, "", {"precision": "bf16"}))
    trials = one_flag_at_a_time(run, SPEC, findings)
    assert [t.label for t in trials] == ["baseline", "data.num_workers=3", "precision=bf16"]
    assert trials[1].speedup == pytest.approx(100 / 55)
    assert trials[2].error and math.isnan(trials[2].speedup)
    assert calls[1].data.num_workers == 3 and calls[1].precision == "fp32"  # one change at a time
    assert "failed: RuntimeError" in format_trials(trials)


# ---- end to end ---------------------------------------------------------------------------------------------
def test_doctor_names_data_loading_first_on_a_data_bound_job() -> None:
    report = run_doctor(SPEC, sleepy_job, steps=6)
    first = report["findings"][0]
    assert first["key"] == "data_loading", report["text"]
    assert first["at_stake"] >= 0.10  # 4 samples x 10 ms of sleep against a few-ms step (shares vary with load)
    assert f"({first['at_stake']:.0%})" in first["evidence"]
    assert "data.num_workers" in report["text"]


def test_doctor_does_not_blame_data_on_a_compute_bound_job() -> None:
    report = run_doctor(TrainSpec(batch_size=64, log={"progress": "off"}), compute_job, steps=6)
    keys = [f["key"] for f in report["findings"]]
    assert "data_loading" not in keys[:1], report["text"]
    assert "forward" in report["text"] and report["step_time_p50_ms"] > 0


def test_doctor_command_line(tmp_path, capsys) -> None:
    parser = argparse.ArgumentParser(prog="vlmfast")
    add_doctor_command(parser.add_subparsers(dest="command"))
    out = tmp_path / "doctor"
    args = parser.parse_args(["doctor", "--task", "test_doctor:sleepy_job", "--steps", "5", "--set", "batch_size=4",
                              "--out", str(out), "--json", str(tmp_path / "d.json")])
    assert args.run(args) == 0
    printed = capsys.readouterr().out
    assert "1. Data-bound" in printed and "--set data.num_workers=auto" in printed
    assert json.loads((tmp_path / "d.json").read_text())["findings"][0]["key"] == "data_loading"
    assert json.loads(next((out / "profiler").glob("trace_steps_*.json")).read_text())["traceEvents"]
    assert (out / "step_time_breakdown.png").is_file()


def test_a_change_past_the_trial_limit_is_not_measured_and_the_others_are() -> None:
    """doctor --apply bounds each trial (a cold-cache compile took 94 s of a 111 s run): past the limit the row says
    not measured and why, and the table, the ranking and the advice go on without it."""
    from vlmfast.profiling.doctor import Finding, rank_findings, trial_advice

    def run(spec: TrainSpec) -> Evidence:
        if spec.compile.enabled:
            time.sleep(120)  # a start-up longer than the limit: interrupted, never waited for
        return _evidence(data_wait=60 / (1 + spec.data.num_workers) if spec.data.num_workers != "auto" else 10,
                         forward=40)

    findings = [Finding("compute", "compute-bound", 0.2, "", {"compile.enabled": True}),
                Finding("data", "data-bound", 0.3, "", {"data.num_workers": 3})]
    trials = one_flag_at_a_time(run, SPEC, findings, baseline=_evidence(data_wait=60, forward=40), limit_s=1.0)
    compiled = trials[1]
    assert compiled.not_measured.startswith("over the 1 s trial limit") and not compiled.advised
    assert trials[2].measured and trials[2].advised
    table = format_trials(trials)
    assert "compile.enabled=true" in table and "not measured: over the 1 s trial limit" in table
    assert table.index("data.num_workers=3") < table.index("compile.enabled=true")  # measured rows first
    assert "try --set data.num_workers=3 first" in trial_advice(trials)
    ranked = rank_findings(findings, trials)
    assert [f.key for f in ranked] == ["data", "compute"] and ranked[1].measured.startswith("not measured: over")


def test_the_trial_limit_stops_a_compile_inside_dynamo_past_the_eager_fallback() -> None:
    """The limit's exception is a BaseException: neither dynamo's error wrapping nor compile.fallback's
    `except Exception` turns it into an eager run that would then be timed as the compiled one."""
    from vlmfast.profiling.trial_budget import TrialBudgetExceeded, trial_budget

    compiling = []

    def slow_backend(graph, example_inputs):  # stands in for inductor building its kernels with a cold cache
        compiling.append(graph)
        signal.setitimer(signal.ITIMER_REAL, 0.05)  # the limit runs out while the backend compiles
        time.sleep(120)
        return graph.forward

    torch._dynamo.register_backend(slow_backend, name="vlmfast_test_slow")
    spec = TrainSpec(max_steps=2, batch_size=4, device="cpu", log={"progress": "off"}, memory={"leak_check": False},
                     compile={"enabled": True, "backend": "vlmfast_test_slow"})
    model, dataset, collate = build_tiny_vlm_task(num_samples=8)
    trainer = OptimizedTrainer(model, dataset, spec, collate_fn=collate)
    try:
        with pytest.raises(TrialBudgetExceeded), trial_budget(600.0):
            trainer.fit()
    finally:
        torch._dynamo.reset()
    compile_strategy = next(s for s in trainer.strategies if s.name == "compile")
    assert len(compiling) == 1 and trainer.state.step == 0 and not compile_strategy.result.fallbacks  # not eager


def tiny_job() -> tuple[nn.Module, torch.utils.data.Dataset, None]:
    torch.manual_seed(0)
    return TinyCausalLM(), TokenDataset(32), None


def test_doctor_keeps_the_profilers_own_log_off_stderr(tmp_path) -> None:
    """kineto, torch.profiler's C++ side, prints "USDT: ... SyncActivityProfilerHandler.cpp:52] profiler_start" and
    profiler_stop on the process's stderr (not through sys.stderr) unless KINETO_LOG_LEVEL says otherwise, read when
    a process first profiles: so a fresh process, as a user's, its stderr read whole."""
    env = {key: value for key, value in os.environ.items() if key != "KINETO_LOG_LEVEL"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    out = tmp_path / "doctor"
    proc = subprocess.run([sys.executable, "-m", "vlmfast.cli.main", "doctor", "--task", "test_doctor:tiny_job",
                           "--steps", "5", "--set", "batch_size=4", "--out", str(out)],
                          capture_output=True, text=True, timeout=300, env={**env, "OMP_NUM_THREADS": "1"}, check=False)
    assert proc.returncode == 0, proc.stderr
    assert list((out / "profiler").glob("trace_steps_*.json"))  # the profiler did run
    assert "USDT" not in proc.stderr and "SyncActivityProfilerHandler" not in proc.stderr, proc.stderr


def test_speed_up_is_in_tokens_per_second_when_a_change_puts_more_tokens_in_a_step() -> None:
    history = [{"step": s, "tokens": 100, "perf/step_time": 0.1} for s in (1, 2)]
    packed = [{"step": s, "tokens": 300, "perf/step_time": 0.2} for s in (1, 2)]  # slower steps, more tokens each
    base = Evidence.from_history(history, SPEC)
    assert base.tokens_per_s == pytest.approx(1000)
    from vlmfast.profiling.doctor import Finding

    finding = Finding("padding", "padding", 0.3, "", {"data.group_by_length": "length"})
    trials = one_flag_at_a_time(lambda spec: Evidence.from_history(packed, spec), SPEC, [finding], baseline=base)
    assert trials[1].speedup == pytest.approx(1.5)  # 1500 vs 1000 tokens/s, although each step takes twice as long


# ---- issue 29: the speed-up is the ratio of the printed p50s; a start-up cost counts over the job ---------------
def _job_history(warmup_s: list[float], timed_s: list[float], tokens: int = 100) -> list[dict]:
    """Untimed warm-up steps, then timed steps (the trainer's `step_time`, the profiler's `perf/step_time`)."""
    rows = [{"step": i + 1, "step_time": t, "tokens": tokens} for i, t in enumerate(warmup_s)]
    return rows + [{"step": len(warmup_s) + i + 1, "step_time": t, "perf/step_time": t, "tokens": tokens}
                   for i, t in enumerate(timed_s)]


def _printed_rows(table: str) -> dict[str, list[str]]:
    """label -> [p50 ms, tokens/s, speed-up, ...] of the table's measured rows."""
    rows = [line.split() for line in table.splitlines()[1:]]
    return {row[0]: row[1:] for row in rows if len(row) >= 5 and row[3].endswith("x")}


def _compile_and_workers(max_steps: int):
    """The issue's job: compile's p50 76.8 ms against 1737 ms, but a 40 s compile and a 12 s recompile step."""
    from vlmfast.profiling.doctor import Finding

    spec = TrainSpec(batch_size=4, max_steps=max_steps, log={"progress": "off"})
    base = Evidence.from_history(_job_history([1.9], [1.737] * 7), spec)
    measured = {
        "compile": Evidence.from_history(_job_history([40.0], [12.0] + [0.0768] * 6), spec),
        "workers": Evidence.from_history(_job_history([1.95], [1.5] * 7), spec),
    }
    findings = [Finding("compute", "Compute-bound", 0.15, "", {"compile.enabled": True}),
                Finding("data_loading", "Data-bound", 0.10, "", {"data.num_workers": 2})]
    trials = one_flag_at_a_time(
        lambda s: measured["compile" if s.compile.enabled else "workers"], spec, findings, baseline=base)
    return findings, trials


def test_doctor_speed_up_is_the_ratio_of_the_p50s_it_prints() -> None:
    _, trials = _compile_and_workers(max_steps=8)
    rows = _printed_rows(format_trials(trials))
    base_p50 = float(rows["baseline"][0])
    for label in ("compile.enabled=true", "data.num_workers=2"):
        p50, speedup = float(rows[label][0]), float(rows[label][2].rstrip("x"))
        assert speedup == pytest.approx(base_p50 / p50, abs=0.006), (label, rows[label])
        # tokens/s is the same p50's: its ratio is the speed-up too
        assert speedup == pytest.approx(float(rows[label][1]) / float(rows["baseline"][1]), rel=0.01)
    assert float(rows["compile.enabled=true"][2].rstrip("x")) == pytest.approx(1737 / 76.8, abs=0.006)


def test_doctor_does_not_advise_a_start_up_cost_the_job_never_earns_back() -> None:
    from vlmfast.profiling.doctor import rank_findings, ranked_trials

    findings, trials = _compile_and_workers(max_steps=8)
    compiled = next(t for t in trials if t.change == {"compile.enabled": True})
    assert compiled.startup_s == pytest.approx((40 - 0.0768) + (12 - 0.0768) - (1.9 - 1.737))
    assert compiled.run_speedup == pytest.approx(8 * 1.737 / (compiled.startup_s + 8 * 0.0768))
    assert compiled.run_speedup < 1 < compiled.speedup and not compiled.advised
    table = format_trials(trials)
    assert [t.label for t in ranked_trials(trials)][1] == "data.num_workers=2"
    assert "advice: try --set data.num_workers=2 first" in table and "compile" not in table.splitlines()[-1]
    ranked = rank_findings(findings, trials)
    assert [f.key for f in ranked] == ["data_loading", "compute"]  # compile was first by its rule, not measured
    assert ranked[1].measured.endswith("not advised") and "22.62x per step" in ranked[1].measured

    # the same start-up over a long job is earned back: then compile is first and advised
    findings, trials = _compile_and_workers(max_steps=10_000)
    assert ranked_trials(trials)[1].change == {"compile.enabled": True}
    assert "advice: try --set compile.enabled=true first" in format_trials(trials)
    assert rank_findings(findings, trials)[0].key == "compute"
