"""Preemption as schedulers do it: SIGTERM (or Ctrl-C's SIGINT) to the whole process group, loader workers included.

The run must end with a final checkpoint at the step it reached: DataLoader workers ignore the signal (the main
process stops them), with 2 workers, with the prefetch thread, and under DDP (2 ranks, each with 2 workers).
Each run is a fresh process group (start_new_session), so the signal reaches exactly the run's processes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from vlmfast.checkpoints.store import latest_checkpoint, load_checkpoint, verify_checkpoint

TESTS = Path(__file__).resolve().parents[1]

RUN = """
import json, sys, torch
sys.path.insert(0, {faults!r}); sys.path.insert(0, {tests!r})
from _faults import make_spec, train
torch.set_num_threads(1)
overrides = {extra!r}
spec = make_spec(max_steps=100_000, save={{"dir": {save!r}, **overrides.pop("save", {{}})}}, data={data!r},
                 log={{"dir": {log!r}, "progress": "off"}}, **overrides)
trainer, result = train(spec)
print(json.dumps({{"step": trainer.state.step, "interrupted": result.interrupted,
                  "checkpoint": str(result.checkpoint)}}), flush=True)
"""

DDP_RUN = """
import json, os, signal, socket, sys, torch
sys.path.insert(0, {faults!r}); sys.path.insert(0, {tests!r})

def rank_main(rank, port):
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from _faults import make_spec, train
    spec = make_spec(max_steps=100_000, save={{"dir": {save!r}}}, data={data!r},
                     log={{"dir": {log!r} if rank == 0 else None, "progress": "off"}})
    trainer, result = train(spec)
    if rank == 0:
        print(json.dumps({{"step": trainer.state.step, "interrupted": result.interrupted,
                          "checkpoint": str(result.checkpoint)}}), flush=True)

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = torch.multiprocessing.start_processes(rank_main, args=(port,), nprocs=2, join=False,
                                                    start_method="spawn")
    for sig in (signal.SIGTERM, signal.SIGINT):  # the launcher (torchrun's role) leaves stopping to the ranks
        signal.signal(sig, signal.SIG_IGN)
    while not context.join():
        pass
"""


def _preempt(tmp_path: Path, template: str, data: dict, signum: int, min_steps: int = 3,
             timeout: float = 150.0, extra: dict | None = None) -> tuple[dict, Path]:
    save, log = tmp_path / "ckpt", tmp_path / "logs"
    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent(template.format(faults=str(TESTS / "faults"), tests=str(TESTS), save=str(save),
                                                      log=str(log), data=data, extra=extra or {})))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True, text=True)
    metrics = log / "metrics.jsonl"
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline and proc.poll() is None:
            if metrics.is_file() and len(metrics.read_text().splitlines()) >= min_steps:
                break
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert metrics.is_file(), "the run never reached its first steps"
        os.killpg(proc.pid, signum)  # every process of the run: main, ranks, loader workers
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, err[-4000:]
    assert "killed by signal" not in err and "exited unexpectedly" not in err, err[-4000:]
    lines = [line for line in out.splitlines() if line.startswith("{")]
    assert lines, err[-4000:]
    return json.loads(lines[-1]), save


def _assert_final_checkpoint_at_the_step_reached(outcome: dict, save: Path, signum: int) -> None:
    assert outcome["interrupted"] == signal.Signals(signum).name
    latest = latest_checkpoint(save)
    assert latest is not None and str(latest) == outcome["checkpoint"]
    assert latest.name == f"step_{outcome['step']:08d}"
    verify_checkpoint(latest)
    assert load_checkpoint(latest)["trainer"]["step"] == outcome["step"]


@pytest.mark.timeout(200)
@pytest.mark.parametrize(("signum", "data", "extra"), [
    (signal.SIGTERM, {"num_workers": 2}, {}),
    (signal.SIGINT, {"num_workers": 2, "device_prefetch": True, "persistent_workers": True}, {}),
    (signal.SIGTERM, {"num_workers": 2}, {"save": {"async": True, "every_steps": 2}}),
], ids=["SIGTERM", "SIGINT-prefetch", "SIGTERM-async"])
def test_a_signal_to_the_process_group_with_loader_workers_ends_with_the_final_checkpoint(tmp_path, signum, data,
                                                                                          extra):
    outcome, save = _preempt(tmp_path, RUN, data, signum, extra=extra)
    _assert_final_checkpoint_at_the_step_reached(outcome, save, signum)


@pytest.mark.timeout(500)
def test_sigterm_to_the_process_group_under_deepspeed_with_workers_ends_with_the_final_checkpoint(tmp_path):
    """~20 s when DeepSpeed's shm op is built; its first build on a loaded 2-core machine took 2.5 min."""
    pytest.importorskip("deepspeed")
    outcome, save = _preempt(tmp_path, RUN, {"num_workers": 2}, signal.SIGTERM, timeout=400,
                             extra={"engine": "deepspeed", "deepspeed": {"zero_stage": 2}})
    _assert_final_checkpoint_at_the_step_reached(outcome, save, signal.SIGTERM)
    assert (latest_checkpoint(save) / "deepspeed").is_dir()  # the engine's shards are in the final checkpoint


@pytest.mark.timeout(240)
def test_sigterm_to_the_process_group_under_ddp_with_workers_ends_with_the_final_checkpoint(tmp_path):
    outcome, save = _preempt(tmp_path, DDP_RUN, {"num_workers": 2}, signal.SIGTERM, timeout=200)
    _assert_final_checkpoint_at_the_step_reached(outcome, save, signal.SIGTERM)


def test_workers_ignore_stop_signals_and_run_the_users_init(tmp_path):
    """The worker_init_fn the loader installs: SIGTERM/SIGINT ignored in the worker, the user's init still runs."""
    from conftest import TokenDataset
    from torch.utils.data import DataLoader

    from vlmfast.data.loader import ResumableLoader
    from vlmfast.spec import DataSpec

    seen = tmp_path / "init_ran"
    user = DataLoader(TokenDataset(16), batch_size=8, num_workers=1, worker_init_fn=_TouchFile(str(seen)))
    loader = ResumableLoader(user, 8, DataSpec(), seed=0)
    batch = next(loader)
    assert batch["input_ids"].shape[0] == 8 and seen.exists()
    dispositions = next(ResumableLoader(_SignalDispositions(), 2, DataSpec(num_workers=1, shuffle=False), seed=0))
    assert dispositions.tolist() == [[1, 1]] * 2  # SIGTERM blocked (taken by a sigwaitinfo thread), SIGINT ignored
    assert torch.utils.data.get_worker_info() is None


class _TouchFile:
    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, worker_id: int) -> None:
        Path(self.path).touch()


class _SignalDispositions(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, [])
        return torch.tensor([int(signal.SIGTERM in blocked), int(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)])
