"""One honest report (issue 20): one step time, stated; profiling that costs little by default; the chart's axis and
legend; what the report lists is what ran."""

from __future__ import annotations

import contextlib
from collections import Counter
from pathlib import Path

import pytest
import torch
from conftest import TinyCausalLM, token_batch

from vlmfast.memory.monitor import MemoryMonitor
from vlmfast.profiling import RunProfiler
from vlmfast.reporting.report import STEP_TIME_DEFINITION, RunReport
from vlmfast.spec import MemorySpec, ProfileSpec

CPU = torch.device("cpu")


def _history(times: list[float]) -> list[dict]:
    return [{"step": i + 1, "step_time": t, "data_time": 0.01, "samples": 4, "tokens": 40, "loss": 1.0}
            for i, t in enumerate(times)]


def test_the_report_prints_one_step_time_and_says_what_it_is() -> None:
    report = RunReport.from_history(_history([0.1, 0.2, 0.3, 0.4, 1.0]), 2.0, world_size=1, peak_memory_gb=0.1,
                                    device="cpu")
    report.extra.update({"time split": "1 timed step: forward 50%", "compute": "0.1 TFLOP/s"})
    text = report.to_text()
    assert text.count("p50") == 1 and STEP_TIME_DEFINITION in text
    assert (report.step_time_p50_s, report.step_time_p90_s) == pytest.approx((0.3, 0.76))  # interpolated, as perf/*


def _tiny_vlm_trainer(tmp_path: Path, **spec):
    from vlmfast import OptimizedTrainer, TrainSpec
    from vlmfast.models import build_tiny_vlm_task

    model, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=32)
    base = {"max_steps": 4, "batch_size": 4, "log": {"progress": "off", "dir": str(tmp_path)},
            "profile": {"every_steps": 2, "warmup_steps": 0}}
    return OptimizedTrainer(model, dataset, TrainSpec(**{**base, **spec}), collate_fn=collate)


def test_default_flops_are_the_formula_and_never_run_flop_counter_mode(tmp_path, monkeypatch) -> None:
    """The default (`auto`) costs nothing on a transformer VLM: FlopCounterMode (~6x a step) is never entered."""
    import vlmfast.profiling.flops as flops

    def refuse(*args, **kwargs):
        raise AssertionError("FlopCounterMode entered by default")

    monkeypatch.setattr(flops, "FlopCounterMode", refuse)
    result = _tiny_vlm_trainer(tmp_path).fit()
    assert result.report.extra["compute"].endswith("TFLOP/s (MFU: no peak known for this device; set "
                                                   "profile.peak_tflops)")
    assert not any("p50" in key for key in result.report.extra)  # the profiler adds no second step time


def test_measured_flops_count_one_micro_batch_and_scale_the_other_shapes() -> None:
    """FlopCounterMode (~6x a step) runs once, on the first micro-batch; a timed step that counts is left out of the
    timings; other shapes are scaled from the counted one by their elements."""
    model = TinyCausalLM()
    profiler = RunProfiler(ProfileSpec(flops="measured", every_steps=1, warmup_steps=0), model, CPU)
    batches = [token_batch(4), token_batch(4), token_batch(8)]  # the third: twice the elements
    rows = []
    for step, batch in enumerate(batches, start=1):
        profiler.begin_step(step)
        with profiler.count_flops(batch), profiler.phase("forward"):
            model(**batch)["loss"].backward()
        profiler.add_flops(batch)
        rows.append(profiler.end_step())
    assert profiler.flops.method == "measured" and len(profiler.flops.buckets) == 1
    assert rows[0].get("perf/excluded") == 1.0 and rows[0].get("perf/flops_counted") == 1.0  # timed and counted
    assert "perf/excluded" not in rows[1] and "perf/excluded" not in rows[2]
    assert 1.3 * rows[1]["perf/flops"] < rows[2]["perf/flops"]  # scaled up (real tokens differ between batches)
    assert profiler.timer.summary()["perf/sampled_steps"] == 2


def test_the_leak_census_waits_until_memory_looks_like_it_grows(monkeypatch) -> None:
    import vlmfast.memory.monitor as monitor_module

    censuses = []
    monkeypatch.setattr(monitor_module, "live_tensor_census", lambda: censuses.append(1) or Counter())
    spec = MemorySpec(leak_warmup_steps=0, leak_window_steps=10, timeline_plot=False)
    flat = MemoryMonitor(spec, CPU)
    for step in range(1, 60):
        flat.observe(step, {"mem/rss_gb": 1.0 + 1e-6 * (step % 3)})  # steady: no gc pass at all
    assert censuses == []
    growing = MemoryMonitor(spec, CPU)
    for step in range(1, 60):
        growing.observe(step, {"mem/rss_gb": 1.0 + step * 5e-3})  # 5 MB per step
    assert growing.leak_warnings and len(censuses) >= 2  # the baseline once growth showed, then at the warning
    assert growing.leak_warnings[0].census_since_step is not None


