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
from vlmfast.bench.workload import build_workload
from vlmfast.spec import TrainSpec

CPU = torch.device("cpu")
EQUAL = ("start", "vlmfast", "vlmfast-defaults", "accelerate", "hf-trainer", "fabric")


def _ci_configs():
    """All CPU configurations as `bench --quick` runs them: compile through aot_eager (dynamo still captures the
    graph, without inductor's C++ build, which alone takes minutes on 2 cores with a cold cache)."""
    return build_configs("cpu", quick=True)


def test_quick_configurations_build_no_cpp_kernels_and_say_so():
    quick = {c.name: c for c in build_configs("cpu", quick=True)}
    full = {c.name: c for c in build_configs("cpu")}
    assert quick["vlmfast+compile"].settings.spec["compile"]["backend"] == "aot_eager"
    assert "--quick builds no C++ kernels" in quick["vlmfast+compile"].description
    assert full["vlmfast+compile"].settings.spec["compile"]["backend"] == "inductor"
    cuda_quick = {c.name: c for c in build_configs("cuda", quick=True)}
    assert cuda_quick["accelerate-best"].settings.compile and cuda_quick["accelerate-best"].settings.compile_backend \
        == "aot_eager"


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
    assert "torch.compile: whole model (aot_eager" in lines("vlmfast+compile")
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
