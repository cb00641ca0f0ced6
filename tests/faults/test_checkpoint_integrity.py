"""Checkpoints nobody can silently corrupt: every file is checked against the manifest before anything is loaded.

- Flipped bytes in any file of the newest checkpoint (tensor data, optimizer state, metadata): `resume: auto` falls
  back to the previous verified checkpoint with a warning naming the damaged file; an explicit path is refused.
- A file planted in a checkpoint folder is refused (nothing is loaded that vlmfast's save did not write).
- When no checkpoint verifies, nothing is resumed and nothing is deleted.
"""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from _faults import losses, make_spec, params_of, train

from vlmfast import SpecError
from vlmfast.checkpoints.store import (
    CorruptCheckpointError,
    latest_verified_checkpoint,
    list_checkpoints,
    load_checkpoint,
    resume_path,
    save_checkpoint,
    verify_checkpoint,
)


def _flip(path, fraction: float) -> None:
    data = bytearray(path.read_bytes())
    at = min(int(len(data) * fraction), len(data) - 1)
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def _tensor_record(state_file, key: str) -> tuple[int, int]:
    """(offset, size) of the first tensor data record of `key` ('model' or 'optimizer') inside a torch zip file."""
    import zipfile

    state = torch.load(state_file, weights_only=True)
    if key == "model":
        tensor = next(iter(state["engine"]["model"].values()))
    else:
        tensor = next(iter(state["engine"]["optimizer"]["state"].values()))["exp_avg"]
    raw = tensor.detach().contiguous().numpy().tobytes()
    with zipfile.ZipFile(state_file) as archive:
        for info in archive.infolist():
            if "/data/" in info.filename and archive.read(info) == raw:
                header = 30 + len(info.filename.encode()) + len(info.extra)
                return info.header_offset + header, info.file_size
    raise AssertionError(f"no data record of {key} found")


@pytest.fixture(scope="module")
def three_checkpoints(tmp_path_factory):
    """A run of 6 steps saving every 2 (checkpoints at 2, 4, 6), and the losses of an unbroken 8-step run."""
    root = tmp_path_factory.mktemp("integrity")
    train(make_spec(max_steps=6, save={"dir": str(root / "run"), "every_steps": 2}))
    _, full = train(make_spec(max_steps=8))
    return root / "run", losses(full)


