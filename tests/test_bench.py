"""`vlmfast bench`: every configuration runs (or says why not), really switches its strategy on, sees the same data;
the headroom benchmark finds more room with checkpointing and the OOM fallback completes where the plain loop fails.
No timing assertions: the numbers belong to the benchmark, not to CI."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from vlmfast.bench.cli import add_bench_command, main
from vlmfast.bench.configs import START, best_spec, build_configs
from vlmfast.bench.harness import run_comparison
from vlmfast.bench.headroom import run_headroom
from vlmfast.bench.report import comparison_markdown, environment, update_doc, write_results
from vlmfast.bench.runners import _deep_merge
from vlmfast.bench.workload import SIZES
from vlmfast.bench.workload_builder import build_workload
from vlmfast.spec import TrainSpec

CPU = torch.device("cpu")
EQUAL = ("start", "vlmfast", "vlmfast-defaults", "accelerate", "hf-trainer", "fabric")


def _ci_configs():
    """All CPU configurations as `bench --quick` runs them: compile through the eager backend (dynamo still captures
    the graph, without inductor's C++ build, which alone takes minutes on 2 cores with a cold cache)."""
    return build_configs("cpu", quick=True)


def test_quick_configurations_build_no_cpp_kernels_and_say_so():
    quick = {c.name: c for c in build_configs("cpu", quick=True)}
    full = {c.name: c for c in build_configs("cpu")}
    assert quick["vlmfast+compile"].settings.spec["compile"]["backend"] == "eager"
    assert "--quick compiles nothing" in quick["vlmfast+compile"].description
    assert full["vlmfast+compile"].settings.spec["compile"]["backend"] == "inductor"
    cuda_quick = {c.name: c for c in build_configs("cuda", quick=True)}
    assert cuda_quick["accelerate-best"].settings.compile and cuda_quick["accelerate-best"].settings.compile_backend \
        == "eager"


@pytest.fixture(scope="module")
def quick(tmp_path_factory):
    torch.set_num_threads(1)
    workload = build_workload("cpu", steps=2, warmup=1, batch_size=8)
    result = {"benchmark": "compare", "environment": environment(CPU), "workload": workload.describe(), "repeats": 1,
              "best_reason": "test", **run_comparison(workload, _ci_configs(), 1, CPU, progress=lambda line: None)}
    out = tmp_path_factory.mktemp("bench")
    return workload, result, write_results(result, out, "compare_quick")


def test_quick_mode_writes_every_configuration_or_a_reason(quick):
    _, _, paths = quick
    for kind in ("json", "md", "throughput_png", "memory_png"):
        assert paths[kind].stat().st_size > 0
    assert paths["throughput_png"].read_bytes()[:4] == b"\x89PNG"
    written = json.loads(paths["json"].read_text())
    table = paths["md"].read_text()
    for config in build_configs("cpu"):
        ran = config.name in written["summary"]
        assert ran or written["skipped"].get(config.name), f"{config.name}: neither run nor skipped with a reason"
        assert f"| {config.name} |" in table
    assert "tf32 is a CUDA feature" in written["skipped"]["vlmfast+tf32"]
    assert not {name: why for name, why in written["skipped"].items() if name != "vlmfast+tf32"}
    assert {check["what"] for check in written["must_show"]} and "Targets:" in table


def test_each_strategy_alone_really_switches_it_on(quick):
    _, result, _ = quick
    details = {name: s["details"] for name, s in result["summary"].items()}
    summary = result["summary"]

    def lines(name):
        return "\n".join(details[name]["strategies"])

    assert "bf16 autocast" in lines("vlmfast+bf16") and "fp32 (no autocast)" in lines("vlmfast")
    assert "sdpa" in next(line for line in details["vlmfast+sdpa"]["strategies"] if line.startswith("attention"))
    assert "torch.compile: " in lines("vlmfast+compile") and " blocks (eager" in lines("vlmfast+compile")
    assert "activation checkpointing" in lines("vlmfast+checkpointing")
    assert details["vlmfast+packing"]["data"]["collate"] == "PackingCollator"
    assert summary["vlmfast+packing"]["padding_fraction"] < summary["vlmfast"]["padding_fraction"] / 2
    assert details["vlmfast+group_by_length"]["data"]["sampler"] == "LengthGroupedSampler"
    assert details["vlmfast+workers"]["data"]["num_workers_reason"]  # the autotuner ran and said why
    assert details["vlmfast+prefetch"]["data"]["device_prefetch"]
    assert details["hf-best"]["sampler"] == "group_by_length" and details["hf-best"]["auto_find_batch_size"]
    assert details[START] == {}


def test_every_contender_sees_the_same_data(quick):
    workload, result, _ = quick
    expected_tokens = sum(workload.dataset.lengths) + workload.image_tokens * len(workload.dataset)
    for name, s in result["summary"].items():
        assert s["samples_total"] == len(workload.dataset), name
        assert s["tokens_total"] == expected_tokens, name
    # Same init, same batches in the same order, same fp32 maths: the equal-settings rows end at the same weights.
    evals = [result["summary"][name]["eval_loss"] for name in EQUAL]
    assert max(evals) - min(evals) < 1e-3 * evals[0]


def test_the_json_keeps_every_step_time_and_the_table_states_p90_over_p50(quick):
    _, _, paths = quick
    written = json.loads(paths["json"].read_text())
    for name, runs in written["runs"].items():
        for run in runs:
            times = run["step_times_s"]
            assert len(times) == run["timed_steps"] == 2 and len(run["warmup_step_times_s"]) == 1, name
            assert run["step_time_p50_s"] in times and run["step_time_p90_s"] == max(times), name
            assert run["step_time_p90_over_p50"] == pytest.approx(run["step_time_p90_s"] / run["step_time_p50_s"])
            assert run["slowest_step"] == 1 + times.index(max(times))  # counted from the first warm-up step
        assert written["summary"][name]["step_time_p90_over_p50"] >= 1.0
    table = paths["md"].read_text()
    assert "step p50 / p90 (ms), p90/p50 |" in table and "step_times_s" in table
    compile_row = next(line for line in table.splitlines() if line.startswith("| vlmfast+compile |"))
    assert "; compile ~" in compile_row and "s in warm-up" in compile_row  # apart from the step times
    assert written["summary"]["vlmfast+compile"]["warmup_excess_s"] >= 0
    ratio = written["summary"]["start"]["step_time_p90_over_p50"]
    assert f", {ratio:.2f} |" in next(line for line in table.splitlines() if line.startswith("| start |"))


def test_a_gpu_table_below_30_steps_or_3_rounds_says_its_p90_is_a_few_steps():
    result = _synthetic({"start": (100.0, START_LOSSES)})
    result["environment"] = {**result["environment"], "device": "nvidia-h200"}
    assert "Fewer than 30 timed steps" not in comparison_markdown(result)  # 40 steps, 3 rounds
    result["workload"]["steps"] = 10
    assert "Fewer than 30 timed steps or 3 rounds on a GPU" in comparison_markdown(result)


def test_compile_blocks_compiles_each_repeated_block_in_place_found_by_structure():
    from torch import nn

    from vlmfast.bench.runners import Settings, compile_blocks

    class Eyes(nn.Module):  # names no table knows: the stacks are found by their shape
        def __init__(self):
            super().__init__()
            self.retina = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))
            self.head = nn.Linear(4, 2)

    model = Eyes()
    assert compile_blocks(model, Settings()) == 0 and model.retina[0]._compiled_call_impl is None
    assert compile_blocks(model, Settings(compile=True, compile_backend="eager")) == 3
    assert all(block._compiled_call_impl is not None for block in model.retina)
    assert model._compiled_call_impl is None and model.head._compiled_call_impl is None  # not the whole model
    assert list(model.state_dict()) == list(Eyes().state_dict())  # in place: the names stay
    with pytest.raises(ValueError, match="no repeated blocks"):
        compile_blocks(nn.Linear(2, 2), Settings(compile=True))


