"""Loader tuning (num_workers auto), device prefetch, batched image preprocessing, memory-mapped datasets."""

from __future__ import annotations

import os
import pickle
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import TinyCausalLM, TokenDataset
from torch.utils.data import DataLoader, Dataset

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.data.autotune import autotune_num_workers, candidate_counts
from vlmfast.data.images import BatchImagePreprocessor, DeviceImageCollator, preprocess_images
from vlmfast.data.loader import ResumableLoader
from vlmfast.data.mmap import MemmapTensorDataset, MemmapTokenDataset, write_tensors, write_token_sequences
from vlmfast.data.prefetch import DevicePrefetcher, device_batches
from vlmfast.models import ShapesCaptionDataset, VLMCollator
from vlmfast.spec import DataSpec, SpecError


class SlowDataset(Dataset):
    """Each sample waits like a file read, so parallel workers are measurably faster than none."""

    def __init__(self, n: int = 400, wait_s: float = 0.01) -> None:
        self.n, self.wait_s = n, wait_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.wait_s)
        return torch.tensor([i])


# ---- num_workers: auto -------------------------------------------------------------------------------------------
def test_num_workers_auto_picks_a_parallel_count_for_a_slow_loader_and_records_why():
    spec = DataSpec(num_workers="auto", autotune_budget_s=3.0, autotune_max_workers=2, shuffle=False)
    loader = ResumableLoader(SlowDataset(), batch_size=4, spec=spec, seed=0)
    choice = loader.autotune
    assert [t.num_workers for t in choice.table] == [0, 1, 2]
    by_count = {t.num_workers: t.batches_per_s for t in choice.table}
    assert by_count[2] > 1.5 * by_count[0]  # 4 x 10 ms per batch in one process, half that with two workers
    assert choice.num_workers == 2 and loader.loader.num_workers == 2
    assert "picked 2 workers" in choice.reason and "batches/s by workers" in choice.reason
    assert choice.max_workers == 2 <= os.cpu_count() and choice.bound_by in ("autotune_max_workers", "cpu count")
    assert choice.as_dict()["table"][0]["batches"] >= 2
    assert next(loader).tolist() == [[0], [1], [2], [3]]  # the measurement did not move the data position


def test_num_workers_auto_prefers_fewer_workers_and_none_for_trivial_loading():
    per_batch = {0: 0.010, 1: 0.010, 2: 0.004}

    def fake_loader(n):  # each batch takes a fixed time per worker count
        for _ in range(1000):
            time.sleep(per_batch[n])
            yield n

    def choose():  # a wide tolerance: sleeps overshoot on a busy machine
        return autotune_num_workers(fake_loader, budget_s=0.9, max_workers=2, tolerance=0.3)

    assert choose().num_workers == 2  # 2.5x faster than 1 worker
    per_batch[2] = 0.009
    choice = choose()
    assert choice.num_workers == 1 and "fewest within 30%" in choice.reason  # as fast as 2, beats loading inline
    per_batch[0] = 0.0
    choice = choose()
    assert choice.num_workers == 0 and "too little" in choice.reason
    assert candidate_counts(6) == [0, 1, 2, 4, 6] and candidate_counts(1) == [0, 1]


def test_num_workers_auto_through_the_trainer_and_spec_validation(tmp_path: Path):
    spec = TrainSpec(max_steps=2, batch_size=4, device="cpu", log={"progress": "off"},
                     data={"num_workers": "auto", "autotune_budget_s": 0.5, "autotune_max_workers": 1})
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(32), spec)
    assert trainer.loader.autotune is not None and trainer.loader.loader.num_workers in (0, 1)
    assert len(trainer.fit().history) == 2
    bad = tmp_path / "bad.yaml"
    bad.write_text("data:\n  num_workers: -1\n")
    with pytest.raises(SpecError, match="num_workers must be >= 0 or 'auto'"):
        TrainSpec.from_file(bad)


# ---- device prefetch -------------------------------------------------------------------------------------------
def make_loader(n: int = 32) -> ResumableLoader:
    return ResumableLoader(TokenDataset(n), batch_size=4, spec=DataSpec(shuffle=False), seed=0)


