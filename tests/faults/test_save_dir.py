"""The folders a run writes: one writer per save.dir, full disks, unusable folders, all named before or when they fail.

- A second run on one save.dir is refused naming the first (PID, host); the lock of a killed run is taken over.
- A save never removes a live process's temporary folder; a dead writer's leftovers are cleaned.
- A full disk during a save keeps every previous checkpoint, removes the partial one, names save.dir and the bytes.
- save.dir / log.dir that cannot be created or written, dangling links, too little space: refused before any step.
"""

from __future__ import annotations

import errno
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _faults import losses, make_spec, tiny_filesystem, train

from vlmfast import SpecError
from vlmfast.checkpoints.save_dir import HOST, SaveDirInUseError, SaveDirLock
from vlmfast.checkpoints.store import CheckpointWriteError, list_checkpoints, save_checkpoint, verify_checkpoint


def _holder(directory: Path) -> subprocess.Popen:
    """Another process that takes `directory`'s lock and keeps it until killed."""
    script = textwrap.dedent(f"""
        import sys, time
        from vlmfast.checkpoints.save_dir import SaveDirLock
        SaveDirLock({str(directory)!r}).acquire()
        print("locked", flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "locked"
    return proc


def test_a_second_run_on_one_save_dir_is_refused_then_a_dead_runs_lock_is_taken_over(tmp_path, caplog):
    holder = _holder(tmp_path)
    try:
        with pytest.raises(SaveDirInUseError, match=rf"save.dir {tmp_path} is in use by another run \(pid "
                           rf"{holder.pid} on host {HOST}, since .*another save.dir"):
            train(make_spec(max_steps=2, save={"dir": str(tmp_path)}))
        assert not list_checkpoints(tmp_path)
    finally:
        holder.kill()
        holder.wait()
    with caplog.at_level(logging.INFO, logger="vlmfast.checkpoints.save_dir"):  # the killed run's lock is still there
        _, result = train(make_spec(max_steps=2, save={"dir": str(tmp_path)}))
    assert result.checkpoint.name == "step_00000002"
    assert f"taking over the lock of pid {holder.pid}" in caplog.text


def test_the_lock_is_reentrant_in_one_process_and_released_at_the_end_of_fit(tmp_path):
    with SaveDirLock(tmp_path):
        train(make_spec(max_steps=2, save={"dir": str(tmp_path)}))  # the same process: not a second run
        assert SaveDirLock.held_by_this_process(tmp_path)
    assert not SaveDirLock.held_by_this_process(tmp_path)
    train(make_spec(max_steps=3, save={"dir": str(tmp_path)}))
    assert not SaveDirLock.held_by_this_process(tmp_path)  # fit let it go: another process may use save.dir now
    holder = _holder(tmp_path)
    holder.kill()
    holder.wait()


def test_a_save_never_touches_a_live_writers_temporary_folder(tmp_path):
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    leftovers = {
        f".tmp-step_00000009-{live.pid}-{HOST}": True,  # a live process on this host: kept
        f".tmp-step_00000008-{live.pid}": True,  # the same in an older vlmfast's naming: kept
        f".old-step_00000007-{live.pid}-{HOST}": True,
        f".tmp-step_00000006-{gone.pid}-{HOST}": False,  # its writer is gone: removed
        f".tmp-step_00000005-{gone.pid}": False,
        ".tmp-step_00000004-12345-another-host": False,  # another host's: removed while this process holds the lock
    }
    try:
        for name in leftovers:
            (tmp_path / name).mkdir()
            (tmp_path / name / "state.pt").write_bytes(b"partial")
        save_checkpoint(tmp_path, 1, {"w": torch.ones(2)})
        for name, kept in leftovers.items():
            assert (tmp_path / name).exists() == kept, name
    finally:
        live.kill()
        live.wait()


@pytest.mark.parametrize(("errno_code", "asynchronous"), [(errno.ENOSPC, False), (errno.EIO, False),
                                                         (errno.ENOSPC, True)], ids=["ENOSPC", "EIO", "ENOSPC-async"])
def test_a_full_disk_during_a_save_keeps_the_previous_checkpoints_and_names_save_dir(tmp_path, monkeypatch,
                                                                                     errno_code, asynchronous):
    real_save = torch.save

    def failing_save(obj, f, *args, **kwargs):
        if isinstance(obj, dict) and obj.get("trainer", {}).get("step") == 4:
            f.write(b"the first bytes of a checkpoint")
            raise OSError(errno_code, os.strerror(errno_code))
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    spec = make_spec(max_steps=6, save={"dir": str(tmp_path), "every_steps": 2, "async": asynchronous})
    seen = _StepsSeen()
    with pytest.raises(CheckpointWriteError, match=rf"(?s)save.dir {tmp_path}: cannot write checkpoint step_00000004 "
                       rf"\({os.strerror(errno_code)}\). It needs about .* are free on that disk.*step_00000002 is "
                       "intact"):
        train(spec, callbacks=[seen])
    # Synchronous: the save after step 4 raises; asynchronous: the next step (or, at the latest, the end) reports it.
    assert seen.trainer.state.step == 4 if not asynchronous else seen.trainer.state.step in (5, 6)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002"]
    verify_checkpoint(tmp_path / "step_00000002")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith((".tmp", ".old"))]  # the partial one is gone
    monkeypatch.setattr(torch, "save", real_save)
    _, full = train(make_spec(max_steps=6))
    _, resumed = train(spec)
    assert resumed.resumed_from.name == "step_00000002" and losses(resumed) == losses(full)[2:]


class _StepsSeen:
    trainer = None

    def on_fit_start(self, trainer) -> None:
        self.trainer = trainer


@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_a_real_full_file_system_keeps_the_previous_checkpoints(tmp_path, asynchronous):
    with tiny_filesystem(tmp_path / "disk", "200k") as disk:
        spec = make_spec(max_steps=8, save={"dir": str(disk), "every_steps": 2, "keep_last": 5,
                                            "async": asynchronous})
        with pytest.raises(CheckpointWriteError, match=rf"save.dir {disk}: cannot write checkpoint step_0000000\d "
                           r"\(No space left on device\)"):
            train(spec)
        kept = list_checkpoints(disk)
        assert kept and all(verify_checkpoint(p) is None for p in kept)
        assert not [p for p in disk.iterdir() if p.name.startswith(".tmp")]


def test_too_little_space_for_one_checkpoint_is_refused_before_any_step(tmp_path, monkeypatch):
    from vlmfast.checkpoints import save_dir
    monkeypatch.setattr(save_dir.shutil, "disk_usage", lambda path: type("Usage", (), {"free": 1000})())
    with pytest.raises(SpecError, match=r"save.dir .*: 1000 B free, but one checkpoint of this run needs about "
                       r"[\d.]+ KiB"):
        train(make_spec(max_steps=2, save={"dir": str(tmp_path / "ckpt")}))


def test_unusable_save_and_log_dirs_are_refused_naming_the_field_before_any_work(tmp_path):
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "dangling").symlink_to(tmp_path / "missing")
    cases = {
        ("save", tmp_path / "a_file"): r"save.dir .*a_file is a file, not a folder",
        ("log", tmp_path / "a_file" / "sub"): r"log.dir .*sub cannot be created: .*a_file is a file",
        ("save", tmp_path / "dangling"): r"save.dir .*dangling is a symbolic link to .*missing, which does not exist",
        ("log", tmp_path / "dangling" / "logs"): r"log.dir .*dangling is a symbolic link to .*missing",
    }
    for (section, directory), message in cases.items():
        with pytest.raises(SpecError, match=message):
            train(make_spec(max_steps=1, **{section: {"dir": str(directory)}}))
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "step_00000003").symlink_to(tmp_path / "gone")
    with pytest.raises(SpecError, match=r"save.dir .*ckpt: step_00000003 is a symbolic link to .*gone, which does not"):
        train(make_spec(max_steps=1, save={"dir": str(ckpt)}))


def test_a_read_only_save_dir_is_refused_naming_the_field(tmp_path):
    target = tmp_path / "ro"
    if os.geteuid() == 0:  # root writes through permissions: make it a read-only file system instead
        with tiny_filesystem(target, "1m"):
            subprocess.run(["mount", "-o", "remount,ro", str(target)], check=True)
            _assert_refused(target)
    else:
        target.mkdir()
        target.chmod(0o500)
        try:
            _assert_refused(target)
        finally:
            target.chmod(0o700)


def _assert_refused(target: Path) -> None:
    for field in ("save", "log"):
        with pytest.raises(SpecError, match=rf"{field}.dir {target} is not writable"):
            train(make_spec(max_steps=1, **{field: {"dir": str(target)}}))
        with pytest.raises(SpecError, match=rf"{field}.dir {target}/sub cannot be created: no write permission"):
            train(make_spec(max_steps=1, **{field: {"dir": str(target / "sub")}}))


def test_spec_check_warns_about_a_folder_that_would_fail_here(tmp_path, capsys):
    from vlmfast.cli.main import main

    (tmp_path / "a_file").write_text("x")
    spec = tmp_path / "run.yaml"
    spec.write_text(f"save:\n  dir: {tmp_path / 'a_file'}\n")
    assert main(["spec", "--check", str(spec)]) == 0  # a spec is valid anywhere; the folder is this machine's
    err = capsys.readouterr().err
    assert f"warning (on this machine): save.dir {tmp_path / 'a_file'} is a file, not a folder" in err


def test_an_unreadable_checkpoint_given_as_resume_path_is_named(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"w": torch.ones(2)})
    from vlmfast.checkpoints import store as checkpoint
    def denied(path, fsync=False):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(checkpoint, "_verified", {})
    monkeypatch.setattr(checkpoint, "_sha256", denied)
    with pytest.raises(SpecError, match=r"cannot resume from .*step_00000001: .*step_00000001/meta.json cannot be read "
                       r"\(Permission denied\)"):
        checkpoint.resume_path(str(tmp_path / "step_00000001"), None)


class _ReadOnlyAfterFirstSave:
    """Makes save.dir refuse new folders after its first checkpoint, as a folder made read-only mid-run does (EACCES
    injected: root ignores permission bits, and a file system holding the run's lock cannot be remounted read-only)."""

    def __init__(self, directory: Path, monkeypatch) -> None:
        self.directory, self.monkeypatch = directory, monkeypatch

    def on_save(self, trainer, path) -> None:
        real_mkdir = Path.mkdir

        def refused(path, *args, **kwargs):
            if path.parent == self.directory:
                raise PermissionError(errno.EACCES, "Permission denied", str(path))
            return real_mkdir(path, *args, **kwargs)

        self.monkeypatch.setattr(Path, "mkdir", refused)


def test_a_save_dir_that_turns_read_only_mid_run_is_the_checkpoint_error_naming_save_dir(tmp_path, monkeypatch):
    spec = make_spec(max_steps=6, save={"dir": str(tmp_path), "every_steps": 2})
    with pytest.raises(CheckpointWriteError, match=rf"save.dir {tmp_path}: cannot write checkpoint step_00000004 "
                       r"\(Permission denied\).*step_00000002 is intact"):
        train(spec, callbacks=[_ReadOnlyAfterFirstSave(tmp_path, monkeypatch)])


def test_a_folder_where_metrics_jsonl_goes_is_an_error_naming_it(tmp_path):
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(SpecError, match=rf"log.dir file {tmp_path / 'metrics.jsonl'} is a folder where vlmfast "
                       "writes a file"):
        train(make_spec(max_steps=2, log={"dir": str(tmp_path), "progress": "off"}))


def test_a_full_vision_cache_disk_is_an_uncached_run_not_a_sigbus(tmp_path, caplog):
    """A real 32 KiB file system under vision_cache.dir (the tiny VLM's features: 4.6 KiB per image): the store fills
    after a few entries, the run goes on uncached with the losses of a run without the cache."""
    from vlmfast import OptimizedTrainer, TrainSpec
    from vlmfast.models import build_tiny_vlm_task

    def fit(cache_dir):
        model, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=16)
        spec = {"max_steps": 4, "batch_size": 8, "micro_batch_size": 4, "device": "cpu", "log": {"progress": "off"},
                "optimizer": {"name": "sgd", "lr": 0.05, "freeze": ["vision_tower", "multi_modal_projector"]},
                "vision_cache": {"enabled": cache_dir is not None, "dir": str(cache_dir)}}
        return OptimizedTrainer(model, dataset, TrainSpec(**spec), collate_fn=collate).fit()

    plain = fit(None)
    with tiny_filesystem(tmp_path / "disk", "32k") as disk:
        cached = fit(disk)
    assert losses(cached) == pytest.approx(losses(plain), rel=1e-5)
    assert any("No space left" in r.getMessage() and f"vision_cache.dir {disk}" in r.getMessage()
               for r in caplog.records)
