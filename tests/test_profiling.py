"""Profiling: phase timer, FLOPs/MFU, torch.profiler window, the trainer's perf/* metrics and report."""

from __future__ import annotations

import json
import time

import pytest
import torch
from conftest import TinyCausalLM, TokenDataset, tiny_llava
from torch import nn

from vlmfast.models import TinyVLM, TinyVLMConfig, build_tiny_vlm_task
from vlmfast.profiling import (
    FlopsMeter,
    PhaseTimer,
    RunProfiler,
    StepProfiler,
    TowerShape,
    analytic_flops,
    measure_flops,
    peak_tflops,
    timed_comm_hook,
    transformer_flops,
)
from vlmfast.profiling.phase_timer import find_submodules, percentile
from vlmfast.profiling.plots import plot_step_breakdown
from vlmfast.spec import ProfileSpec, TraceSpec, TrainSpec
from vlmfast.train.loop import OptimizedTrainer

CPU = torch.device("cpu")


def _busy(seconds: float) -> None:
    """Real CPU work (matmuls) for about `seconds`."""
    a = torch.randn(64, 64)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def _hand_loop(timer: PhaseTimer, steps: int, micro_batches: int = 1) -> list[tuple[dict[str, float], float]]:
    out = []
    for step in range(1, steps + 1):
        start = time.perf_counter()
        timer.begin_step(step)
        with timer.phase("data_wait"):
            time.sleep(0.004)
        for _ in range(micro_batches):
            with timer.phase("h2d"):
                _busy(0.001)
            with timer.phase("forward"):
                _busy(0.004)
            with timer.phase("backward"):
                _busy(0.006)
        with timer.phase("optimizer"):
            _busy(0.002)
        metrics = timer.end_step()
        out.append((metrics, time.perf_counter() - start))
    return out


# ---- phase timer --------------------------------------------------------------------------------------------
def test_phase_times_sum_to_the_step_time_within_10_percent() -> None:
    timer = PhaseTimer(CPU, every_steps=1, warmup_steps=0)
    for metrics, wall in _hand_loop(timer, steps=5):
        phases = sum(metrics[f"perf/{name}_time"] for name in ("data_wait", "h2d", "forward", "backward", "optimizer"))
        assert phases == pytest.approx(wall, rel=0.10)  # measured phases, "other" left out
        assert metrics["perf/step_time"] == pytest.approx(wall, rel=0.10)
        assert metrics["perf/other_time"] < 0.1 * wall


def test_phases_accumulate_over_micro_batches_and_only_sampled_steps_report() -> None:
    timer = PhaseTimer(CPU, every_steps=3, warmup_steps=0)
    results = _hand_loop(timer, steps=6, micro_batches=3)
    sampled = [step for step, (metrics, _) in enumerate(results, 1) if metrics]
    assert sampled == [3, 6]
    metrics = results[2][0]
    assert metrics["perf/backward_time"] >= 3 * 0.006  # three micro-batches of 6 ms each
    assert metrics["perf/data_wait_ratio"] == pytest.approx(metrics["perf/data_wait_time"] / metrics["perf/step_time"])
    timer.begin_step(7)  # not sampled: one shared no-op, nothing recorded
    assert timer.phase("forward") is timer.phase("backward")
    assert timer.end_step() == {}
    summary = timer.summary()
    assert summary["perf/sampled_steps"] == 2
    assert summary["perf/step_time_p50"] <= summary["perf/step_time_p90"] <= summary["perf/step_time_p99"]
    assert len(timer.step_times) == 7


def test_the_timer_keeps_only_the_latest_steps() -> None:
    timer = PhaseTimer(CPU, every_steps=2, warmup_steps=0, keep_steps=4)
    for step in range(1, 21):
        timer.begin_step(step)
        timer.end_step()
    assert len(timer.step_times) == 4 and len(timer.samples) == 2  # a long run does not grow
    assert timer.summary()["perf/sampled_steps"] == 2