@pytest.mark.parametrize("contender", ["hand-written", "accelerate", "hf-trainer", "fabric"])
def test_every_tool_s_compile_row_compiles_the_blocks_vlmfast_s_scope_blocks_compiles(contender, quick):
    """The peers' compile rows compile per block, as vlmfast's compile.scope: blocks does: the same block count."""
    from vlmfast.bench.configs import RUNNERS
    from vlmfast.bench.runners import Settings

    torch.set_num_threads(1)
    _, result, _ = quick
    vlmfast_line = next(line for line in result["summary"]["vlmfast+compile"]["details"]["strategies"]
                        if line.startswith("torch.compile"))
    run = RUNNERS[contender](build_workload("cpu", steps=1, warmup=0, batch_size=4),
                             Settings(compile=True, compile_backend="eager"), CPU)
    assert f"torch.compile: {run.details['compiled_blocks']} blocks" in vlmfast_line
    assert run.details["compiled_blocks"] >= 2 and len(run.step_times) == 1


def test_headroom_checkpointing_fits_more_and_the_oom_fallback_completes():
    torch.set_num_threads(1)
    workload = build_workload("cpu", steps=1, warmup=0, batch_size=8)
    result = run_headroom(workload, CPU, max_size=16, steps=2)
    found = result["strategies"]
    assert found["checkpointing"]["largest"] > found["plain (fp32, eager)"]["largest"] == 8
    demo = result["oom_fallback"]
    assert demo["batch_size"] == 16
    assert not demo["hand-written"]["completed"] and "OutOfMemoryError" in demo["hand-written"]["error"]
    fallback = demo["vlmfast (oom.enabled)"]
    assert fallback["completed"] and fallback["steps"] == 2
    assert fallback["micro_batch_size"] == 8 and fallback["batch_size"] == 16


