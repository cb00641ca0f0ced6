"""Links planted in shared folders: no file vlmfast writes follows one, and no manifest leads out of its checkpoint.

- A symbolic link at any name a run writes (metrics.jsonl, report.json, the step-time plot, profile_summary.json,
  save.dir's lock, a profiler trace), in a fresh and in a resumed run: refused naming the link, its target untouched.
- The same for the writers outside a run (token files, the feature cache, plots), and TensorBoard's event file gets a
  name nobody can plant a link at in advance.
- A manifest entry with `..`, an absolute path, or through a linked folder: refused naming the checkpoint and entry.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from _faults import make_spec, train

from vlmfast import SpecError
from vlmfast.checkpoints.store import CorruptCheckpointError, resume_path, save_checkpoint, verify_checkpoint
from vlmfast.common.safe_files import UnsafeOutputError

VICTIM = "the user's own file: no run may change it\n"


def _spec(root: Path, max_steps: int, trace: dict | None = None):
    profile = {"every_steps": 1, "warmup_steps": 0, **({"trace": trace} if trace else {})}
    return make_spec(max_steps=max_steps, save={"dir": str(root / "save"), "every_steps": 2},
                     log={"dir": str(root / "log")}, profile=profile)


def _plant(link: Path, victim: Path) -> Path:
    victim.write_text(VICTIM)
    link.parent.mkdir(parents=True, exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to(victim)
    return link


def _refused(link: Path) -> str:
    return re.escape(str(link)) + r" is a symbolic link \(to .*Remove"


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory):
    """A 2-step run with save.dir and log.dir: what the resumed runs continue from."""
    root = tmp_path_factory.mktemp("write_safety")
    train(_spec(root, max_steps=2))
    return root


RUN_OUTPUTS = [("log", "metrics.jsonl"), ("log", "report.json"), ("log", "step_time_breakdown.png"),
               ("log", "profile_summary.json"), ("save", ".vlmfast.lock")]


@pytest.mark.parametrize("resumed", [False, True], ids=["fresh", "resumed"])
@pytest.mark.parametrize(("folder", "name"), RUN_OUTPUTS, ids=[name for _, name in RUN_OUTPUTS])
def test_a_link_planted_at_a_run_output_is_refused_and_its_target_untouched(saved_run, tmp_path, folder, name,
                                                                             resumed):
    root = tmp_path / "run"
    if resumed:
        shutil.copytree(saved_run, root)
    link = _plant(root / folder / name, tmp_path / "victim.txt")
    with pytest.raises(UnsafeOutputError, match=_refused(link)):
        train(_spec(root, max_steps=4 if resumed else 2))
    assert (tmp_path / "victim.txt").read_text() == VICTIM
    assert link.is_symlink()


def test_a_link_planted_at_the_profiler_trace_is_refused(tmp_path):
    link = _plant(tmp_path / "log" / "profiler" / "trace_steps_2-2.json", tmp_path / "victim.txt")
    spec = _spec(tmp_path, max_steps=2, trace={"enabled": True, "start_step": 2, "active_steps": 1})
    with pytest.raises(UnsafeOutputError, match=_refused(link)):
        train(spec)
    assert (tmp_path / "victim.txt").read_text() == VICTIM


def test_a_linked_profiler_folder_is_refused(tmp_path):
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "log").mkdir()
    (tmp_path / "log" / "profiler").symlink_to(tmp_path / "elsewhere")
    spec = _spec(tmp_path, max_steps=2, trace={"enabled": True, "start_step": 2, "active_steps": 1})
    with pytest.raises(UnsafeOutputError, match=_refused(tmp_path / "log" / "profiler")):
        train(spec)
    assert not list((tmp_path / "elsewhere").iterdir())


def _token_file(root: Path) -> None:
    from vlmfast.data.mmap import write_token_sequences

    write_token_sequences([[1, 2, 3]], root / "tokens")


def _feature_cache(root: Path) -> None:
    from vlmfast.features.store import FeatureStore

    FeatureStore(root / "cache", max_bytes=1 << 20).close()


def _step_time_plot(root: Path) -> None:
    from vlmfast.profiling.plots import plot_step_breakdown

    plot_step_breakdown([{"step": 1, "perf/step_time": 0.2, "perf/forward_time": 0.1}], root / "plot.png")


def _memory_plot(root: Path) -> None:
    from vlmfast.memory.plots import plot_memory_timeline

    plot_memory_timeline([{"step": 1, "mem/peak_gb": 0.5}], root / "plot.png")


WRITERS = {  # what writes it, and the name it writes (a link there must be refused)
    "token data (temporary)": (_token_file, "tokens.bin.tmp"),
    "token index (temporary)": (_token_file, "tokens.idx.npy.tmp.npy"),
    "feature cache lock": (_feature_cache, "cache/w0.lock"),
    "feature cache index": (_feature_cache, "cache/w0.v2.idx"),
    "step-time plot": (_step_time_plot, "plot.png"),
    "memory plot": (_memory_plot, "plot.png"),
}


@pytest.mark.parametrize("writer", list(WRITERS))
def test_a_link_planted_where_a_tool_writes_is_refused(tmp_path, writer):
    write, name = WRITERS[writer]
    link = _plant(tmp_path / name, tmp_path / "victim.txt")
    with pytest.raises(UnsafeOutputError, match=_refused(link)):
        write(tmp_path)
    assert (tmp_path / "victim.txt").read_text() == VICTIM


def test_tensorboard_event_files_get_a_name_no_one_can_plant_a_link_at(tmp_path, monkeypatch):
    """TensorBoard opens its event file by name (truncating it): a link at that name, guessed from the clock, the
    host, the PID and a counter, would be written through. vlmfast adds a random suffix, so the guess misses."""
    pytest.importorskip("tensorboard")
    from tensorboard.summary.writer import event_file_writer

    monkeypatch.setattr(event_file_writer, "time", SimpleNamespace(time=lambda: 1_700_000_000.0))
    victim = tmp_path / "victim.txt"
    base = f"events.out.tfevents.1700000000.{socket.gethostname()}.{os.getpid()}"
    counter = event_file_writer._global_uid._value
    links = [_plant(tmp_path / "log" / f"{base}.{uid}", victim) for uid in range(counter, counter + 4)]
    train(make_spec(max_steps=2, log={"dir": str(tmp_path / "log"), "tensorboard": True}))
    assert victim.read_text() == VICTIM
    assert all(link.is_symlink() for link in links)
    written = [p for p in (tmp_path / "log").glob("events.out.tfevents.*") if not p.is_symlink()]
    assert written and all(p.stat().st_size > 0 for p in written)


# ---- manifests ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("entry", ["../../outside.txt", "absolute", "linked/outside.txt"])
def test_a_manifest_entry_leading_out_of_its_checkpoint_is_refused(tmp_path, entry):
    outside = tmp_path / "outside.txt"
    outside.write_bytes(b"a file of the user's, not of any checkpoint")
    save_checkpoint(tmp_path / "save", 1, {"w": torch.ones(2)})
    folder = tmp_path / "save" / "step_00000001"
    if entry == "absolute":
        entry = str(outside)
    if entry.startswith("linked/"):
        (folder / "linked").symlink_to(tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    data = outside.read_bytes()
    manifest["files"][entry] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}  # a matching hash
    (folder / "manifest.json").write_text(json.dumps(manifest))
    refused = rf"checkpoint {re.escape(str(folder))}: its manifest lists {re.escape(repr(entry))}, which is not a plain"
    with pytest.raises(CorruptCheckpointError, match=refused):
        verify_checkpoint(folder)
    with pytest.raises(SpecError, match=refused):  # and so no resume from it
        resume_path("auto", tmp_path / "save")