DAMAGES = {  # file, where: the bytes a disk error or a careless copy could change
    "model tensor data": ("state.pt", "model"),
    "optimizer state": ("state.pt", "optimizer"),
    "zip directory": ("state.pt", 0.995),
    "metadata": ("meta.json", 0.5),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_flipped_bytes_in_any_file_are_detected_and_resume_falls_back(three_checkpoints, tmp_path, damage, caplog):
    run, _ = three_checkpoints
    shutil.copytree(run, tmp_path / "run")
    newest = tmp_path / "run" / "step_00000006"
    name, where = DAMAGES[damage]
    if isinstance(where, str):
        offset, size = _tensor_record(newest / name, where)
        data = bytearray((newest / name).read_bytes())
        data[offset + size // 2] ^= 0x40  # one bit of one float: torch.load alone would not notice
        (newest / name).write_bytes(bytes(data))
    else:
        _flip(newest / name, where)
    with caplog.at_level(logging.WARNING, logger="vlmfast.checkpoints.store"):
        found = latest_verified_checkpoint(tmp_path / "run")
    assert found.name == "step_00000004"
    assert f"step_00000006/{name}" in caplog.text and "falling back" in caplog.text
    with pytest.raises(SpecError, match=rf"cannot resume from .*step_00000006.*step_00000006/{name} "):
        resume_path(str(newest), None)  # an explicit path is refused naming the file
    with pytest.raises(CorruptCheckpointError, match=name):
        load_checkpoint(newest)


def test_resume_auto_continues_from_the_previous_verified_checkpoint(three_checkpoints, tmp_path):
    run, full_losses = three_checkpoints
    shutil.copytree(run, tmp_path / "run")
    _flip(tmp_path / "run" / "step_00000006" / "state.pt", 0.5)
    _, resumed = train(make_spec(max_steps=8, save={"dir": str(tmp_path / "run"), "every_steps": 2}))
    assert resumed.resumed_from.name == "step_00000004"
    assert losses(resumed) == full_losses[4:]  # steps 5..8 exactly as in an unbroken run
    # The damaged step 6 was re-saved (a fresh, verified one replaced it).
    verify_checkpoint(tmp_path / "run" / "step_00000006")


def test_a_planted_file_is_refused(three_checkpoints, tmp_path):
    run, _ = three_checkpoints
    shutil.copytree(run, tmp_path / "run")
    newest = tmp_path / "run" / "step_00000006"
    (newest / "extra_optim_states.pt").write_bytes((newest / "state.pt").read_bytes())
    with pytest.raises(CorruptCheckpointError, match=r"extra_optim_states.pt.*not listed in this checkpoint's"):
        verify_checkpoint(newest)
    assert latest_verified_checkpoint(tmp_path / "run").name == "step_00000004"


def test_a_rewritten_manifest_is_no_way_around_the_weights_only_load(tmp_path):
    """The manifest guards against damage, not against someone who can write the folder: for them the weights-only
    unpickler is the line that holds (a pickle that would run code is refused)."""
    save_checkpoint(tmp_path, 1, {"w": torch.ones(2)})
    folder = tmp_path / "step_00000001"
    marker = tmp_path / "ran"
    torch.save(_RunsCode(str(marker)), folder / "state.pt")
    manifest = json.loads((folder / "manifest.json").read_text())
    from vlmfast.checkpoints.store import write_manifest

    write_manifest(folder, manifest["step"])  # a consistent manifest for the crafted file
    verify_checkpoint(folder)
    with pytest.raises(CorruptCheckpointError, match=r"state\.pt cannot be read"):
        load_checkpoint(folder)
    assert not marker.exists()


class _RunsCode:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))  # creating the marker file proves code ran at load


def test_when_no_checkpoint_verifies_nothing_is_resumed_or_deleted(three_checkpoints, tmp_path):
    run, _ = three_checkpoints
    shutil.copytree(run, tmp_path / "run")
    for folder in list_checkpoints(tmp_path / "run"):
        _flip(folder / "state.pt", 0.5)
    with pytest.raises(SpecError, match=r"(?s)no checkpoint in .* passes verification.*nothing is deleted"):
        train(make_spec(max_steps=8, save={"dir": str(tmp_path / "run"), "every_steps": 2}))
    assert [p.name for p in list_checkpoints(tmp_path / "run")] == ["step_00000002", "step_00000004",
                                                                    "step_00000006"]


def test_verification_is_not_repeated_for_an_unchanged_folder(tmp_path, monkeypatch):
    save_checkpoint(tmp_path, 1, {"w": torch.ones(4)})
    from vlmfast.checkpoints import store as checkpoint
    calls = []
    real = checkpoint._sha256
    monkeypatch.setattr(checkpoint, "_sha256", lambda path, fsync=False: calls.append(path) or real(path, fsync))
    verify_checkpoint(tmp_path / "step_00000001")
    verify_checkpoint(tmp_path / "step_00000001")
    assert len(calls) == 0  # verified right after the save (same files): no second read of the bytes
    _flip(tmp_path / "step_00000001" / "state.pt", 0.5)
    with pytest.raises(CorruptCheckpointError):
        verify_checkpoint(tmp_path / "step_00000001")


def test_resumed_parameters_equal_the_checkpoints(three_checkpoints, tmp_path):
    """The fallback loads step 4 whole: the model after resume holds exactly step 4's saved weights."""
    run, _ = three_checkpoints
    shutil.copytree(run, tmp_path / "run")
    _flip(tmp_path / "run" / "step_00000006" / "state.pt", 0.3)
    saved = load_checkpoint(tmp_path / "run" / "step_00000004")["engine"]["model"]
    trainer, _ = train(make_spec(max_steps=4, save={"dir": str(tmp_path / "run"), "resume": "auto"}))
    for name, value in params_of(trainer.model).items():
        assert torch.equal(value, saved[name]), name
