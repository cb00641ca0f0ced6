"""Checkpoints are atomic: a writer killed mid-save leaves the previous checkpoint complete and found."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from vlmfast.checkpoint import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint


def test_keep_last_prunes_the_oldest(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, {"w": torch.tensor([step])}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000005"]
    assert load_checkpoint(latest_checkpoint(tmp_path))["w"].item() == 5


def test_resaving_a_step_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 3, {"w": torch.tensor([1])})
    save_checkpoint(tmp_path, 3, {"w": torch.tensor([2])})
    assert load_checkpoint(latest_checkpoint(tmp_path))["w"].item() == 2


def test_sigkill_during_a_write_leaves_the_previous_checkpoint_intact(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, torch
        from vlmfast import checkpoint
        checkpoint.save_checkpoint({str(tmp_path)!r}, 1, {{"w": torch.arange(10)}})
        real_save = torch.save
        def dying_save(obj, f):
            f.write(b"partial bytes of a checkpoint")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        checkpoint.torch.save = dying_save
        checkpoint.save_checkpoint({str(tmp_path)!r}, 2, {{"w": torch.arange(20)}})
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=120)
    assert proc.returncode == -9, proc.stderr.decode()
    assert list(tmp_path.glob(".tmp-step_00000002-*")), "the killed writer left its temporary folder"
    latest = latest_checkpoint(tmp_path)
    assert latest.name == "step_00000001"
    assert torch.equal(load_checkpoint(latest)["w"], torch.arange(10))
    save_checkpoint(tmp_path, 2, {"w": torch.arange(20)})  # the next save cleans the leftover
    assert not list(tmp_path.glob(".tmp-*"))


def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "step_00000009")


def test_a_corrupt_checkpoint_is_named_when_resuming(tmp_path):
    from conftest import TinyCausalLM, TokenDataset

    from vlmfast import OptimizedTrainer, SpecError, TrainSpec

    broken = tmp_path / "step_00000004"
    broken.mkdir()
    (broken / "state.pt").write_bytes(b"not a checkpoint")
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(16), TrainSpec(batch_size=4, save={"dir": str(tmp_path)},
                                                                           log={"progress": "off"}))
    with pytest.raises(SpecError, match=r"cannot resume from .*step_00000004"):
        trainer.fit()
