"""benchmarks/gpu_check.sh --dry-run: every step of the GPU owner's one command runs here, at toy sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ["gpu_tests", "overhead", "attention", "attention_packed", "headroom", "compare", "sync_check"]


@pytest.mark.timeout(900)
def test_gpu_check_dry_run_runs_every_step_and_writes_the_summary(tmp_path):
    env = {**os.environ, "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    run = subprocess.run(["bash", "benchmarks/gpu_check.sh", "--dry-run", "--out", str(tmp_path)], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=880)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    summary = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [s["step"] for s in summary["steps"]] == STEPS
    assert all(s["status"] == "ok" for s in summary["steps"]), summary["steps"]
    assert summary["dry_run"] and summary["device"] == "cpu" and summary["versions"]["torch"]
    for name in ("overhead.json", "attention.json", "attention_packed4.json", "headroom_quick.json",
                 "compare_quick.json", "sync_check.json"):
        assert (tmp_path / name).exists(), name
    syncs = json.loads((tmp_path / "sync_check.json").read_text())["configs"]
    assert syncs["default"]["within_budget"] and syncs["packing"]["within_budget"], syncs
    compare = json.loads((tmp_path / "compare_quick.json").read_text())
    assert not compare["skipped"] and "fabric-best" in compare["runs"]  # it raised after hf-best's TF32 on a GPU
