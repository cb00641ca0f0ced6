"""A crafted DeepSpeed shard cannot run code at resume: every shard is unpickled weights-only, and refused naming it.

DeepSpeed's own loader calls torch.load(weights_only=False); vlmfast swaps in a weights-only checkpoint engine while
it loads (vlmfast.engines.deepspeed_safe_load). Runs single-process DeepSpeed on CPU in a fresh process.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from conftest import TinyCausalLM, TokenDataset

pytest.importorskip("deepspeed")

SHARD = "deepspeed/mp_rank_00_model_states.pt"


class RunsCode:
    """Unpickling this calls open(marker, 'w'): the marker file appears only if code in the file ran."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def _spec(directory: Path, **save):
    from vlmfast import TrainSpec

    return TrainSpec(max_steps=2, batch_size=8, micro_batch_size=4, log={"progress": "off"},
                     engine="deepspeed", deepspeed={"zero_stage": 2}, save={"dir": str(directory), **save})


def _worker(rank: int, root: str, out: str) -> None:
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        os.environ.pop(key, None)
    from vlmfast import OptimizedTrainer, SpecError
    from vlmfast.checkpoints.store import write_manifest

    root_path = Path(root)
    torch.manual_seed(0)
    OptimizedTrainer(TinyCausalLM(), TokenDataset(64), _spec(root_path / "run")).fit()
    folder = root_path / "run" / "step_00000002"
    marker = root_path / "code_ran"
    honest = torch.load(folder / SHARD, weights_only=True)
    torch.save({**honest, "module": RunsCode(str(marker))}, folder / SHARD)  # a shard that runs code when unpickled
    write_manifest(folder, 2)  # someone who can write the folder can rewrite the manifest too (a changed file
    error = None              # with the old manifest is refused by its checksum: test_checkpoint_integrity.py)
    try:
        OptimizedTrainer(TinyCausalLM(), TokenDataset(64), _spec(root_path / "resumed", resume=str(folder))).fit()
    except SpecError as exc:
        error = str(exc)
    torch.save({"error": error, "marker": marker.exists()}, out)


@pytest.mark.timeout(240)
def test_a_crafted_deepspeed_shard_does_not_run_and_the_resume_is_refused_naming_it(tmp_path):
    out = str(tmp_path / "out.pt")
    torch.multiprocessing.spawn(_worker, args=(str(tmp_path), out), nprocs=1)
    result = torch.load(out, weights_only=False)
    assert not result["marker"], "code inside the crafted shard ran"
    error = result["error"]
    assert error and f"step_00000002/{SHARD}: refused" in error and "nothing in it ran" in error
    # The crafted file is dangerous: DeepSpeed's own torch.load(weights_only=False) would have run it.
    torch.load(tmp_path / "run" / "step_00000002" / SHARD, weights_only=False)
    assert (tmp_path / "code_ran").exists()