def test_nested_phase_is_taken_out_of_the_enclosing_one() -> None:
    timer = PhaseTimer(CPU, every_steps=1, warmup_steps=0)
    timer.begin_step(1)
    start = time.perf_counter()
    with timer.phase("optimizer"):
        _busy(0.004)
        with timer.phase("comm"):
            time.sleep(0.02)
    outer = time.perf_counter() - start
    metrics = timer.end_step()
    assert metrics["perf/comm_time"] >= 0.02
    # the 20 ms all-reduce is not counted twice
    assert metrics["perf/optimizer_time"] == pytest.approx(outer - metrics["perf/comm_time"], abs=0.002)


def test_unknown_phase_and_bad_sampling_are_clear_errors() -> None:
    timer = PhaseTimer(CPU, every_steps=1, warmup_steps=0)
    timer.begin_step(1)
    with pytest.raises(ValueError, match="unknown phase 'fwd'"):
        timer.phase("fwd")
    with pytest.raises(ValueError, match="every_steps"):
        PhaseTimer(CPU, every_steps=0)


def test_vlm_towers_are_timed_inside_forward() -> None:
    model = TinyVLM(TinyVLMConfig())
    _, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=8)
    batch = collate([dataset[i] for i in range(4)])
    timer = PhaseTimer(CPU, every_steps=1, warmup_steps=0)
    assert sorted(timer.attach(model)) == ["language_model", "projector", "vision"]
    timer.begin_step(1)
    with timer.phase("forward"):
        loss = model(**batch).loss
    with timer.phase("backward"):
        loss.backward()
    metrics = timer.end_step()
    towers = [metrics[f"perf/{name}_forward_time"] for name in ("vision", "projector", "language_model")]
    assert all(t > 0 for t in towers)
    assert sum(towers) <= metrics["perf/forward_time"]
    timer.detach()
    assert not model.vision_tower._forward_hooks


def test_hugging_face_llava_parts_are_found() -> None:
    roles = find_submodules(tiny_llava())
    assert set(roles) == {"vision", "projector", "language_model"}


class _RenamedVLM(nn.Module):
    """TinyVLM's parts under names no list knows: eyes (tower), bridge (projector), brain (language model)."""

    def __init__(self) -> None:
        super().__init__()
        from vlmfast.models.tiny_vlm import LanguageModel, MultiModalProjector, VisionTower

        self.config = config = TinyVLMConfig(vision_layers=1, text_layers=1)
        self.eyes, self.brain = VisionTower(config), LanguageModel(config)
        self.bridge = MultiModalProjector(config.vision_dim, config.text_dim)

    def get_image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        return self.bridge(self.eyes(pixel_values))

    def get_input_embeddings(self) -> nn.Module:
        return self.brain.embed_tokens

    def forward(self, pixel_values, input_ids, labels=None, **_):  # type: ignore[no-untyped-def]
        from vlmfast.models.tiny_vlm import VLMOutput, causal_lm_loss

        image = self.bridge(self.eyes(pixel_values))  # not through get_image_features: the other class may lack it
        logits = self.brain(torch.cat([image, self.brain.embed_tokens(input_ids)], 1), logits_from=image.shape[1])
        return VLMOutput(loss=None if labels is None else causal_lm_loss(logits, labels), logits=logits)


class _RenamedVLMWithoutImageCall(_RenamedVLM):
    get_image_features = get_input_embeddings = None  # a custom model: only a probe forward shows its parts


