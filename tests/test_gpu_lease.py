"""benchmarks/gpu_lease.sh rehearsed on CPU: a GPU lease must not be wasted on an install error or a hung step.

- the wheels `prepare` downloads are a complete install of what the device image lacks, for its cp312 / manylinux;
- `run` with stub steps: at most 8 files in --out, a step made to hang is cut at the deadline with the summary still
  written, everything before it already copied, and only `python3` on PATH (the image has no `python`).
The full `run --dry-run` at toy sizes, from a python without pydantic, is in docs/benchmarks.md (it takes minutes).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "gpu_lease.sh"
IMAGE = ["--python-version", "3.12", "--implementation", "cp", "--abi", "cp312", "--platform", "manylinux_2_28_x86_64",
         "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux2014_x86_64"]


@pytest.fixture(scope="module")
def wheels(tmp_path_factory) -> Path:
    """`gpu_lease.sh prepare` into a fresh folder (a download of ~3 MB from PyPI, as the setup's own installs)."""
    dest = tmp_path_factory.mktemp("wheels")
    run = subprocess.run(["bash", str(SCRIPT), "prepare", "--dest", str(dest)], env={**os.environ,
                         "PYTHON": sys.executable}, capture_output=True, text=True, timeout=300)
    unreachable = ("Temporary failure in name resolution", "Network is unreachable", "Failed to establish a new "
                   "connection", "Max retries exceeded")
    if run.returncode and any(sign in run.stderr for sign in unreachable):  # no network: nothing to rehearse
        pytest.skip(f"PyPI unreachable here: {run.stderr[-500:]}")
    assert run.returncode == 0, run.stderr[-2000:]
    return dest


def test_prepared_wheels_install_vlmfast_s_missing_requirements_on_the_image(wheels):
    names = sorted(p.name.split("-")[0].lower() for p in wheels.glob("*.whl"))
    assert {"pydantic", "pydantic_core", "annotated_types", "typing_inspection"} <= set(names), names
    assert sum(p.stat().st_size for p in wheels.iterdir()) < 16 * 2**20  # far below the 64 MiB the tree may carry
    # pip resolves pydantic for the image's Python and platform from these files alone (the exact pydantic-core pin)
    check = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--no-index",
                            "--find-links", str(wheels), "--only-binary=:all:", *IMAGE, "--target", str(wheels / "t"),
                            "pydantic>=2.6"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout[-1500:] + check.stderr[-1500:]
    assert "Would install" in check.stdout and "pydantic-core" in check.stdout.replace("_", "-")


def _python3_only_path(tmp_path: Path) -> str:
    """A PATH with `python3` (this interpreter) and the shell tools, but no `python`."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(sys.executable)
    for tool in ("bash", "date", "timeout", "tar", "gzip", "cp", "mkdir", "mktemp", "ls", "wc", "cat", "tail", "sed",
                 "grep", "tr", "sleep", "rm", "du", "dirname"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


def test_run_cuts_a_hung_step_keeps_what_came_before_and_writes_at_most_8_files(tmp_path):
    plan = tmp_path / "plan.tsv"
    steps = [
        ("smoke", 5, "-", "python3 -c 'import sys; print(sys.version)'"),
        # a step writes its result into the run's work folder ($LEASE_WORK); the run copies it into --out
        ("first", 5, "first.json", "python3 -c \"import json,os; json.dump({'ok': 1}, open(os.environ['LEASE_WORK']"
                                    " + '/first.json', 'w'))\""),
        ("hangs", 5, "hangs.json", "sleep 600"),  # cut at 130 % of its estimate + 10 s: 16 s
        ("never", 30, "never.json", "echo never"),  # ~30 s needed, fewer left: skipped (the drop order)
    ]
    plan.write_text("".join(f"{n}\t{s}\t{r}\t{c}\n" for n, s, r, c in steps))
    out = tmp_path / "out"
    env = {"PATH": _python3_only_path(tmp_path), "HOME": str(tmp_path), "LEASE_WHEELS": str(tmp_path / "none")}
    assert shutil.which("python", path=env["PATH"]) is None
    started = subprocess.run(["bash", str(SCRIPT), "run", "--out", str(out), "--deadline", "25", "--plan", str(plan)],
                             env=env, capture_output=True, text=True, timeout=120)
    summary = json.loads((out / "gpu_lease.json").read_text())
    states = {s["step"]: s["status"] for s in summary["steps"]}
    assert states["smoke"] == "ok" and states["first"] == "ok", started.stdout + started.stderr
    assert states["hangs"] == "timeout" and states["never"].startswith("skipped (needs ~30s"), states
    assert summary["elapsed_s"] <= 35 and not summary["all_ok"] and started.returncode == 1
    assert json.loads((out / "first.json").read_text()) == {"ok": 1}  # copied before the hang began
    assert {p.name for p in out.iterdir()} == {"gpu_lease.json", "first.json", "logs.tar.gz"}
    assert len(list(out.iterdir())) <= 8


def test_a_failed_first_step_stops_the_run(tmp_path):
    plan = tmp_path / "plan.tsv"
    plan.write_text("smoke\t30\t-\tpython3 -c 'import no_such_module'\nlater\t30\t-\techo later\n")
    out = tmp_path / "out"
    env = {"PATH": _python3_only_path(tmp_path), "HOME": str(tmp_path), "LEASE_WHEELS": str(tmp_path / "none")}
    started = subprocess.run(["bash", str(SCRIPT), "run", "--out", str(out), "--plan", str(plan)], env=env,
                             capture_output=True, text=True, timeout=60)
    summary = json.loads((out / "gpu_lease.json").read_text())
    assert [s["step"] for s in summary["steps"]] == ["smoke"] and summary["steps"][0]["status"].startswith("failed")
    assert "stopping" in started.stderr and started.returncode == 1


def _plan(*args: str) -> tuple[int, list[str]]:
    shown = subprocess.run(["bash", str(SCRIPT), "plan", *args], capture_output=True, text=True, timeout=60)
    return shown.returncode, shown.stdout.splitlines()


@pytest.mark.parametrize("dry_run", [False, True])
def test_the_plan_fits_one_480_s_call_and_8_files_by_its_own_estimates(dry_run):
    code, lines = _plan(*(["--dry-run"] if dry_run else []))
    parts = {line.split()[0]: int(line.split()[1].rstrip("s")) for line in lines[:-1]}
    assert list(parts) == ["smoke", "compare_gpu", "compare_gpu1b", "trace_gpu1b", "device_bound", "sync_check"]
    assert sum(parts.values()) <= 480 and code == 0, lines[-1]
    assert lines[-1].startswith(f"total {sum(parts.values())}s of 480s; 7 files back")
    compare = next(line for line in lines if line.startswith("compare_gpu "))
    for row in ("start", "vlmfast-best", "accelerate-best", "hf-best", "fabric-best"):
        assert row in compare
    if not dry_run:  # on the GPU: >= 30 timed steps and 3 interleaved rounds, compile included (per block)
        assert "--steps 30" in compare and "--repeats 3" in compare and "--without compile" not in compare
        assert "--size gpu-1b" in next(line for line in lines if line.startswith("compare_gpu1b"))
    # the stand-in is guarded: a checkout without it runs the rest
    assert "[ ! -f benchmarks/device_bound.py ] ||" in next(line for line in lines if line.startswith("device_bound"))


def test_a_plan_over_the_deadline_says_so_and_fails():
    code, lines = _plan("--deadline", "300")
    assert code == 1 and lines[-1].startswith("total ") and "of 300s" in lines[-1]
