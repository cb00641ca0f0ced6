"""`vlmfast bench`'s command side: a --quick smoke run judges no target and leaves nothing in the repository, and the
help's step counts are the sizes' own.

- `--quick` (2 steps, one round) prints "not measured: --quick" where a full run prints each target's verdict;
- without --out, `--quick` writes under runs/bench-quick/<device>/, a folder git ignores (a full run keeps writing
  benchmarks/results/<device>/, the results the docs include);
- `bench --help` gives each size's timed and warm-up steps from SIZES.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from vlmfast.bench import cli as bench_cli
from vlmfast.bench.report import comparison_markdown
from vlmfast.bench.workload import SIZES

ROOT = Path(__file__).resolve().parents[1]
STORED = ROOT / "benchmarks" / "results" / "cpu" / "compare.json"  # a real full run's result


def test_a_quick_result_prints_no_target_verdict_and_a_full_one_does():
    result = json.loads(STORED.read_text())
    full = comparison_markdown(result)
    assert "(**met**)" in full or "(**NOT met**)" in full
    quick = comparison_markdown({**result, "quick": True})
    assert "met**" not in quick and "- not measured: --quick (2 steps, one round" in quick
    assert quick.split("Targets:")[0] == full.split("Targets:")[0]  # the table itself is the same


@pytest.mark.parametrize(("argv", "expected"), [
    (["--quick"], "runs/bench-quick/cpu/compare_quick"),
    (["--steps", "1"], "benchmarks/results/cpu/compare"),
])
def test_quick_writes_where_git_ignores_it_unless_out_says_otherwise(monkeypatch, tmp_path, argv, expected):
    written = []
    monkeypatch.setattr(bench_cli, "_compare", lambda args, device, size, path: written.append(path) or path)
    assert bench_cli.main([*argv, "--device", "cpu", "--no-headroom", "--configs", "start"]) == 0
    assert written == [Path(expected)]
    ignored = subprocess.run(["git", "check-ignore", "-q", f"{expected}.json"], cwd=ROOT, check=False).returncode == 0
    assert ignored == ("--quick" in argv)
    assert bench_cli.main(["--quick", "--out", str(tmp_path), "--device", "cpu", "--no-headroom"]) == 0
    assert written[-1] == tmp_path / "compare_quick"


def test_the_help_gives_each_sizes_own_step_counts():
    text = " ".join(bench_cli.build_parser().format_help().split())
    for name, size in SIZES.items():
        assert f"{name} {size.steps}" in text.split("--warmup WARMUP")[-2]  # in the --steps help
        assert f"{name} {size.warmup}" in text.split("--warmup WARMUP")[-1]
