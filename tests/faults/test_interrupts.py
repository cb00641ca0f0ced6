"""A run killed or interrupted at any moment loses at most the steps since its last checkpoint, and resumes exactly.

- SIGKILL while a checkpoint is being written: the previous checkpoint stays complete, resume continues from it.
- SIGTERM / Ctrl-C inside a step: that step finishes, a final checkpoint is written, resume continues exactly.
- A checkpoint that is corrupt or missing is named in the error, never loaded half-way.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from _faults import losses, make_spec, params_of, train
from conftest import TinyCausalLM

from vlmfast import SpecError
from vlmfast.checkpoints.store import (
    CorruptCheckpointError,
    latest_checkpoint,
    list_checkpoints,
    load_checkpoint,
    save_checkpoint,
)

TESTS = Path(__file__).resolve().parents[1]


def test_sigkill_during_a_write_leaves_the_previous_checkpoint_intact(tmp_path):
    script = textwrap.dedent(f"""
        import os, signal, torch
        from vlmfast.checkpoints import store as checkpoint
        checkpoint.save_checkpoint({str(tmp_path)!r}, 1, {{"w": torch.arange(10)}})
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


@pytest.mark.timeout(120)
@pytest.mark.parametrize("asynchronous", [False, True], ids=["sync", "async"])
def test_sigkill_while_a_training_run_saves_then_resume_continues_from_the_previous_checkpoint(tmp_path, asynchronous):
    """A real run saving every 2 steps is SIGKILLed inside the write of step 4 (with save.async, in the background
    writer): resume starts after step 2 and reproduces the uninterrupted trajectory exactly."""
    script = textwrap.dedent(f"""
        import os, signal, sys, torch
        sys.path.insert(0, {str(TESTS / "faults")!r}); sys.path.insert(0, {str(TESTS)!r})
        from _faults import make_spec, train
        from vlmfast.checkpoints import store as checkpoint
        real_save = torch.save
        def dying_save(obj, f):
            if isinstance(obj, dict) and obj.get("trainer", {{}}).get("step") == 4:
                f.write(b"half a checkpoint")
                f.flush()
                os.kill(os.getpid(), signal.SIGKILL)
            real_save(obj, f)
        checkpoint.torch.save = dying_save
        train(make_spec(save={{"dir": {str(tmp_path)!r}, "every_steps": 2, "async": {asynchronous}}}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=100)
    assert proc.returncode == -signal.SIGKILL, proc.stderr.decode()[-2000:]
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002"]  # step 4 never became a checkpoint
    assert list(tmp_path.glob(".tmp-step_00000004-*"))
    _, full = train(make_spec())
    _, resumed = train(make_spec(save={"dir": str(tmp_path), "every_steps": 2, "async": asynchronous}))
    assert resumed.resumed_from.name == "step_00000002"
    assert [m["step"] for m in resumed.history] == list(range(3, 13))
    assert losses(resumed) == losses(full)[2:]
    assert not list(tmp_path.glob(".tmp-*"))  # the leftover of the killed writer is gone


class SignalInsideAStep(TinyCausalLM):
    """TinyCausalLM (dropout 0.1, as _faults.train builds it) that sends itself `signum` from inside its forward
    on micro-batch `micro` of step `step`: mid-step, with micro-batches of that step still to run."""

    def __init__(self, step: int, micro: int, micro_per_step: int, signum: int) -> None:
        super().__init__(dropout=0.1)
        self.at, self.signum, self.calls = (step - 1) * micro_per_step + micro, signum, 0
        self.sent_at_call: int | None = None

    def forward(self, input_ids, labels=None, attention_mask=None):
        if not torch.is_grad_enabled():  # the label-convention probe (once, no grad) is not a training call
            return super().forward(input_ids, labels, attention_mask)
        self.calls += 1
        if self.calls == self.at:
            os.kill(os.getpid(), self.signum)  # the handler runs here, before this forward goes on
            self.sent_at_call = self.calls
        return super().forward(input_ids, labels, attention_mask)


@pytest.mark.parametrize(("signum", "asynchronous"), [(signal.SIGTERM, False), (signal.SIGINT, False),
                                                     (signal.SIGTERM, True)])
def test_signal_writes_a_final_checkpoint_and_resume_continues_exactly(tmp_path, signum, asynchronous):
    """The signal arrives inside step 5 (in the forward of its 2nd micro-batch of 4): step 5 finishes, with all its
    micro-batches, is checkpointed, and nothing after it runs; resume reproduces the uninterrupted run exactly."""
    full_trainer, full = train(make_spec())
    spec = make_spec(save={"dir": str(tmp_path), "async": asynchronous})
    micro_per_step = spec.batch_size // spec.micro_batch_size
    torch.manual_seed(1234)  # the init _faults.train gives its own model
    model = SignalInsideAStep(step=5, micro=2, micro_per_step=micro_per_step, signum=signum)
    trainer, stopped = train(spec, model)
    assert model.sent_at_call == 4 * micro_per_step + 2  # inside step 5, not between steps
    assert model.calls == 5 * micro_per_step  # step 5's other micro-batches ran, no step 6
    assert stopped.interrupted == signal.Signals(signum).name
    assert trainer.state.step == 5 and [m["step"] for m in stopped.history] == [1, 2, 3, 4, 5]
    assert stopped.checkpoint.name == "step_00000005"
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000005"]
    assert losses(stopped) == losses(full)[:5]  # step 5 is the full step, not a cut-short one
    resumed_trainer, resumed = train(spec)
    assert resumed.resumed_from.name == "step_00000005"
    assert losses(resumed) == losses(full)[5:]
    for name, value in params_of(resumed_trainer.model).items():
        assert torch.equal(value, params_of(full_trainer.model)[name]), name


def test_a_signal_without_save_dir_says_no_checkpoint_is_written(tmp_path, capsys):
    """Without save.dir nothing is saved: the stop message must not promise a final checkpoint (issue 29)."""
    spec = make_spec(log={"progress": "on"})  # the metrics logger prints (stderr) as on a terminal
    model = SignalInsideAStep(step=2, micro=1, micro_per_step=spec.batch_size // spec.micro_batch_size,
                              signum=signal.SIGTERM)
    _, stopped = train(spec, model)
    err = capsys.readouterr().err
    assert stopped.interrupted == "SIGTERM" and stopped.checkpoint is None
    assert "SIGTERM received: stopping (no save.dir: no checkpoint is written)" in err, err
    assert "saving a final checkpoint" not in err
    _, saved = train(make_spec(log={"progress": "on"}, save={"dir": str(tmp_path)}),
                     SignalInsideAStep(step=2, micro=1, micro_per_step=4, signum=signal.SIGTERM))
    assert saved.checkpoint is not None
    assert "SIGTERM received: saving a final checkpoint and stopping" in capsys.readouterr().err

def test_missing_checkpoint_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        load_checkpoint(tmp_path / "step_00000009")
    with pytest.raises(SpecError, match=r"save.resume: checkpoint .*step_00000009 does not exist"):
        train(make_spec(save={"dir": str(tmp_path), "resume": str(tmp_path / "step_00000009")}))


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_corrupt_checkpoint_is_named_when_resuming(tmp_path, damage):
    """Checkpoints are atomic, but a disk or a person can still damage one afterwards: it is named, not half-loaded,
    and with no older checkpoint to fall back to nothing is resumed (or deleted)."""
    train(make_spec(max_steps=4, save={"dir": str(tmp_path)}))
    state = tmp_path / "step_00000004" / "state.pt"
    state.write_bytes(b"not a checkpoint" if damage == "garbage" else state.read_bytes()[: state.stat().st_size // 2])
    with pytest.raises(SpecError, match=r"(?s)cannot resume from .*step_00000004/state.pt has \d+ bytes where the "
                       r"manifest says .*Delete that checkpoint folder"):
        train(make_spec(max_steps=6, save={"dir": str(tmp_path)}))
    assert (tmp_path / "step_00000004").is_dir()
    with pytest.raises(CorruptCheckpointError, match=r"step_00000004/state.pt has \d+ bytes"):
        load_checkpoint(state.parent)
    (tmp_path / "step_00000004" / "manifest.json").unlink()  # as written by an older vlmfast: torch.load names it
    with pytest.raises(CorruptCheckpointError, match=r"step_00000004/state.pt cannot be read"):
        load_checkpoint(state.parent)


SETUP_TASK = '''
import os, signal
from vlmfast.models import build_tiny_vlm_task

def build():
    """The tiny VLM whose first forward (the trainer constructor's convention probe) gets a real SIGINT."""
    model, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=16)
    forward = model.forward

    def interrupted_forward(*args, **kwargs):
        model.forward = forward
        os.kill(os.getpid(), signal.SIGINT)
        return forward(*args, **kwargs)

    model.forward = interrupted_forward
    return model, dataset, collate
'''


@pytest.mark.timeout(120)
def test_ctrl_c_during_set_up_ends_like_ctrl_c_during_training(tmp_path):
    """SIGINT delivered inside `OptimizedTrainer.__init__` (the first probe forward): exit 130, one "interrupted"
    line, no traceback. Every set-up phase (probes, worker autotune, resume, fingerprint) runs under the same catch
    in cli/main.py."""
    (tmp_path / "setup_interrupt.py").write_text(SETUP_TASK)
    env = {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    env.pop("VLMFAST_TRACEBACK", None)
    proc = subprocess.run([sys.executable, "-c", "import sys; from vlmfast.cli.main import main; sys.exit(main())",
                           "train", "--task", "setup_interrupt:build", "--set", "max_steps=2", "--set",
                           "log.progress=off", "--set", "device=cpu"],
                          capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path)
    assert proc.returncode == 130, proc.stderr
    assert "interrupted" in proc.stderr and "Traceback" not in proc.stderr and "KeyboardInterrupt" not in proc.stderr