def test_prefetch_runs_one_batch_ahead_and_checkpoints_the_consumed_position():
    reference = next(make_loader())
    source = make_loader()
    assert isinstance(device_batches(source, DataSpec(device_prefetch=True), torch.device("cpu")), DevicePrefetcher)
    batches = DevicePrefetcher(source, "cpu", background=False, depth=1)  # no thread: a deterministic position
    first = next(batches)
    assert torch.equal(first["input_ids"], reference["input_ids"])
    assert source.state_dict() == {"epoch": 0, "batch_in_epoch": 2}  # the next batch is already loaded
    assert batches.state_dict() == {"epoch": 0, "batch_in_epoch": 1}  # but a checkpoint resumes after `first`
    assert batches.loader is source.loader and batches.epoch == 0  # the rest is the wrapped loader's
    expected = [next(batches)["input_ids"] for _ in range(3)]
    resumed = DevicePrefetcher(make_loader(), "cpu")
    resumed.load_state_dict({"epoch": 0, "batch_in_epoch": 1})
    assert all(torch.equal(next(resumed)["input_ids"], e) for e in expected)
    assert device_batches(source, DataSpec(), torch.device("cpu")) is source  # off by default: no wrapper


def test_prefetch_keeps_the_host_batch_of_the_batch_handed_out_for_counting():
    from vlmfast.data.prefetch import host_batch

    hosts = [{"x": torch.arange(3) + i} for i in range(3)]
    batches = DevicePrefetcher(iter(hosts), "cpu", background=False, depth=1)
    first = next(batches)
    assert first is not hosts[0] and host_batch(batches, first) is hosts[0]  # the copy's host original
    second = next(batches)
    assert host_batch(batches, second) is hosts[1] and host_batch(batches, first) is first  # the last one only
    assert host_batch(iter(hosts), hosts[2]) is hosts[2]  # no prefetcher: the batch is on the host already


class RecordingSource:
    """Yields numbered batches and records which thread asked for each."""

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.second_call = threading.Event()

    def __iter__(self):
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        self.threads.append(threading.current_thread().name)
        if len(self.threads) == 2:
            self.second_call.set()
        return {"x": torch.tensor([len(self.threads)])}


def test_prefetch_loads_the_next_batch_in_a_background_thread():
    source = RecordingSource()
    batches = DevicePrefetcher(source, "cpu")
    assert next(batches)["x"].item() == 1
    assert source.second_call.wait(timeout=30)  # loaded before the consumer asked for it
    assert source.threads[0] == threading.current_thread().name and source.threads[1].startswith("vlmfast-prefetch")
    assert [next(batches)["x"].item() for _ in range(3)] == [2, 3, 4]
    batches.close()


def test_prefetch_moves_nested_batches_and_applies_the_transform():
    nested = iter([{"a": [torch.ones(2), (torch.zeros(1), "text")], "b": {"c": torch.arange(3)}}])
    out = next(DevicePrefetcher(nested, "cpu", transform=lambda b: {**b, "seen": True}))
    assert out["seen"] and out["a"][1][1] == "text" and torch.equal(out["b"]["c"], torch.arange(3))
    with pytest.raises(StopIteration):
        next(DevicePrefetcher(iter([]), "cpu"))


def test_workers_of_an_epoch_started_by_the_prefetch_thread_exit_cleanly():
    """Seen on an H200 first (vlmfast-best): the second epoch's workers are forked from the prefetch thread; each
    exited with code 1 after its work (concurrent.futures' exit hook joined that thread from itself), and the loader's
    shutdown raised "DataLoader worker ... exited unexpectedly"."""
    loader = ResumableLoader(TokenDataset(8), batch_size=4, spec=DataSpec(shuffle=False, num_workers=2), seed=0)
    batches = DevicePrefetcher(loader, torch.device("cpu"))
    seen = [next(batches)["input_ids"] for _ in range(6)]  # 3 epochs of 2 batches: later epochs fork in the thread
    batches.close()  # joins the workers: raised RuntimeError before the fix
    assert torch.equal(seen[0], seen[2]) and torch.equal(seen[1], seen[5])


class FailsAtStep:
    def on_step_end(self, trainer, metrics):
        if metrics["step"] == 2:
            raise RuntimeError("boom")


def test_a_fit_that_raises_stops_its_prefetch_thread_and_loader_workers():
    spec = TrainSpec(max_steps=6, batch_size=4, micro_batch_size=4, log={"progress": "off"},
                     data={"device_prefetch": True, "num_workers": 1})
    trainer = OptimizedTrainer(TinyCausalLM(), TokenDataset(32), spec, callbacks=[FailsAtStep()])
    with pytest.raises(RuntimeError, match="boom"):
        trainer.fit()
    alive = [t.name for t in threading.enumerate() if t.name.startswith("vlmfast-prefetch")]
    assert alive == [], "a failed fit left its prefetch thread loading batches"
    assert trainer.loader.source._iterator is None  # the loader's workers were shut down


