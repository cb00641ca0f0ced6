"""save.async: the step waits for a host copy only; the checkpoint appears complete or not at all; one save in flight.

The save-path fault tests also run with save.async (test_interrupts.py: SIGKILL inside the background write, a
signal mid-step; test_save_dir.py: ENOSPC, a real full tmpfs; test_preemption.py: SIGTERM to the process group).
"""

from __future__ import annotations

import time

import pytest
import torch
from _faults import losses, make_spec, train

from vlmfast.checkpoints.async_save import AsyncCheckpointer, snapshot_to_host
from vlmfast.checkpoints.store import latest_checkpoint, list_checkpoints, load_checkpoint, verify_checkpoint


def test_the_snapshot_shares_nothing_with_the_live_state_and_keeps_ties():
    weight = torch.ones(4)
    state = {"model": {"embed": weight, "head": weight}, "optimizer": {"state": {0: {"exp_avg": torch.zeros(4)}}},
             "rng": {"python": (3, [1, 2]), "seed": 7}, "trainer": {"step": 2}}
    snap, buffers = snapshot_to_host(state)
    weight.add_(1)  # the optimizer updates the live tensors in place after the step
    state["optimizer"]["state"][0]["exp_avg"].add_(5)
    assert torch.equal(snap["model"]["embed"], torch.ones(4)) and snap["model"]["embed"] is snap["model"]["head"]
    assert torch.equal(snap["optimizer"]["state"][0]["exp_avg"], torch.zeros(4))
    assert snap["rng"] == {"python": (3, [1, 2]), "seed": 7} and snap["trainer"] == {"step": 2}
    again, reused = snapshot_to_host(state, reuse=buffers)  # the next save copies into the same buffers
    assert all(a is b for a, b in zip(reused, buffers, strict=True)) and len(buffers) == 2
    assert torch.equal(again["model"]["head"], torch.full((4,), 2.0))


class SlowSave:
    """torch.save that takes `seconds` (a slow disk), recording when each write started and ended."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.spans, self.real = seconds, [], torch.save

    def __call__(self, obj, f, *args, **kwargs):
        start = time.monotonic()
        time.sleep(self.seconds)
        self.real(obj, f, *args, **kwargs)
        self.spans.append((start, time.monotonic()))


def test_the_step_waits_only_for_the_copy_and_one_save_is_in_flight(tmp_path, monkeypatch):
    slow = SlowSave(0.5)
    monkeypatch.setattr(torch, "save", slow)
    checkpointer = AsyncCheckpointer()
    start = time.monotonic()
    checkpointer.save(tmp_path, 1, {"w": torch.ones(1000)})
    assert time.monotonic() - start < 0.4 and checkpointer.in_flight  # returned before the write ended
    assert latest_checkpoint(tmp_path) is None  # not visible until complete
    checkpointer.save(tmp_path, 2, {"w": torch.ones(1000) * 2})  # waits for step 1 first
    assert checkpointer.wait().name == "step_00000002"
    (_, first_end), (second_start, _) = slow.spans
    assert second_start >= first_end  # never two writes at once
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]
    for folder in list_checkpoints(tmp_path):
        verify_checkpoint(folder)


def test_a_failed_async_save_is_raised_by_poll_and_leaves_nothing_visible(tmp_path, monkeypatch):
    def full_disk(obj, f, *args, **kwargs):
        f.write(b"partial")
        raise OSError(28, "No space left on device")

    checkpointer = AsyncCheckpointer()
    checkpointer.save(tmp_path, 1, {"w": torch.ones(2)})
    checkpointer.wait()
    monkeypatch.setattr(torch, "save", full_disk)
    checkpointer.save(tmp_path, 2, {"w": torch.ones(2)})
    deadline = time.monotonic() + 30
    while checkpointer.in_flight and time.monotonic() < deadline:
        time.sleep(0.01)
    from vlmfast.checkpoints.store import CheckpointWriteError

    with pytest.raises(CheckpointWriteError, match="cannot write checkpoint step_00000002"):
        checkpointer.poll()
    checkpointer.poll()  # reported once
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".vlmfast")] == ["step_00000001"]


def test_async_training_saves_the_same_checkpoints_and_resumes_exactly(tmp_path):
    _, full = train(make_spec(max_steps=8))
    train(make_spec(max_steps=6, save={"dir": str(tmp_path / "sync"), "every_steps": 2}))
    async_trainer, result = train(make_spec(max_steps=6, save={"dir": str(tmp_path / "async"), "every_steps": 2,
                                                               "async": True}))
    assert result.checkpoint.name == "step_00000006" and not async_trainer.checkpointer.in_flight
    for step in ("step_00000004", "step_00000006"):
        verify_checkpoint(tmp_path / "async" / step)
        synced, asynced = (load_checkpoint(tmp_path / kind / step) for kind in ("sync", "async"))
        for name, value in synced["engine"]["model"].items():
            assert torch.equal(value, asynced["engine"]["model"][name]), (step, name)
        assert synced["trainer"] == asynced["trainer"]
    _, resumed = train(make_spec(max_steps=8, save={"dir": str(tmp_path / "async"), "resume":
                                                    str(tmp_path / "async" / "step_00000004"), "async": True}))
    assert losses(resumed) == losses(full)[4:]


def test_the_first_save_copies_into_buffers_prepared_in_the_background(tmp_path, monkeypatch):
    from vlmfast.checkpoints import async_save as checkpoint_async
    fresh = []  # per tensor of the first save: (allocated on the spot)
    real = checkpoint_async._host_copy
    monkeypatch.setattr(checkpoint_async, "_host_copy", lambda tensor, devices, target: fresh.append(
        (target is None, tensor.dtype)) or real(tensor, devices, target))
    trainer, _ = train(make_spec(max_steps=4, save={"dir": str(tmp_path), "every_steps": 3, "async": True}))
    engine_tensors = len(checkpoint_async._layout(trainer.engine.state_dict()))
    # The engine's state (weights, optimizer: the bulk) went into prepared buffers; the small rest (RNG states
    # gathered from every rank at the save, counters) is allocated then.
    assert engine_tensors and not any(allocated for allocated, _ in fresh[:engine_tensors])
    verify_checkpoint(tmp_path / "step_00000003")


def test_the_end_of_the_run_waits_for_the_last_save(tmp_path, monkeypatch):
    slow = SlowSave(0.3)
    monkeypatch.setattr(torch, "save", slow)
    trainer, result = train(make_spec(max_steps=4, save={"dir": str(tmp_path), "every_steps": 1, "async": True}))
    assert not trainer.checkpointer.in_flight
    verify_checkpoint(result.checkpoint)
    assert result.checkpoint.name == "step_00000004" and len(slow.spans) == 4  # steps 1-3 and the final one