def test_cli_registers_bench_and_renders_docs_from_json(quick, tmp_path):
    parser = argparse.ArgumentParser(prog="vlmfast")
    add_bench_command(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["bench", "--quick", "--configs", "start,vlmfast", "--no-headroom"])
    assert args.quick and args.configs == "start,vlmfast" and callable(args.run)
    _, result, paths = quick
    doc = tmp_path / "benchmarks.md"
    doc.write_text("# Benchmarks\n<!-- vlmfast-bench:compare_quick -->\nold\n<!-- /vlmfast-bench:compare_quick -->\n")
    assert main(["--render", str(paths["json"]), "--docs", str(doc)]) == 0
    text = doc.read_text()
    assert "old" not in text and "| vlmfast+packing |" in text and text.startswith("# Benchmarks")
    assert not update_doc(doc, "missing", "x")
    assert comparison_markdown(result).count("| vlmfast") >= 10


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_every_vlmfast_configuration_is_a_valid_spec(device_type):
    """The CUDA rows cannot run here, but their specs must validate (a typo would only show on a GPU)."""
    for config in build_configs(device_type):
        if config.contender == "vlmfast":
            TrainSpec(**_deep_merge({"device": "cpu", "max_steps": 2}, config.settings.spec))
    assert best_spec(device_type)


def test_without_leaves_a_strategy_out_of_every_best_row_alike():
    """`--without compile` (a short GPU lease): no best row compiles, vlmfast's or the other tools'; the rest stays."""
    full = {c.name: c for c in build_configs("cuda")}
    lease = {c.name: c for c in build_configs("cuda", ["compile"])}
    assert full["vlmfast-best"].settings.spec["compile"]["enabled"] and full["hf-best"].settings.compile
    assert "compile" not in lease["vlmfast-best"].settings.spec and "compile" not in lease["vlmfast-best"].description
    assert not any(lease[name].settings.compile for name in ("accelerate-best", "hf-best", "fabric-best"))
    assert lease["vlmfast-best"].settings.spec["precision"] == "bf16" and lease["hf-best"].settings.precision == "bf16"
    assert lease["vlmfast+compile"].settings.spec == full["vlmfast+compile"].settings.spec  # its own row stays
    with pytest.raises(ValueError, match=r"unknown strategy.*'complie'.*choose from"):
        build_configs("cuda", ["complie"])


