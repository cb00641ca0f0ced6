"""Checkpoints: pruning and re-saving (kills mid-write and corrupt checkpoints: tests/faults/test_interrupts.py)."""

from __future__ import annotations

import torch

from vlmfast.checkpoints.store import latest_checkpoint, list_checkpoints, load_checkpoint, save_checkpoint


def test_keep_last_prunes_the_oldest(tmp_path):
    for step in range(1, 6):
        save_checkpoint(tmp_path, step, {"w": torch.tensor([step])}, keep_last=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000004", "step_00000005"]
    assert load_checkpoint(latest_checkpoint(tmp_path))["w"].item() == 5


def test_resaving_a_step_replaces_it(tmp_path):
    save_checkpoint(tmp_path, 3, {"w": torch.tensor([1])})
    save_checkpoint(tmp_path, 3, {"w": torch.tensor([2])})
    assert load_checkpoint(latest_checkpoint(tmp_path))["w"].item() == 2