def test_renamed_vlm_parts_are_learned_and_timed() -> None:
    _, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=4)
    batch = collate([dataset[i] for i in range(2)])
    model = _RenamedVLM()
    parts = find_submodules(model)  # the stand-in image call: nothing computed, no batch needed
    assert parts == {"vision": (model.eyes,), "projector": (model.bridge,), "language_model": (model.brain,)}
    timer = PhaseTimer(CPU, every_steps=1, warmup_steps=0)
    assert sorted(timer.attach(model)) == ["language_model", "projector", "vision"]
    timer.begin_step(1)
    with timer.phase("forward"):
        model(**batch)
    metrics = timer.end_step()
    assert all(metrics[f"perf/{role}_forward_time"] > 0 for role in ("vision", "projector", "language_model"))
    plain = _RenamedVLMWithoutImageCall()
    assert find_submodules(plain) == {}  # nothing to call and no sample: no split rather than a guess
    # a probe forward: the tower is where the images flow, the language model where the ids reach an embedding
    assert find_submodules(plain, batches=iter([batch])) == {"vision": (plain.eyes,), "language_model": (plain.brain,)}


def test_trainer_learns_the_parts_with_probe_batches() -> None:
    _, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=4)
    spec = {"max_steps": 1, "batch_size": 2, "log": {"progress": "off"}, "memory": {"leak_check": False},
            "profile": {"every_steps": 1, "warmup_steps": 0, "mfu": False}}
    trainer = OptimizedTrainer(_RenamedVLMWithoutImageCall(), dataset, spec, collate_fn=collate)
    assert set(trainer.timer.timer.parts) == {"vision", "language_model"}  # learned on the plain model, pre-engine
    timed = [row for row in trainer.fit().history if "perf/step_time" in row]
    assert timed and all(row["perf/vision_forward_time"] > 0 for row in timed)


def test_comm_hook_time_is_measured_through_ddp(tmp_path) -> None:
    import torch.distributed as dist

    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 1)))
        timer = PhaseTimer(CPU, every_steps=1, warmup_steps=0)
        model.register_comm_hook(None, timed_comm_hook(timer))
        for step in (1, 2):
            timer.begin_step(step)
            with timer.phase("backward"):
                model(torch.randn(8, 64)).sum().backward()
            metrics = timer.end_step()
        assert metrics["perf/comm_hook_time"] > 0
        assert model.module[0].weight.grad is not None
    finally:
        dist.destroy_process_group()


def test_percentile_interpolates() -> None:
    assert percentile([1.0, 2.0, 3.0, 4.0], 0.5) == 2.5
    assert percentile([], 0.9) == 0.0


# ---- FLOPs / MFU --------------------------------------------------------------------------------------------
def test_measured_flops_of_a_matmul_only_model_equal_the_analytic_count() -> None:
    model = nn.Sequential(nn.Linear(32, 64, bias=False), nn.Linear(64, 16, bias=False))
    tokens = 10
    x = torch.randn(tokens, 32, requires_grad=True)  # a block inside a network: its input needs a gradient too
    measured = measure_flops(lambda: model(x).sum().backward())
    params = sum(p.numel() for p in model.parameters())
    analytic = transformer_flops(TowerShape(params, layers=0, heads=0, head_dim=0, seq_len=0, tokens=tokens))
    assert measured == analytic == 6 * params * tokens


def test_frozen_tower_is_counted_forward_only() -> None:
    frozen, trainable = nn.Linear(32, 64, bias=False), nn.Linear(64, 16, bias=False)
    frozen.requires_grad_(False)
    model = nn.Sequential(frozen, trainable)
    measured = measure_flops(lambda: model(torch.randn(10, 32)).sum().backward())
    # frozen: forward only (2N); trainable: forward + weight gradient (its input needs no gradient)
    assert measured == 10 * (2 * frozen.weight.numel() + 4 * trainable.weight.numel())
    frozen_shape = TowerShape(frozen.weight.numel(), 0, 0, 0, 0, tokens=10, trainable=False)
    assert transformer_flops(frozen_shape) == 2 * frozen.weight.numel() * 10