def test_step_time_chart_ends_at_the_last_step_with_the_legend_beside_it(tmp_path: Path) -> None:
    from vlmfast.profiling.plots import plot_step_breakdown

    history = [{"step": s, "perf/step_time": 0.1, "perf/forward_time": 0.04, "perf/backward_time": 0.05,
                "perf/other_time": 0.01} for s in (10, 20, 30)]
    history.append({"step": 40, "perf/step_time": 0.9, "perf/forward_time": 0.8, "perf/excluded": 1.0})
    captured = {}
    from matplotlib.figure import Figure

    original = Figure.savefig

    def keep(self, *args, **kwargs):
        captured["figure"] = self
        return original(self, *args, **kwargs)

    with contextlib.ExitStack() as stack:
        stack.enter_context(pytest.MonkeyPatch.context()).setattr(Figure, "savefig", keep)
        plot_step_breakdown(history, tmp_path / "breakdown.png")
    ax = captured["figure"].axes[0]
    low, high = ax.get_xlim()
    assert 30 < high <= 38 and 2 <= low < 10  # the excluded step 40 is not drawn; the axis stops after 30
    legend = ax.get_legend()
    captured["figure"].canvas.draw()
    box = legend.get_window_extent()
    assert box.x0 >= ax.get_window_extent().x1  # beside the axes: it covers no bar


def test_activation_checkpointing_on_mllama_lists_its_blocks() -> None:
    """Mllama's text layers mix two classes (self- and cross-attention) and its vision encoders loop over their own
    layers: the report names what Hugging Face's switch checkpoints, not an empty list."""
    transformers = pytest.importorskip("transformers")
    from vlmfast.spec import ActivationCheckpointingSpec
    from vlmfast.strategies.activation_checkpointing import ActivationCheckpointing

    vision = {"hidden_size": 32, "num_hidden_layers": 2, "num_global_layers": 1, "attention_heads": 2,
              "intermediate_size": 64, "image_size": 32, "patch_size": 16, "max_num_tiles": 1,
              "intermediate_layers_indices": [0], "vision_output_dim": 64, "supported_aspect_ratios": [[1, 1]]}
    text = {"hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "num_key_value_heads": 1,
            "intermediate_size": 64, "vocab_size": 64, "cross_attention_layers": [1], "pad_token_id": 0,
            "bos_token_id": 1, "eos_token_id": 2}
    model = transformers.MllamaForConditionalGeneration(
        transformers.MllamaConfig(vision_config=vision, text_config=text, image_token_index=63))
    strategy = ActivationCheckpointing(ActivationCheckpointingSpec(enabled=True))
    strategy.apply(model)
    line = strategy.describe()
    assert "3/3 model.language_model.layers" in line, line
    assert "2/2 model.vision_model.transformer.layers" in line and "1/1 model.vision_model.global_transformer" in line


def _doctor_evidence(top_ops: list[dict]):
    from vlmfast.profiling.doctor import Evidence
    from vlmfast.spec import TrainSpec

    sample = {"perf/step_time": 0.1, "perf/forward_time": 0.045, "perf/backward_time": 0.05,
              "perf/optimizer_time": 0.005}
    return Evidence(samples=[sample, dict(sample)], spec=TrainSpec(), top_ops=top_ops)


def test_doctor_judges_attention_by_the_kernel_that_ran() -> None:
    from vlmfast.profiling.doctor import diagnose

    cpu = {"clock": "cpu"}
    on_sdpa = [{"name": "aten::_scaled_dot_product_flash_attention_for_cpu", "share": 0.35, **cpu},
               {"name": "aten::mm", "share": 0.3, **cpu}, {"name": "aten::_fused_adamw_", "share": 0.2, **cpu}]
    assert "attention" not in {f.key for f in diagnose(_doctor_evidence(on_sdpa))}  # SDPA already: nothing to say
    eager = [{"name": "aten::mm", "share": 0.4, **cpu}, {"name": "aten::_softmax", "share": 0.3, **cpu},
             {"name": "aten::bmm", "share": 0.2, **cpu}]
    finding = {f.key: f for f in diagnose(_doctor_evidence(eager))}["attention"]
    assert "50%" in finding.evidence and "aten::_softmax, aten::bmm" in finding.evidence
    assert "aten::mm" not in finding.evidence and finding.change == {"attention.backend": "sdpa"}
    math = [{"name": "aten::_scaled_dot_product_attention_math", "share": 0.2, **cpu},
            {"name": "aten::_softmax", "share": 0.2, **cpu}]
    finding = {f.key: f for f in diagnose(_doctor_evidence(math))}["attention"]
    assert "math kernel" in finding.title and finding.change is None  # already on SDPA: no switch to SDPA


def test_doctor_keeps_the_trace_it_points_to(tmp_path, monkeypatch) -> None:
    import tempfile

    from conftest import TokenDataset

    from vlmfast.profiling.doctor_cli import run_doctor
    from vlmfast.spec import TrainSpec

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # the kept folder lands here, not in /tmp
    report = run_doctor(TrainSpec(batch_size=8), lambda: (TinyCausalLM(), TokenDataset(64), None), steps=4)
    kept = report["text"].rsplit("profiler trace kept in ", 1)[1].split(" ", 1)[0]
    assert list(Path(kept).glob("*.json"))  # the folder named at the end exists and holds the trace


def test_a_comm_hook_that_does_not_apply_is_not_listed(caplog) -> None:
    """Under the OOM fallback on several ranks DDP's hook is bypassed (vlmfast averages by hand): warned, not listed."""
    from vlmfast.engines.ddp import DDPEngine
    from vlmfast.spec import DDPSpec
    from vlmfast.strategies.precision import MixedPrecision

    spec = DDPSpec(comm_hook="fp16")
    with caplog.at_level("WARNING"):
        manual = DDPEngine(spec, CPU, MixedPrecision("fp32", CPU), world_size=2, manual_sync=True)
    assert "does not apply" in caplog.text
    assert not any("comm hook" in line for line in manual.describe())
    hooked = DDPEngine(spec, CPU, MixedPrecision("fp32", CPU), world_size=2)
    assert any("comm hook fp16" in line for line in hooked.describe())