@pytest.mark.gpu
def test_prefetch_copies_on_a_side_stream_from_pinned_memory():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    loader = ResumableLoader(TokenDataset(32), batch_size=4, spec=DataSpec(shuffle=False), seed=0, pin_memory=True)
    host = next(make_loader())["input_ids"]
    batches = DevicePrefetcher(loader, torch.device("cuda"))
    batch = next(batches)
    assert batches.stream is not None and batch["input_ids"].is_cuda
    assert torch.equal(batch["input_ids"].cpu(), host)
    pending = batches._collect()[0]
    assert pending["input_ids"].is_cuda  # the next batch was already sent


# ---- batched image preprocessing -------------------------------------------------------------------------------
def test_batched_preprocessing_matches_per_image_resize_with_one_op_per_size(monkeypatch):
    dataset = ShapesCaptionDataset(num_samples=12, seed=0)
    samples = [dataset[i] for i in range(12)]
    samples += [{**samples[0]}, {**samples[0]}, {**samples[1]}]  # repeated sizes are resized together
    reference = VLMCollator(image_size=48)(samples)
    calls = []
    interpolate = F.interpolate
    monkeypatch.setattr(F, "interpolate", lambda x, **kw: calls.append(x.shape[0]) or interpolate(x, **kw))

    batch = BatchImagePreprocessor(size=48)(DeviceImageCollator(image_size=48)(samples))
    assert torch.allclose(batch["pixel_values"], reference["pixel_values"], atol=1e-5)
    assert all(torch.equal(batch[k], reference[k]) for k in ("input_ids", "labels", "attention_mask"))
    sizes = {tuple(s["image"].shape) for s in samples}
    assert len(calls) == len(sizes) < len(samples) and sum(calls) == len(samples)


def test_device_image_size_in_the_spec_turns_raw_images_into_pixel_values():
    dataset = ShapesCaptionDataset(num_samples=8, seed=0)
    loader = ResumableLoader(dataset, batch_size=4, spec=DataSpec(shuffle=False), seed=0,
                             collate_fn=DeviceImageCollator(image_size=48))
    batches = device_batches(loader, DataSpec(device_image_size=48), torch.device("cpu"))
    batch = next(batches)
    assert "images" not in batch and batch["pixel_values"].shape == (4, 3, 48, 48)
    with pytest.raises(KeyError, match="no 'images' key"):
        BatchImagePreprocessor(48)({"input_ids": torch.zeros(1)})
    with pytest.raises(ValueError, match="image 0 has shape"):
        preprocess_images([torch.zeros(4, 4)], 8)


# ---- memory-mapped datasets ------------------------------------------------------------------------------------
def test_memmap_token_dataset_round_trip_dtype_and_workers(tmp_path: Path):
    sequences = [list(range(n, 2 * n + 1)) for n in range(1, 20)]
    write_token_sequences(sequences, tmp_path / "train", vocab_size=200)
    dataset = MemmapTokenDataset(tmp_path / "train")
    assert dataset.dtype == np.uint8 and len(dataset) == len(sequences)
    assert all(dataset[i]["input_ids"].tolist() == seq for i, seq in enumerate(sequences))
    assert pickle.loads(pickle.dumps(dataset))._tokens is None  # workers map the file themselves
    read = [s["input_ids"].tolist() for s in DataLoader(dataset, batch_size=None, num_workers=2)]
    assert read == sequences
    write_token_sequences([[70_000]], tmp_path / "big")
    assert MemmapTokenDataset(tmp_path / "big").dtype == np.uint32


def test_memmap_tensor_dataset_round_trip(tmp_path: Path):
    pixels, labels = torch.rand(10, 3, 4, 4), torch.arange(10)
    write_tensors({"pixel_values": pixels, "labels": labels}, tmp_path / "cached")
    dataset = MemmapTensorDataset(tmp_path / "cached")
    assert len(dataset) == 10 and torch.equal(dataset[7]["pixel_values"], pixels[7])
    assert dataset[7]["labels"].item() == 7
    with pytest.raises(ValueError, match="different numbers of samples"):
        write_tensors({"a": torch.zeros(3), "b": torch.zeros(4)}, tmp_path / "bad")