def test_flops_meter_measures_once_per_shape_and_counts_real_tokens_only() -> None:
    model, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=8)
    batch = collate([dataset[i] for i in range(4)])
    meter = FlopsMeter(model)
    with meter.count(batch):
        model(**batch).loss.backward()
    assert len(meter.buckets) == 1
    measured = meter.buckets[next(iter(meter.buckets))]
    assert set(measured.by_role) == {"vision", "projector", "language_model"}
    assert sum(measured.by_role.values()) == pytest.approx(measured.total)
    assert meter.count(batch).__class__.__name__ == "nullcontext"  # the same shape is not counted again
    full = {**batch, "attention_mask": torch.ones_like(batch["attention_mask"])}
    padded = {**batch, "attention_mask": torch.zeros_like(batch["attention_mask"])}
    assert meter.flops(full) == measured.total
    # all text is padding: only vision, projector and the image tokens' share of the language model remain
    lm = measured.by_role["language_model"]
    image_share = 1 - batch["input_ids"].numel() / measured.lm_tokens
    assert meter.flops(padded) == pytest.approx(measured.total - lm * (1 - image_share))
    assert meter.flops(full) > meter.flops(batch) > meter.flops(padded)


def test_analytic_flops_match_measurement_for_the_tiny_vlm() -> None:
    model, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=8)
    batch = collate([dataset[i] for i in range(8)])
    meter = FlopsMeter(model)
    with meter.count(batch):
        model(**batch).loss.backward()
    assert analytic_flops(model, batch) == pytest.approx(meter.flops(batch), rel=0.15)
    model.vision_tower.requires_grad_(False)  # frozen tower: forward only
    assert analytic_flops(model, batch) < FlopsMeter(model, "analytic").flops(batch) * 1.0001
    with pytest.raises(ValueError, match=r"profile\.flops"):
        analytic_flops(nn.Linear(2, 2), batch)


def test_peak_table_and_override() -> None:
    assert peak_tflops("cuda", "bf16", device_name="NVIDIA H100 80GB HBM3") == pytest.approx(989.4)
    assert peak_tflops("cuda", "bf16", device_name="NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("cuda", "fp32", tf32=True, device_name="NVIDIA A100-SXM4-40GB") == 156.0
    assert peak_tflops("cuda", "bf16", device_name="Tesla V100-SXM2-16GB") == 15.7  # no bf16 tensor cores
    assert peak_tflops("cpu", "fp32") is None
    assert peak_tflops("cpu", "fp32", override=1.5) == 1.5


# ---- torch.profiler -----------------------------------------------------------------------------------------
def test_profiler_writes_a_trace_that_loads_as_json(tmp_path) -> None:
    model = TinyCausalLM()
    batch = TokenDataset(n=4).batch
    profiler = StepProfiler(TraceSpec(enabled=True, start_step=3, warmup_steps=1, active_steps=2), CPU, tmp_path)
    active = []
    for step in range(1, 7):
        profiler.begin_step(step)
        active.append(profiler.active)
        model(**batch)["loss"].backward()
        profiler.end_step()
    assert active == [False, True, True, True, False, False]  # warm-up step 2, steps 3-4 recorded, then stopped
    files = profiler.close()
    assert {f.name.endswith(".pt.trace.json") for f in files} == {True, False}  # chrome + TensorBoard layout
    for path in files:
        trace = json.loads(path.read_text())
        assert any(event.get("name", "").startswith("aten::") for event in trace["traceEvents"])
    assert profiler.top_ops and profiler.top_ops[0]["share"] > 0
    assert (tmp_path / "profiler" / "top_ops_steps_3-4.json").is_file()


def test_trace_spec_checks_the_window() -> None:
    with pytest.raises(ValueError, match=r"trace\.warmup_steps"):
        TrainSpec(profile={"trace": {"enabled": True, "start_step": 2, "warmup_steps": 2}})
    with pytest.raises(ValueError, match="did you mean 'every_steps'"):
        TrainSpec(profile={"every_step": 5})


# ---- in the trainer -----------------------------------------------------------------------------------------
def test_trainer_reports_breakdown_mfu_plot_and_trace(tmp_path) -> None:
    model, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=64)
    spec = {"max_steps": 8, "batch_size": 8, "micro_batch_size": 4, "log": {"dir": str(tmp_path), "progress": "off"},
            "memory": {"timeline_plot": False, "leak_check": False},
            "profile": {"every_steps": 2, "peak_tflops": 1.0, "trace": {"enabled": True, "start_step": 6,
                                                                          "active_steps": 1, "format": "chrome"}}}
    result = OptimizedTrainer(model, dataset, spec, collate_fn=collate).fit()
    timed = [row for row in result.history if "perf/step_time" in row]
    assert [row["step"] for row in timed] == [2, 4, 6, 8]
    assert [row["step"] for row in timed if row.get("perf/traced")] == [6]
    for row in timed:
        for key in ("perf/forward_time", "perf/backward_time", "perf/optimizer_time", "perf/data_wait_time",
                    "perf/vision_forward_time", "perf/flops", "perf/tflops", "perf/mfu"):
            assert row[key] > 0, key
        assert row["perf/mfu"] == pytest.approx(row["perf/tflops"] / 1.0)
    assert {"time split", "compute"} <= set(result.report.extra)
    assert not any("p50" in key for key in result.report.extra)  # one step time in the report: RunReport's
    assert "MFU" in result.report.extra["compute"]
    assert (tmp_path / "step_time_breakdown.png").stat().st_size > 1000
    assert json.loads((tmp_path / "profile_summary.json").read_text())["perf/sampled_steps"] == 3  # traced one out
    json.loads(next((tmp_path / "profiler").glob("trace_steps_6-6.json")).read_text())