# ---- quality-adjusted throughput (pure logic on synthetic results: no training) ---------------------------------
def _synthetic(rows: dict[str, tuple[float, list[float]]], spread_in_summary: bool = True) -> dict:
    """A compare result with rows name -> (samples/s, eval loss per round); "start" must be among them."""
    start_speed = rows["start"][0]
    summary, runs, ratios = {}, {}, {}
    for name, (speed, losses) in rows.items():
        runs[name] = [{"samples_per_s": speed, "step_time_p50_s": 1 / speed, "eval_loss": loss} for loss in losses]
        ordered = sorted(losses)
        summary[name] = {"samples_per_s": speed, "tokens_per_s": 10 * speed, "step_time_p50_s": 1 / speed,
                         "step_time_p90_s": 1 / speed, "peak_memory_gb": 0.1, "memory_kind": "process RSS increase",
                         "tflops": 0.01, "padding_fraction": 0.3, "final_train_loss": ordered[len(ordered) // 2],
                         "eval_loss": ordered[len(ordered) // 2], "repeats": len(losses), "details": {}}
        if spread_in_summary:
            summary[name].update(eval_loss_min=ordered[0], eval_loss_max=ordered[-1])
        ratios[name] = {"vs_start": speed / start_speed, "p50_vs_start": speed / start_speed}
    return {"benchmark": "compare", "environment": environment(CPU), "repeats": 3,
            "workload": {"size": "cpu", "parameters": 587_000, "batch_size": 16, "steps": 40, "warmup_steps": 5,
                         "sample_tokens": {"min": 16, "mean": 40.0, "max": 66}},
            "configs": [{"name": n, "contender": "vlmfast", "description": n, "skipped": None} for n in rows],
            "summary": summary, "runs": runs, "ratios": ratios, "skipped": {}, "must_show": []}


START_LOSSES = [1.050, 1.052, 1.054]


def test_a_faster_row_that_trains_worse_beyond_the_noise_is_not_called_faster():
    from vlmfast.bench.harness import check_must_show
    from vlmfast.bench.quality import quality_table

    result = _synthetic({"start": (100.0, START_LOSSES), "vlmfast-best": (150.0, [1.110, 1.115, 1.118])})
    verdict = quality_table(result)["vlmfast-best"]
    assert verdict["verdict"] == "worse" and verdict["delta"] == pytest.approx(0.063 / 1.052, rel=1e-6)
    assert not verdict["credited"] and verdict["adjusted_samples_per_s"] is None
    assert verdict["adjusted_vs_start"] is None
    check = next(c for c in check_must_show(result["ratios"], "cpu", result) if c["rule"].startswith(
        "throughput(vlmfast-best vs start)"))
    assert check["value"] == pytest.approx(1.5) and check["met"] is False and "worse" in check["quality"]
    row = next(line for line in comparison_markdown(result).splitlines() if line.startswith("| vlmfast-best |"))
    assert "n/a: eval loss +6.0 % (worse than noise" in row and "worse: eval loss +6.0 %" in row
    # On speed alone (no result given) the same ratio would pass: the quality rule is what stops it.
    alone = next(c for c in check_must_show(result["ratios"], "cpu") if c["rule"].startswith("throughput"))
    assert alone["met"] is True


def test_a_row_within_the_noise_or_better_is_credited_with_its_speed():
    from vlmfast.bench.quality import quality_table, quality_verdict

    result = _synthetic({"start": (100.0, START_LOSSES), "same": (120.0, [1.055, 1.058, 1.060]),
                         "noisy": (130.0, [1.02, 1.08, 1.14]), "better": (110.0, [0.98, 0.99, 1.00])})
    table = quality_table(result)
    assert table["same"]["verdict"] == "same" and table["same"]["adjusted_vs_start"] == pytest.approx(1.2)
    # +2.7 % is beyond the 1 % floor but inside this row's own spread over rounds (0.12): not called worse.
    assert table["noisy"]["verdict"] == "same" and table["noisy"]["noise"] == pytest.approx(0.12 / 1.052)
    assert table["better"]["verdict"] == "better" and table["better"]["adjusted_samples_per_s"] == 110.0
    # One round: no spread, the stated relative tolerance decides.
    assert quality_verdict(1.009, 0.0, 1.0, 0.0)["verdict"] == "same"
    assert quality_verdict(1.011, 0.0, 1.0, 0.0)["verdict"] == "worse"
    markdown = comparison_markdown(result)
    row = next(line for line in markdown.splitlines() if line.startswith("| same |"))
    assert row.endswith("| 1.20 |") and "1.0580 (1.0550-1.0600)" in row


def test_markdown_has_the_quality_columns_and_their_definitions():
    result = _synthetic({"start": (100.0, START_LOSSES), "vlmfast": (101.0, START_LOSSES)})
    markdown = comparison_markdown(result)
    header = next(line for line in markdown.splitlines() if line.startswith("| configuration |"))
    assert "| eval loss (min-max) | quality vs start | quality-adjusted x start |" in header
    assert "Quality vs start:" in markdown and "Quality-adjusted x start:" in markdown
    assert "at least 1% of the starting point's loss" in markdown and "not called faster" in markdown


def test_render_of_an_old_compare_json_without_spread_data(tmp_path):
    """Results written before the quality columns: no eval_loss_min/max, no "quality"; one of them without runs."""
    result = _synthetic({"start": (100.0, START_LOSSES), "hf-best": (130.0, [1.12, 1.12, 1.12])},
                        spread_in_summary=False)
    result["must_show"] = [{"what": "old", "rule": "throughput(x vs start) > 1.0", "value": 1.3, "met": True}]
    del result["runs"]["hf-best"]
    path = tmp_path / "compare.json"
    path.write_text(json.dumps(result))
    assert main(["--render", str(path)]) == 0
    table = (tmp_path / "compare.md").read_text()
    assert "| hf-best |" in table and "n/a: eval loss +6.5 %" in table and "1.0520 (1.0500-1.0540)" in table
    assert "Targets:" in table


# ---- the cpu-vlm size (built, not trained) -----------------------------------------------------------------------
def test_cpu_vlm_size_builds_a_20m_model_on_long_tailed_multi_image_data():
    from vlmfast.bench.configs import _strategies
    from vlmfast.bench.multi_image import MultiImageShapesDataset
    from vlmfast.data.packing import build_packing_collator

    torch.set_num_threads(1)
    workload = build_workload("cpu-vlm")
    described = workload.describe()
    assert described["parameters"] == workload.num_parameters >= 20_000_000
    assert (workload.steps, workload.warmup, workload.batch_size) == (SIZES["cpu-vlm"].steps, 2, 4)
    assert sorted(set(workload.dataset.images_per_sample())) == [0, 1, 2, 3, 4]
    counts = workload.dataset.images_per_sample()
    assert described["images_per_sample"] == {"min": 0, "mean": pytest.approx(sum(counts) / len(counts)), "max": 4}
    assert 1.5 < sum(counts) / len(counts) < 2.5  # 0-4 images, uniform
    # The generator's text lengths: 16..1024, log-normal (median ~64, a tail of a few % past 500).
    data = MultiImageShapesDataset(2000, seed=0)
    text = torch.tensor([len(data.caption_ids(i)) - 9 * data.num_images(i) for i in range(2000)], dtype=torch.float)
    assert int(text.min()) == 16 and int(text.max()) == 1024
    assert 50 <= float(text.median()) <= 80 and float(text.mean()) > 1.6 * float(text.median())
    assert 0.01 < float((text > 500).float().mean()) < 0.06
    # Batches with 0 images, and packing: the bench's packing spec gives the padded batch's loss.
    samples = [workload.dataset[i] for i in range(6)]
    empty = [s for s in (data[i] for i in range(40)) if not s["images"]][:2]
    model = workload.build_model("sdpa").eval()
    spec = TrainSpec(packing=_strategies("cpu", size="cpu-vlm")["packing"][0]["packing"])
    assert spec.packing.max_tokens == 1060 and spec.packing.image_tokens == 0
    packed = build_packing_collator(spec.packing, model, workload.collate)(samples)
    padded = workload.collate(samples)
    with torch.no_grad():
        assert torch.isfinite(model(**workload.collate(empty)).loss)
        assert float(model(**packed).loss) == pytest.approx(float(model(**padded).loss), rel=1e-5)
    assert packed["input_ids"].shape[0] < padded["input_ids"].shape[0]
    stats = [workload.batch_stats(b) for b in (padded, packed)]
    assert float(stats[0]["tokens"]) == float(stats[1]["tokens"]) == sum(len(s["input_ids"]) for s in samples)
    assert float(stats[0]["flops"]) == pytest.approx(float(stats[1]["flops"]))
    assert int(padded["images_per_row"].sum()) == sum(len(s["images"]) for s in samples)


def test_cli_takes_steps_and_warmup_from_the_size():
    from vlmfast.bench.cli import _size_defaults, build_parser

    args = build_parser().parse_args(["--size", "cpu-vlm"])
    _size_defaults(args, "cpu-vlm")
    assert (args.steps, args.warmup) == (SIZES["cpu-vlm"].steps, SIZES["cpu-vlm"].warmup)
    args = build_parser().parse_args(["--steps", "3"])
    _size_defaults(args, "cpu")
    assert (args.steps, args.warmup) == (3, 5)


def test_quick_leaves_the_headroom_search_out_and_says_how_to_run_it(monkeypatch, capsys, tmp_path):
    """`bench --quick` stays a smoke test under a minute on 2 cores: the headroom search (~40 s there) only runs
    when asked for (--headroom-only)."""
    import vlmfast.bench.cli as bench_cli

    ran = []
    monkeypatch.setattr(bench_cli, "_compare", lambda *a: ran.append("compare") or tmp_path / "c.json")
    monkeypatch.setattr(bench_cli, "_headroom", lambda *a: ran.append("headroom") or tmp_path / "h.json")
    assert bench_cli.main(["--quick", "--out", str(tmp_path)]) == 0
    assert ran == ["compare"] and "--headroom-only` runs it" in capsys.readouterr().out
    assert bench_cli.main(["--quick", "--headroom-only", "--out", str(tmp_path)]) == 0
    assert ran == ["compare", "headroom"]
    assert bench_cli.main(["--steps", "1", "--configs", "start", "--out", str(tmp_path)]) == 0
    assert ran == ["compare", "headroom", "compare", "headroom"]


# ---- the gpu-1b size: a Hugging Face LLaVA at 1.4B parameters; trained here at toy scale only ---------------------
def test_gpu_1b_is_a_1_4b_llava_whose_batch_fills_80_gb_by_the_estimator():
    from transformers import LlavaForConditionalGeneration

    from vlmfast.bench.hf_vlm import fill_batch_size, llava_config
    from vlmfast.memory.known_models import estimate_from_hf_config

    config = llava_config("gpu-1b")
    with torch.device("meta"):
        model = LlavaForConditionalGeneration(config)
    assert 1.0e9 < sum(p.numel() for p in model.parameters()) < 2.0e9
    longest = 576 + 1448
    batch, gib = fill_batch_size(config, longest)
    assert batch >= 2 and gib <= 0.9 * 80
    over = estimate_from_hf_config(config, micro_batch_size=batch + 1, seq_len=longest, gpu_memory_gb=80)
    assert not over.fits(80)  # one more sample would not fit: the batch fills the card
    fp32, _ = fill_batch_size(config, longest, precision="fp32", attention="eager")
    assert 1 <= fp32 < batch  # the starting point accumulates micro-batches of this size


def test_gpu_1b_dry_run_trains_every_row_on_a_toy_llava_with_the_models_own_flops(tmp_path):
    from vlmfast.bench.hf_vlm import ProcessorCollator
    from vlmfast.profiling import analytic_flops

    torch.set_num_threads(1)
    assert main(["--size", "gpu-1b", "--dry-run", "--no-headroom", "--out", str(tmp_path)]) == 0
    written = json.loads((tmp_path / "compare_gpu-1b_quick.json").read_text())
    assert [c["name"] for c in written["configs"]] == list(SIZES["gpu-1b"].configs) and not written["skipped"]
    work = written["workload"]
    assert "LlavaForConditionalGeneration" in work["model"] and work["config"]["model_type"] == "llava"
    totals = {s["samples_total"] for s in written["summary"].values()}
    assert totals == {work["samples_per_run"]} and all(s["tflops"] > 0 for s in written["summary"].values())
    # the processor's layout: the image's tokens in input_ids (not in labels), CLIP-normalised pixels per image
    workload = build_workload("gpu-1b", toy=True, steps=1, warmup=0)
    assert isinstance(workload.collate, ProcessorCollator)
    samples = [workload.dataset[i] for i in range(2)]
    batch = workload.collate(samples)
    image = batch["input_ids"] == workload.config.image_token_index
    assert image.sum(-1).tolist() == [workload.image_tokens] * 2 and (batch["labels"][image] == -100).all()
    assert batch["pixel_values"].shape == (2, 3, 28, 28) and batch["pixel_values"].min() < 0
    # FLOPs: the Hugging Face model's analytic count (its towers, each sample's own length), not the tiny VLM's
    model = workload.build_model("sdpa")
    expected = sum(analytic_flops(model, workload.collate([sample])) for sample in samples)
    assert float(workload.batch_stats(batch)["flops"]) == pytest.approx(expected, rel=1e-9)
