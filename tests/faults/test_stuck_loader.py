"""A loader that stops delivering: past data.timeout_s the run writes its final checkpoint and raises a
DataLoaderTimeoutError naming the sample indices (and the worker), without worker processes (the default), under
device prefetch, and with a worker process; the checkpoint resumes exactly."""

from __future__ import annotations

import threading
import time

import pytest
from _faults import losses, make_spec, train
from conftest import TokenDataset

from vlmfast import DataLoaderTimeoutError, TrainSpec
from vlmfast.checkpoints.store import list_checkpoints
from vlmfast.data.loader import EpochSampler, ResumableLoader
from vlmfast.spec import DataSpec

RELEASE = threading.Event()  # set after each test: the abandoned thread finishes its load and exits


class StuckAt(TokenDataset):
    """TokenDataset whose sample `index` never returns while `stuck` (a read blocked forever)."""

    def __init__(self, index: int, stuck: bool = True) -> None:
        super().__init__(64)
        self.index, self.stuck = index, stuck

    def __getitem__(self, i):
        if self.stuck and i == self.index:
            RELEASE.wait()
        return super().__getitem__(i)


@pytest.fixture(autouse=True)
def _release_stuck_threads():
    RELEASE.clear()
    yield
    RELEASE.set()


# The 4th batch (step 4) holds the stuck sample: 3 steps run, then the loader stops delivering.
STUCK = EpochSampler(64, seed=0, shuffle=True)._indices()[3 * 8 + 5]


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("data", "where"), [
    ({}, r"in the main process \(num_workers: 0\)"),
    ({"device_prefetch": True}, r"\(device prefetch thread\)"),
    ({"num_workers": 1}, "in DataLoader worker 0"),
])
def test_a_stuck_read_ends_the_run_with_a_final_checkpoint_and_an_error_naming_the_samples(tmp_path, data, where):
    assert STUCK not in (0, 21, 42, 63)  # not a sample the fingerprint reads (those are bounded by the timeout too)
    spec = make_spec(data={"timeout_s": 2, **data}, save={"dir": str(tmp_path)})
    started = time.monotonic()
    with pytest.raises(DataLoaderTimeoutError, match=rf"data.timeout_s=2 s while loading the samples at indices "
                                                     rf"\[.*\b{STUCK}\b.*\] \(batch 3 of epoch 0\) {where}") as error:
        train(spec, data=StuckAt(STUCK))
    assert time.monotonic() - started < 60
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003"]
    assert error.value.checkpoint == list_checkpoints(tmp_path)[0]
    if not data:  # the stuck batch was not counted: the resume loads it again and continues as if never stopped
        _, full = train(make_spec(max_steps=5))
        _, resumed = train(make_spec(max_steps=5, save={"dir": str(tmp_path)}), data=StuckAt(STUCK, stuck=False))
        assert losses(resumed) == losses(full)[3:]


@pytest.mark.timeout(60)
def test_a_stuck_sample_of_the_fingerprint_is_named_before_any_step(tmp_path):
    spec = make_spec(data={"timeout_s": 1}, save={"dir": str(tmp_path)})
    with pytest.raises(DataLoaderTimeoutError, match=r"sample 21 \(read for the data fingerprint, before any step\)"):
        train(spec, data=StuckAt(21))
    assert list_checkpoints(tmp_path) == []


def test_timeout_s_is_validated():
    assert TrainSpec().data.timeout_s == 600
    for bad in (-1, float("inf")):
        with pytest.raises(ValueError, match="timeout_s"):
            TrainSpec(data={"timeout_s": bad})


def test_a_closed_loader_loads_on_in_a_new_bounded_thread():
    """fit() closes the loader at its end; batches read after it (the doctor reads some) still load, bounded."""
    loader = ResumableLoader(StuckAt(STUCK), batch_size=8, spec=DataSpec(timeout_s=1, shuffle=False), seed=0)
    first = next(loader)
    loader.close()
    assert not first["input_ids"].equal(next(loader)["input_ids"])  # the next batch, from a new thread
    loader.close()
    loader.load_state_dict({"epoch": 0, "batch_in_epoch": STUCK // 8})
    with pytest.raises(DataLoaderTimeoutError, match=rf"indices \[.*\b{STUCK}\b.*\] \(batch {STUCK // 8} of epoch 0\)"):
        next(loader)
    with pytest.raises(DataLoaderTimeoutError):  # no more batches from a stuck loader: the same error at once
        next(loader)
    loader.close()


def test_the_loader_thread_runs_torch_ops_on_one_core_and_leaves_every_other_threads_setting():
    """A second thread with parallel regions gets an OpenMP team of its own, and libgomp then throttles the training
    thread's team too (it sleeps and wakes between ops: -11 % on the cpu-vlm benchmark). The loads run on one core;
    the caller and threads started later keep the process's setting."""
    import torch

    from vlmfast.data.timeout import LoaderThread, wait_for

    before = torch.get_num_threads()
    thread = LoaderThread("test-loader")
    try:
        assert wait_for(thread.submit(torch.get_num_threads), 5, lambda: "a thread count") == 1
        later: list[int] = []
        other = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
        other.start()
        other.join()
        assert torch.get_num_threads() == before and later == [before]
    finally:
        thread.shutdown()
