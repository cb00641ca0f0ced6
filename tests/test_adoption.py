"""What a new team hits first (issue 20): short runs, launchers that start fewer processes than asked, their own model
through the CLI, BatchNorm under micro-batching. Single-process and fast; the multi-process loops are in
tests/test_hooks_in_loops.py and the printed commands in tests/test_printed_commands.py.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from vlmfast.spec import TrainSpec


def test_a_warm_up_longer_than_the_run_is_clamped_with_a_note(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="vlmfast.spec"):
        spec = TrainSpec(max_steps=10, scheduler={"name": "cosine", "warmup_steps": 20})
    assert spec.scheduler.warmup_steps == 1
    assert "scheduler.warmup_steps 20 is not below max_steps 10: warming up over 1 step(s)" in caplog.text
    caplog.clear()
    assert TrainSpec(max_steps=30, scheduler={"warmup_steps": 20}).scheduler.warmup_steps == 20  # untouched
    assert not caplog.records


def test_launch_warning_when_accelerate_launch_started_one_process(monkeypatch: pytest.MonkeyPatch,
                                                                   caplog: pytest.LogCaptureFixture) -> None:
    from vlmfast.engines import foreign_loops as integrations
    from vlmfast.engines.foreign_loops import launch_warning
    from vlmfast.engines.process_group import init_distributed

    monkeypatch.setattr(integrations, "_warned", set())  # warned once per process: start from none

    # What `accelerate launch --num_processes 2` sets on a machine without GPUs: one process, MASTER_ADDR, no WORLD_SIZE
    simple = {"ACCELERATE_MIXED_PRECISION": "no", "ACCELERATE_USE_CPU": "False", "MASTER_ADDR": "127.0.0.1",
              "MASTER_PORT": "29500"}
    assert "--multi_gpu --num_processes N" in launch_warning(environ=simple)
    assert launch_warning(environ={**simple, "WORLD_SIZE": "2"}) is None  # torchrun-style: fine
    assert launch_warning(environ={"MASTER_ADDR": "127.0.0.1"}) is None  # not accelerate: nothing to say
    assert launch_warning(environ={}) is None

    class AloneAccelerator:  # an Accelerator() that found no GPU under a 2-process launch
        num_processes = 1

    assert "Accelerator(cpu=True)" in launch_warning(AloneAccelerator(), environ={"WORLD_SIZE": "2"})

    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(key, raising=False)
    for key, value in simple.items():
        monkeypatch.setenv(key, value)
    with caplog.at_level(logging.WARNING, logger="vlmfast.engines.foreign_loops"):
        assert init_distributed().world_size == 1  # the trainer's first call
    assert "started only this one" in caplog.text


CNN_TASK = '''
import torch
from torch import nn
from torch.nn import functional as F


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)
        self.norm = nn.BatchNorm2d(4)
        self.head = nn.Linear(4, 3)

    def forward(self, x):
        return self.head(F.relu(self.norm(self.conv(x))).mean(dim=(2, 3)))


def loss_fn(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


def build():
    g = torch.Generator().manual_seed(0)
    data = [{"x": torch.randn(3, 8, 8, generator=g), "y": torch.tensor(i % 3)} for i in range(32)]
    return SmallCNN(), data, None, loss_fn


def build_dict():
    model, data, _, loss = build()
    return {"model": model, "train_data": data, "loss_fn": loss}


def two_things():
    return SmallCNN(), []


def not_a_model():
    return "model", [], None


def bad_loss():
    return SmallCNN(), [], None, 3
'''


@pytest.fixture
def cnn_task(tmp_path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "cnn_task.py").write_text(CNN_TASK)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    return "cnn_task"


def test_task_may_return_a_loss_fn_and_batchnorm_is_warned_about_once(cnn_task, caplog, monkeypatch) -> None:
    from vlmfast.cli.main import main as vlmfast
    from vlmfast.strategies import accumulation

    monkeypatch.setattr(accumulation, "_BATCHNORM_WARNED", [])
    run = ["train", "--set", "max_steps=3", "--set", "batch_size=8", "--set", "log.progress=off"]
    with caplog.at_level(logging.WARNING):
        assert vlmfast([*run, "--set", "micro_batch_size=4", "--task", f"{cnn_task}:build"]) == 0
    warnings = [r.getMessage() for r in caplog.records if "BatchNorm" in r.getMessage()]
    assert len(warnings) == 1 and "(norm)" in warnings[0] and "micro-batches of 4" in warnings[0]
    caplog.clear()
    monkeypatch.setattr(accumulation, "_BATCHNORM_WARNED", [])
    with caplog.at_level(logging.WARNING):  # the dict shape, no split: nothing to warn about
        assert vlmfast([*run, "--task", f"{cnn_task}:build_dict"]) == 0
    assert "BatchNorm" not in caplog.text


@pytest.mark.parametrize(("function", "message"), [
    ("two_things", r"returned a tuple of 2 item\(s\) \(SmallCNN, list\); expected \(model, train_dataset, "
                   r"collate_fn\), \(model, train_dataset, collate_fn, loss_fn\)"),
    ("not_a_model", r"the model \(first item\) is a str, not a torch.nn.Module"),
    ("bad_loss", r"loss_fn is a int, not a function"),
])
def test_task_returning_the_wrong_shape_names_what_it_returned(cnn_task, capsys, function, message) -> None:
    import re

    from vlmfast.cli.main import main as vlmfast

    assert vlmfast(["train", "--task", f"{cnn_task}:{function}"]) == 2
    error = capsys.readouterr().err
    assert re.search(message, error), error


def _render_with_torch(scene):
    """The earlier torch renderer, kept as the reference: rendering moved to numpy for speed, not for new pixels."""
    import torch

    from vlmfast.models import shapes

    h, w = scene.height, scene.width
    ys = torch.arange(h, dtype=torch.float32).add_(0.5).view(h, 1)
    xs = torch.arange(w, dtype=torch.float32).add_(0.5).view(1, w)
    image = torch.tensor(scene.background, dtype=torch.uint8).view(3, 1, 1).expand(3, h, w)
    cell_h, cell_w = h / len(shapes.ROWS), w / len(shapes.COLS)
    for obj in scene.objects:
        radius = shapes.SIZE_SCALE[obj.size] * min(cell_h, cell_w) / 2
        cy = (obj.cell // 3 + 0.5) * cell_h + obj.jitter_y * 0.5 * max(0.0, cell_h / 2 - radius)
        cx = (obj.cell % 3 + 0.5) * cell_w + obj.jitter_x * 0.5 * max(0.0, cell_w / 2 - radius)
        mask = _torch_mask(obj.shape, ys - cy, xs - cx, radius)
        image = torch.where(mask, torch.tensor(shapes.COLORS[obj.color], dtype=torch.uint8).view(3, 1, 1), image)
    return image.contiguous()


def _torch_mask(shape, dy, dx, radius):
    import torch

    ady, adx = dy.abs(), dx.abs()
    if shape == "circle":
        return dy * dy + dx * dx <= radius * radius
    if shape == "square":
        return torch.maximum(ady, adx) <= 0.85 * radius
    if shape == "triangle":
        return (dy <= radius) & (adx <= (dy + radius) / 2)
    return ((adx <= radius / 3) & (ady <= radius)) | ((ady <= radius / 3) & (adx <= radius))


def test_demo_images_render_the_same_pixels_many_times_faster() -> None:
    """The default demo waited ~10 % of its step time for data, nearly all of it rendering images with torch ops."""
    import torch

    from vlmfast.models.shapes import ShapesCaptionDataset, render_scene

    scenes = [ShapesCaptionDataset(num_samples=400, seed=seed).scene(i) for seed in (0, 7) for i in range(200)]
    for scene in scenes:
        assert torch.equal(render_scene(scene), _render_with_torch(scene))
    # The speed comes from issuing no torch operator per pixel operation (each costs ~10 us of dispatch): counted
    # here, deterministically; the time itself is in benchmarks/profiling_overhead.py's data-wait figure.
    from torch.overrides import TorchFunctionMode

    class CountOps(TorchFunctionMode):
        def __init__(self) -> None:
            super().__init__()
            self.calls = 0

        def __torch_function__(self, func, types, args=(), kwargs=None):
            self.calls += 1
            return func(*args, **(kwargs or {}))

    with CountOps() as new:
        render_scene(scenes[0])
    with CountOps() as old:
        _render_with_torch(scenes[0])
    assert new.calls <= 1 < 10 < old.calls, (new.calls, old.calls)


def test_powersgd_warns_that_its_state_is_not_checkpointed(caplog, monkeypatch) -> None:
    import torch
    import torch.distributed as dist

    from vlmfast.engines import comm_hooks

    monkeypatch.setattr(comm_hooks, "_POWERSGD_WARNED", [])
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 4))
        with caplog.at_level(logging.WARNING, logger="vlmfast.engines.comm_hooks"):
            comm_hooks.register_comm_hook(ddp, "powersgd", start_iter=2)
    finally:
        dist.destroy_process_group()
    assert "PowerSGD's state (error feedback, warm start, its step counter) is not saved in checkpoints" in caplog.text


def test_a_slow_silent_wait_gets_a_message_and_a_quick_one_none(caplog) -> None:
    """What DeepSpeed's first start (compiling its ops for minutes) now says; the engine wraps initialize in it."""
    import time

    from vlmfast.common.utils import notice_if_slow
    from vlmfast.engines import deepspeed as ds_engine

    with caplog.at_level(logging.WARNING, logger="vlmfast"):
        with notice_if_slow("still building", after_s=0.05):
            time.sleep(0.5)
        with notice_if_slow("never shown", after_s=5):
            pass
    assert "still building" in caplog.text and "never shown" not in caplog.text
    assert "notice_if_slow(DEEPSPEED_BUILD_NOTICE)" in Path(ds_engine.__file__).read_text()


def test_deepspeeds_deprecated_collective_warnings_are_filtered() -> None:
    import warnings

    from vlmfast.engines import deepspeed as ds_engine
    from vlmfast.engines.foreign_loops import filter_deepspeed_warnings

    message = ("`torch.distributed.reduce_scatter_tensor` is deprecated. Please use "
               "`torch.distributed.reduce_scatter_single` instead.")
    with warnings.catch_warnings(record=True) as caught:  # restores the process's filters afterwards
        warnings.simplefilter("always")
        filter_deepspeed_warnings()
        for _ in range(3):
            warnings.warn(message, FutureWarning, stacklevel=1)
        warnings.warn("something else is deprecated", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in caught] == ["something else is deprecated"]
    assert "filter_deepspeed_warnings()" in Path(ds_engine.__file__).read_text()
