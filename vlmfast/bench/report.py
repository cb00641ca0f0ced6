"""Results of ``vlmfast bench`` as files: JSON (with the machine, versions and command), a Markdown table, PNG charts,
and the table written into a Markdown document between markers (so docs show generated numbers, never copied ones).

Usage::

    paths = write_results(result, out_dir="benchmarks/results/cpu", name="compare_cpu")
    print(comparison_markdown(json.loads(paths["json"].read_text())))
    update_doc("docs/benchmarks.md", "compare-cpu", comparison_markdown(result))
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

from vlmfast.bench.quality import QUALITY_TOLERANCE, eval_loss_spread, quality_table, quality_text
from vlmfast.common.safe_files import library_output, write_atomic

__all__ = ["comparison_markdown", "device_dir", "environment", "headroom_markdown", "plot_comparison",
           "plot_headroom", "update_doc", "write_results"]

_PACKAGES = ("torch", "transformers", "accelerate", "lightning-fabric", "vlmfast")


def device_dir(device: torch.device) -> str:
    """The results sub-folder for a device: ``cpu`` or the GPU's name, e.g. ``nvidia-h100-80gb-hbm3``."""
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-").lower()
    return device.type


def environment(device: torch.device) -> dict[str, Any]:
    """What a reader needs to reproduce a number: machine, versions, threads, command, date."""
    versions = {}
    for name in _PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return {
        "device": device_dir(device), "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(), "python": platform.python_version(), "versions": versions,
        "cuda": torch.version.cuda if device.type == "cuda" else None,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]), "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def write_results(result: dict[str, Any], out_dir: str | Path, name: str) -> dict[str, Path]:
    """Write ``<name>.json``, ``<name>.md`` and the PNG charts into `out_dir`; returns their paths by kind."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{name}.json", "md": out / f"{name}.md"}
    write_atomic(paths["json"], json.dumps(result, indent=2, default=str) + "\n", what="bench result")
    is_headroom = result.get("benchmark") == "headroom"
    write_atomic(paths["md"], (headroom_markdown(result) if is_headroom else comparison_markdown(result)) + "\n",
                 what="bench result")
    if is_headroom:
        paths["png"] = plot_headroom(result, out / f"{name}.png")
    else:
        paths["throughput_png"], paths["memory_png"] = plot_comparison(result, out, name)
    return paths


# ---- Markdown --------------------------------------------------------------------------------------------------
def _header(result: dict[str, Any]) -> str:
    env, work = result["environment"], result["workload"]
    versions = ", ".join(f"{k} {v}" for k, v in env["versions"].items() if v)
    return (f"Machine: {env['device']} ({env['cpu']}, {env['cpu_count']} CPUs, {env['torch_threads']} torch "
            f"thread(s)); {versions}; {env['date']}.  \n"
            f"Command: `{env['command']}`.  \n"
            f"Model: {work.get('model', 'built-in tiny VLM')}, size `{work['size']}` ({_parameters(work)}); "
            f"batch {work['batch_size']}, {work['steps']} timed steps after {work['warmup_steps']} warm-up, "
            f"{result.get('repeats', 1)} interleaved round(s), medians; samples of {work['sample_tokens']['min']}-"
            f"{work['sample_tokens']['max']} tokens (mean {work['sample_tokens']['mean']:.1f}, image tokens "
            f"included){_images(work)}.{_few_steps(result)}")


def _parameters(work: dict[str, Any]) -> str:
    count = work["parameters"]
    return f"{count / 1e9:.2f}B parameters" if count >= 1e9 else f"{count / 1e6:.2f}M parameters"


# Below these a GPU table's p90 is one of the few slowest steps of few runs: one stall decides it (issue 33).
GPU_MINIMUM = {"steps": 30, "repeats": 3}


def _few_steps(result: dict[str, Any]) -> str:
    work = result["workload"]
    if result["environment"].get("device") == "cpu" or result.get("quick") or (
            work["steps"] >= GPU_MINIMUM["steps"] and result.get("repeats", 1) >= GPU_MINIMUM["repeats"]):
        return ""
    return (f"  \n**Fewer than {GPU_MINIMUM['steps']} timed steps or {GPU_MINIMUM['repeats']} rounds on a GPU**: "
            f"the p90 is one of the slowest few steps, a single stall decides it.")


def _images(work: dict[str, Any]) -> str:
    images = work.get("images_per_sample")
    if not images or images["min"] == images["max"] == 1:
        return ""
    return f", {images['min']}-{images['max']} images per sample (mean {images['mean']:.1f})"


def _memory(gb: float | None, kind: str) -> str:
    if gb is None:
        return "-"
    text = f"{gb:.2f} GiB" if gb >= 1 else f"{gb * 1024:.0f} MiB"
    return text + (" (RSS)" if "RSS" in kind else "")


def comparison_markdown(result: dict[str, Any]) -> str:
    """The comparison as Markdown: header (machine, versions, command), one row per configuration, must-shows."""
    rows = ["| configuration | what it switches on | samples/s | x start | real tokens/s | "
            "step p50 / p90 (ms), p90/p50 | peak memory | TFLOP/s | MFU | padding | train loss | eval loss (min-max) | "
            "quality vs start | quality-adjusted x start |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    summary, ratios = result["summary"], result["ratios"]
    quality = quality_table(result)  # computed, not read: an old JSON without it renders the same way
    for config in result["configs"]:
        name = config["name"]
        if name not in summary:
            rows.append(f"| {name} | {config['description']} | skipped: {config['skipped'] or 'no run'} "
                        "| | | | | | | | | | | |")
            continue
        s = summary[name]
        mfu = f"{s['mfu']:.1%}" if s.get("mfu") is not None else "n/a"
        rows.append(
            f"| {name} | {config['description']}{_compile_time(config, s)} | {s['samples_per_s']:.1f} | "
            f"{ratios[name].get('vs_start', float('nan')):.2f} | {s['tokens_per_s']:.0f} | "
            f"{s['step_time_p50_s'] * 1e3:.1f} / {s['step_time_p90_s'] * 1e3:.1f}, {_tail(s)} | "
            f"{_memory(s.get('peak_memory_gb'), s['memory_kind'])} | {s['tflops']:.3f} | {mfu} | "
            f"{s['padding_fraction']:.0%} | {s['final_train_loss']:.4f} | {_eval_loss(result, name)} | "
            f"{_quality(quality.get(name))} | {_adjusted(quality.get(name))} |")
    lines = [_header(result), "", *rows, "", _notes(result), "", _quality_notes(), "", "Targets:", ""]
    if result.get("quick"):  # 2 steps, one round: too few to judge a ratio, only that every row runs
        return "\n".join([*lines, "- not measured: --quick (2 steps, one round; it shows that every row runs, not how "
                          "fast: run without --quick to judge the targets)"])
    for check in _checks(result):
        mark = {True: "met", False: "NOT met", None: "not measured"}[check["met"]]
        value = "n/a" if check["value"] is None else f"{check['value']:.3f}"
        note = f"; quality: {check['quality']}" if check.get("quality") else ""
        lines.append(f"- {check['what']}: `{check['rule']}` -> {value}{note} (**{mark}**)")
    return "\n".join(lines)


def _compile_time(config: dict[str, Any], summary: dict[str, Any]) -> str:
    """A compile row's compilation time, apart from its step times: the warm-up steps' time above steady steps."""
    settings = config.get("settings", {})
    compiles = settings.get("compile") is True or bool(settings.get("spec", {}).get("compile", {}).get("enabled"))
    if not compiles or summary.get("warmup_excess_s") is None:
        return ""
    return f"; compile ~{summary['warmup_excess_s']:.1f} s in warm-up"


def _tail(summary: dict[str, Any]) -> str:
    """p90/p50 of the step times (median over rounds); an old JSON without it: from the medians of p90 and p50."""
    ratio = summary.get("step_time_p90_over_p50") or summary["step_time_p90_s"] / summary["step_time_p50_s"]
    return f"{ratio:.2f}"


def _eval_loss(result: dict[str, Any], name: str) -> str:
    loss = result["summary"][name]["eval_loss"]
    spread = eval_loss_spread(result, name)
    if spread is None or result["summary"][name].get("repeats", 1) < 2:  # one round: no spread to show
        return f"{loss:.4f}"
    return f"{loss:.4f} ({spread[0]:.4f}-{spread[1]:.4f})"


def _quality(verdict: dict[str, Any] | None) -> str:
    return "n/a" if verdict is None else quality_text(verdict)


def _adjusted(verdict: dict[str, Any] | None) -> str:
    if verdict is None:
        return "n/a"
    if not verdict["credited"]:
        return f"n/a: eval loss {100 * verdict['delta']:+.1f} % (worse than noise ±{100 * verdict['noise']:.1f} %)"
    ratio = verdict["adjusted_vs_start"]
    return "n/a" if ratio is None else f"{ratio:.2f}"


def _quality_notes() -> str:
    return (f"Eval loss: median over rounds (min-max over the interleaved rounds). Quality vs start: the row's median "
            f"eval loss against the starting point's, in % of the starting point's; **same** when the difference is "
            f"within the noise, the larger of the two rows' min-max spreads and at least {QUALITY_TOLERANCE:.0%} of "
            f"the starting point's loss (rows that see the same batches end at the same loss every round: a zero "
            f"spread is no measure of how much training orders differ; with one round only this floor applies), "
            f"else **better** or **worse**. Quality-adjusted x start: the x start figure, credited only when the "
            f"quality is the same or better; a row that trains worse beyond the noise is not called faster (n/a). "
            f"A throughput target counts a row as ahead only under the same rule against the row it is compared "
            f"with.")


def _checks(result: dict[str, Any]) -> list[dict[str, Any]]:
    """The targets under the current rules (quality included), from the stored ratios; the stored list where a
    result has none (an old or hand-made file)."""
    if not result.get("ratios") or "environment" not in result:
        return result.get("must_show", [])
    from vlmfast.bench.harness import check_must_show

    device_type = "cpu" if result["environment"].get("device") == "cpu" else "cuda"
    return check_must_show(result["ratios"], device_type, result)


def _notes(result: dict[str, Any]) -> str:
    device = result["environment"]["device"]
    mfu = "MFU: against the GPU's bf16 dense peak for every row." if device != "cpu" else \
        "MFU: n/a on CPU (no peak table for CPUs; TFLOP/s is the achieved rate)."
    return (f"x start: median over rounds of the paired samples/s ratio against that round's starting point. "
            f"Real tokens exclude padding; TFLOP/s counts model FLOPs of the real tokens only (6N per token + "
            f"attention over each sample's own length, vision tower included), the same for every row. {mfu} "
            f"Step p50 / p90: over the timed steps; every step time of every run is in the JSON "
            f"(runs.ROW[round].step_times_s, the warm-up's in warmup_step_times_s, the slowest step's index in "
            f"slowest_step); a p90/p50 above 1.3 means stalls, not a slow step. "
            f"Padding: share of token positions the model computed on that were padding. Train loss: mean of the "
            f"last 20% of steps (batches differ when a row reorders or packs); eval loss: the same held-out "
            f"samples for every row, fp32. Best-set reason: {result.get('best_reason', '')}"
            + (f" This run's best rows leave out: {', '.join(result['best_without'])}."
               if result.get("best_without") else ""))


def headroom_markdown(result: dict[str, Any]) -> str:
    """The headroom benchmark as Markdown: largest micro-batch per strategy, then the OOM-fallback runs."""
    env = result["environment"]
    rows = ["| strategy | largest micro-batch | vs plain |", "|---|---|---|"]
    found = result["strategies"]
    plain = next(iter(found.values()))["largest"]
    for name, entry in found.items():
        capped = " (the largest size tried)" if entry["largest"] >= result["max_size_tried"] else ""
        rows.append(f"| {name} | {entry['largest']}{capped} | {entry['largest'] / plain:.1f}x |")
    demo = result["oom_fallback"]
    runs = ["| run | completed | what happened |", "|---|---|---|"]
    for name, run in demo.items():
        if isinstance(run, dict):
            runs.append(f"| {name} | {'yes' if run.get('completed') else 'no'} | {_what_happened(run)} |")
    budget = result["budget_bytes"] / 2**20
    return "\n".join([
        f"Machine: {env['device']}; torch {env['versions']['torch']}; {env['date']}. Command: `{env['command']}`.",
        f"Budget: {budget:.1f} MiB ({result['budget_kind']}); the longest samples of the data set, one step each.",
        "", *rows, "",
        f"OOM fallback at batch {demo['batch_size']} ({demo['limit']}), {demo['steps']} steps:", "", *runs])


def _what_happened(run: dict[str, Any]) -> str:
    if "error" in run:
        return run["error"]
    if "micro_batch_size" in run:
        return (f"{run['steps']} steps at batch {run['batch_size']} as {run['accumulation_steps']} micro-batches of "
                f"{run['micro_batch_size']} ({run['report']})")
    if "batch_size_used" in run:
        return f"{run['steps']} steps at batch {run['batch_size_used']} instead of {run['batch_size_requested']}"
    return f"{run.get('steps')} steps"


_MARKER = "<!-- vlmfast-bench:{key} -->"
_END = "<!-- /vlmfast-bench:{key} -->"


def update_doc(doc: str | Path, key: str, markdown: str) -> bool:
    """Replace the text between ``<!-- vlmfast-bench:KEY -->`` and ``<!-- /vlmfast-bench:KEY -->`` in `doc`.

    Returns False (and changes nothing) when the markers are missing. Usage: see the module docstring.
    """
    path = Path(doc)
    text = path.read_text()
    start, end = _MARKER.format(key=key), _END.format(key=key)
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.DOTALL)
    if not pattern.search(text):
        return False
    write_atomic(path, pattern.sub(lambda _: f"{start}\n{markdown}\n{end}", text), what="document")
    return True


# ---- charts ----------------------------------------------------------------------------------------------------
_COLORS = {"hand-written": "#7f7f7f", "vlmfast": "#1f77b4", "accelerate": "#ff7f0e", "hf-trainer": "#2ca02c",
           "fabric": "#9467bd"}


def _bar_chart(labels: list[str], values: list[float], colors: list[str], xlabel: str, title: str,
               path: Path, reference: float | None = None, notes: list[str] | None = None) -> Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed (CI, servers)
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 0.35 * len(labels) + 1.2))
    ax.barh(labels[::-1], values[::-1], color=colors[::-1])
    if reference is not None:  # the starting point, so every bar reads against it
        ax.axvline(reference, color="#444444", linestyle="--", linewidth=0.8)
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10)
    notes = notes or [""] * len(values)
    for y, (value, note) in enumerate(zip(values[::-1], notes[::-1], strict=True)):
        ax.text(value, y, f" {value:.3g}{note}", va="center", fontsize=8)
    fig.tight_layout()
    with library_output(path, what="bench chart") as tmp:  # matplotlib writes by name: a folder of our own
        fig.savefig(tmp, dpi=110)
    plt.close(fig)
    return path


def plot_comparison(result: dict[str, Any], out_dir: Path, name: str) -> tuple[Path, Path]:
    """Two horizontal bar charts: samples/s and peak memory per configuration (skipped ones left out)."""
    rows = [c for c in result["configs"] if c["name"] in result["summary"]]
    labels = [c["name"] for c in rows]
    colors = [_COLORS.get(c["contender"], "#333333") for c in rows]
    summary = result["summary"]
    device = result["environment"]["device"]
    start = summary.get("start", {})
    # A row that trains worse beyond the noise says so on its bar: speed alone would flatter it.
    quality = quality_table(result)
    notes = [f"  (eval loss {quality[n]['delta']:+.0%}: worse)" if n in quality and not quality[n]["credited"]
             else "" for n in labels]
    throughput = _bar_chart(labels, [summary[n]["samples_per_s"] for n in labels], colors, "samples/s (median)",
                            f"Training throughput, {device} (dashed: starting point)",
                            out_dir / f"{name}_throughput.png", reference=start.get("samples_per_s"), notes=notes)
    kind = next(iter(summary.values()))["memory_kind"] if summary else ""
    memory = _bar_chart(labels, [(summary[n].get("peak_memory_gb") or 0) * 1024 for n in labels], colors,
                        f"peak memory, MiB ({kind})", f"Peak memory, {device}", out_dir / f"{name}_memory.png")
    return throughput, memory


def plot_headroom(result: dict[str, Any], path: Path) -> Path:
    """Largest micro-batch per strategy under the same budget."""
    found = result["strategies"]
    return _bar_chart(list(found), [v["largest"] for v in found.values()], ["#1f77b4"] * len(found),
                      "largest micro-batch (samples)", f"Memory headroom, {result['environment']['device']}", path)