def test_timing_off_adds_no_metrics() -> None:
    spec = {"max_steps": 3, "batch_size": 4, "log": {"progress": "off"}, "profile": {"timing": False, "every_steps": 1,
                                                                                     "warmup_steps": 0}}
    result = OptimizedTrainer(TinyCausalLM(), TokenDataset(n=16), spec).fit()
    assert not any(key.startswith("perf/") for row in result.history for key in row)


def test_run_profiler_in_a_hand_written_loop(tmp_path) -> None:
    model = TinyCausalLM()
    batch = TokenDataset(n=4).batch
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    profiler = RunProfiler(ProfileSpec(every_steps=1, warmup_steps=0, peak_tflops=0.5), model, CPU, log_dir=tmp_path)
    history = []
    for step in range(1, 4):
        profiler.begin_step(step)
        with profiler.count_flops(batch):
            with profiler.phase("forward"):
                loss = model(**batch)["loss"]
            with profiler.phase("backward"):
                loss.backward()
        profiler.add_flops(batch)
        with profiler.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        history.append({"step": step, **profiler.end_step()})
    lines = profiler.finish(history)
    assert history[-1]["perf/flops"] > 0 and "MFU" in lines["compute"]
    assert plot_step_breakdown(history, tmp_path / "b.png").is_file()
    with pytest.raises(ValueError, match="no timed steps"):
        plot_step_breakdown([{"step": 1}], tmp_path / "c.png")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_events_time_phases_and_count_host_syncs() -> None:
    device = torch.device("cuda")
    timer = PhaseTimer(device, every_steps=1, warmup_steps=0)
    a = torch.randn(2048, 2048, device=device)
    timer.begin_step(1)
    with timer.phase("forward"):
        b = a @ a
        _ = b.sum().item()  # a host-device sync in "user code"
    with timer.phase("backward"):
        for _ in range(10):
            b = b @ a
    metrics = timer.end_step()
    assert metrics["perf/backward_time"] > metrics["perf/forward_time"] > 0
    assert metrics["perf/host_syncs"] >= 1
    assert peak_tflops(device, "bf16") is not None or True  # unknown GPUs give None, never an error
