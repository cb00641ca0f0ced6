"""One function per contender: the same workload trained by a hand-written loop, vlmfast, Accelerate, the Hugging
Face Trainer and Lightning Fabric, each returning the same measurements.

Every runner builds the model from the workload's shared initial weights, feeds the workload's data set through its
own data path for ``warmup + steps`` optimizer steps of ``batch_size`` samples, and records per step: the time from
the previous step's end (so data loading counts, as in any real loop), what the batch held (samples, real tokens,
token slots, model FLOPs: :meth:`Workload.batch_stats` on the batch the model is fed) and the training loss. On CUDA
each step's end is synchronised so the times are the device's.

Usage::

    result = hand_written(workload, Settings(), torch.device("cpu"))
    result.step_times, result.tokens, result.peak_memory_gb, result.eval_loss
"""

from __future__ import annotations

import contextlib
import ctypes
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import DataLoader

from vlmfast.bench.workload import Workload, evaluate_loss
from vlmfast.common.module_tree import find_repeated_blocks
from vlmfast.common.tf32 import restore_tf32_state, set_tf32, tf32_state
from vlmfast.data.batch import move_to_device
from vlmfast.data.micro_batches import SampleBatch
from vlmfast.memory.stats import GB
from vlmfast.strategies.compile import allow_recompiles
from vlmfast.strategies.precision import autocast_context

__all__ = ["RunResult", "Settings", "accelerate_loop", "fabric_loop", "hand_written", "hf_trainer", "vlmfast_run"]

_LOOP_PRECISION = {"accelerate": {"fp32": "no", "bf16": "bf16", "fp16": "fp16"},
                   "fabric": {"fp32": "32-true", "bf16": "bf16-mixed", "fp16": "16-mixed"}}


@dataclass(frozen=True)
class Settings:
    """What a configuration switches on; each runner reads the fields its tool has an equivalent for.

    ``spec`` holds TrainSpec overrides and is read by :func:`vlmfast_run` only; ``group_by_length`` and
    ``auto_find_batch_size`` by :func:`hf_trainer` only (the other loops have no such flag).
    """

    precision: str = "fp32"
    attention: str = "eager"  # the model's attention backend at start (vlmfast may switch it through its spec)
    compile: bool = False  # each repeated block in place (compile_blocks), as vlmfast's compile.scope: blocks
    compile_backend: str = "inductor"  # `bench --quick`: eager (dynamo captures the graph, nothing is compiled)
    num_workers: int = 0
    tf32: bool = False
    group_by_length: bool = False
    auto_find_batch_size: bool = False
    spec: dict[str, Any] = field(default_factory=dict)


@dataclass
class RunResult:
    """Per-step measurements of one run plus its end state (see the module docstring)."""

    step_times: list[float]
    samples: list[int]
    tokens: list[float]
    slots: list[int]
    flops: list[float]
    losses: list[float]
    peak_memory_gb: float
    memory_kind: str  # "cuda peak allocated" or "process RSS increase"
    eval_loss: float
    setup_s: float
    details: dict[str, Any] = field(default_factory=dict)


class StepRecorder:
    """Stamps step ends and keeps each step's batch statistics as lazy tensors (read once, at the end)."""

    def __init__(self, workload: Workload, device: torch.device) -> None:
        self.workload = workload
        self.device = device
        self.created = time.perf_counter()
        self.stamps: list[float] = []
        self.stats: list[dict[str, Tensor]] = []
        self.losses: list[Any] = []

    def start(self) -> None:
        """Called when the loop is about to fetch its first batch (again, if a tool restarts its loop)."""
        self.stamps = [time.perf_counter()]
        self.stats, self.losses = [], []

    def batch(self, batch: Mapping[str, Any] | SampleBatch) -> None:
        if isinstance(batch, SampleBatch):  # vlmfast's loader: the batch's collated micro-batches, summed
            parts = [self.workload.batch_stats(mb) for mb in batch.micro_batches]
            self.stats.append({key: sum(p[key] for p in parts) for key in parts[0]})
        else:
            self.stats.append(self.workload.batch_stats(batch))

    def step(self, loss: Any = None) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.stamps.append(time.perf_counter())
        if loss is not None:
            self.losses.append(loss)

    def result(self, trained: nn.Module, memory: MemoryWatch, **details: Any) -> RunResult:
        steps = len(self.stamps) - 1
        stats = self.stats[:steps]  # a prefetching loader may have pulled batches it never trained on
        values = {key: [float(s[key]) for s in stats] for key in ("samples", "tokens", "slots", "flops")}
        return RunResult(
            step_times=[b - a for a, b in zip(self.stamps, self.stamps[1:], strict=False)],
            samples=[int(v) for v in values["samples"]], tokens=values["tokens"],
            slots=[int(v) for v in values["slots"]], flops=values["flops"],
            losses=[float(v) for v in self.losses[:steps]], peak_memory_gb=memory.peak_gb, memory_kind=memory.kind,
            eval_loss=evaluate_loss(trained, self.workload, self.device),
            setup_s=self.stamps[0] - self.created, details=details)


class MemoryWatch:
    """Peak memory of a run: CUDA peak allocated, or on CPU the peak process RSS above the level at start.

    The CPU figure is sampled (every 10 ms) after handing freed heap back to the OS (glibc ``malloc_trim``), so a
    run is not credited with memory an earlier run left cached; DataLoader worker processes are not included.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.kind = "cuda peak allocated" if device.type == "cuda" else "process RSS increase"
        self.peak_gb = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> MemoryWatch:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)
            return self
        _malloc_trim()
        import psutil

        process = psutil.Process()
        base = process.memory_info().rss
        self._peak = base

        def sample() -> None:
            while not self._stop.wait(0.01):
                self._peak = max(self._peak, process.memory_info().rss)

        self._base = base
        self._thread = threading.Thread(target=sample, daemon=True, name="bench-rss")
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.device.type == "cuda":
            self.peak_gb = torch.cuda.max_memory_allocated(self.device) / GB
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak_gb = (self._peak - self._base) / GB


def _malloc_trim() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _loader(workload: Workload, settings: Settings, device: torch.device) -> DataLoader:
    """The loader a user writes: the data set in its given order, whole batches, the settings' workers."""
    workers = settings.num_workers
    return DataLoader(workload.dataset, batch_size=workload.batch_size, shuffle=False, collate_fn=workload.collate,
                      drop_last=True, num_workers=workers, pin_memory=device.type == "cuda",
                      persistent_workers=workers > 0)


def _fused_adamw(model: nn.Module, workload: Workload, device: torch.device) -> torch.optim.Optimizer:
    # Every contender gets fused AdamW (vlmfast's and the HF Trainer's default on CPU and CUDA).
    return torch.optim.AdamW(model.parameters(), lr=workload.lr, fused=device.type in ("cpu", "cuda"))


@contextlib.contextmanager
def _tf32(enabled: bool) -> Iterator[None]:
    """TF32 on for the block (through the API that neither transformers nor Lightning trips over), then back."""
    saved = tf32_state()
    if enabled:
        set_tf32(True)
    try:
        yield
    finally:
        restore_tf32_state(saved)


def compile_blocks(model: nn.Module, settings: Settings) -> int:
    """What a user of another tool writes to compile per block: every module of each repeated stack of the model
    (found by structure, :func:`~vlmfast.common.module_tree.find_repeated_blocks`, not by names), compiled in place.

    Blocks of one class share their compiled code, so this compiles a few graphs where whole-model compilation traces
    everything: the same scope as vlmfast's ``compile.scope: blocks``. Returns the number of blocks (0: compile off).
    Usage: ``compile_blocks(model, Settings(compile=True))`` before the tool wraps the model.
    """
    if not settings.compile:
        return 0
    blocks = [block for stack in find_repeated_blocks(model).values() for block in stack]
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no repeated blocks (an nn.ModuleList of two or more modules of "
                         "one class) to compile one by one")
    allow_recompiles(len(blocks))  # what vlmfast's compile_model does too: one graph per layer must not hit 8
    for block in blocks:
        block.compile(backend=settings.compile_backend)
    return len(blocks)


def hand_written(workload: Workload, settings: Settings, device: torch.device) -> RunResult:
    """The user's starting point: ``loss = model(**batch).loss; loss.backward(); opt.step(); opt.zero_grad()``.

    Usage: ``hand_written(workload, Settings(), device)`` (fp32, eager attention, padded batches, no compile).
    """
    recorder = StepRecorder(workload, device)
    with MemoryWatch(device) as memory, _tf32(settings.tf32):
        model = workload.build_model(settings.attention).to(device).train()
        optimizer = _fused_adamw(model, workload, device)
        blocks = compile_blocks(model, settings)
        recorder.start()
        micro = workload.fp32_micro_batch_size if settings.precision == "fp32" else None
        for batch in _loader(workload, settings, device):
            recorder.batch(batch)
            batch = move_to_device(batch, device)
            loss = _accumulated_backward(model, batch, micro, settings.precision, device)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            recorder.step(loss.item())  # the user's logging; also where a CUDA loop waits for the device
    return recorder.result(model, memory, **({"compiled_blocks": blocks} if blocks else {}))


def _accumulated_backward(model: nn.Module, batch: dict[str, Tensor], micro: int | None, precision: str,
                          device: torch.device) -> Tensor:
    """``model(**batch).loss.backward()``; with ``micro``, what a user writes when the batch does not fit: rows in
    chunks of ``micro`` (one image per row: gpu-1b's processor batches), each loss weighted by its share of the
    batch's label tokens so the gradient is the whole batch's. Returns the batch's loss (detached when split)."""
    rows = batch["input_ids"].shape[0]
    if micro is None or micro >= rows:
        with autocast_context(precision, device):
            loss = model(**batch).loss
        loss.backward()
        return loss
    total = (batch["labels"][:, 1:] != -100).sum()
    summed = torch.zeros((), device=device)
    for start in range(0, rows, micro):
        part = {key: value[start:start + micro] for key, value in batch.items()}
        with autocast_context(precision, device):
            loss = model(**part).loss * ((part["labels"][:, 1:] != -100).sum() / total)
        loss.backward()
        summed += loss.detach()
    return summed


def vlmfast_run(workload: Workload, settings: Settings, device: torch.device) -> RunResult:
    """``OptimizedTrainer(model, dataset, spec).fit()`` with the settings' spec overrides on a plain base spec.

    The base spec is the starting point's: fp32, micro-batch = batch, constant lr, no clipping, the data set's order
    (``data.shuffle: false``), MFU counted by formula (``profile.flops: analytic``), the leak check's baseline taken
    at step 1 (``memory.leak_warmup_steps: 0``); every other field keeps vlmfast's default (phase timing every 10
    steps, leak check on).
    Usage: ``vlmfast_run(workload, Settings(spec={"precision": "bf16"}), device)``
    """
    from vlmfast import Callback, OptimizedTrainer, TrainSpec

    class Clock(Callback):
        def on_fit_start(self, trainer: Any) -> None:
            recorder.start()

        def on_step_end(self, trainer: Any, metrics: dict[str, Any]) -> None:
            recorder.step(metrics["loss"])

    base = {"seed": 0, "max_steps": workload.total_steps, "batch_size": workload.batch_size, "device": str(device),
            "optimizer": {"lr": workload.lr}, "data": {"shuffle": False}, "log": {"progress": "off"},
            # Start-up costs moved out of the timed steps ("vlmfast-defaults" keeps and shows them): MFU by formula,
            # since the default (measured) runs one step per new batch shape under FlopCounterMode (~15 padded
            # shapes in 40 steps); the leak check's baseline census (one gc.get_objects() pass, ~65 ms with
            # transformers imported) at the first reading instead of step 30.
            "profile": {"flops": "analytic"}, "memory": {"leak_warmup_steps": 0}}
    spec = TrainSpec(**_deep_merge(base, settings.spec))
    recorder = StepRecorder(workload, device)
    with MemoryWatch(device) as memory:
        model = workload.build_model(settings.attention)
        trainer = OptimizedTrainer(model, workload.dataset, spec, collate_fn=workload.collate, callbacks=[Clock()])
        trainer.loader = _Tap(trainer.loader, recorder.batch)
        fit = trainer.fit()
    return recorder.result(model, memory, **_vlmfast_details(trainer, fit, settings))


def _vlmfast_details(trainer: Any, fit: Any, settings: Settings) -> dict[str, Any]:
    """What the run says it switched on: the report's strategy lines and the data path it built."""
    loader = trainer.loader.inner
    resumable = getattr(loader, "source", loader)
    autotune = getattr(resumable, "autotune", None)
    return {"spec_overrides": settings.spec, "strategies": list(fit.report.strategies),
            "data": {"num_workers": resumable.loader.num_workers,
                     "num_workers_reason": getattr(autotune, "reason", None),
                     "device_prefetch": type(loader).__name__ == "DevicePrefetcher",
                     "sampler": type(resumable.sampler).__name__, "collate": type(trainer.collate_fn).__name__},
            "report_tokens_per_s": fit.report.tokens_per_s}


class _Tap:
    """Wraps the trainer's batch source: each batch handed out is recorded, everything else is delegated."""

    def __init__(self, inner: Any, record: Callable[[Any], None]) -> None:
        self.inner = inner
        self.record = record

    def __iter__(self) -> _Tap:
        return self

    def __next__(self) -> Any:
        batch = next(self.inner)
        self.record(batch)
        return batch

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _deep_merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        merged[key] = _deep_merge(merged[key], value) if isinstance(value, Mapping) and isinstance(
            merged.get(key), dict) else value
    return merged


def _reset_accelerate_state() -> None:
    """Accelerate keeps process-wide singletons; each Accelerator (or HF Trainer) run must start from none."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


def accelerate_loop(workload: Workload, settings: Settings, device: torch.device) -> RunResult:
    """The Accelerate loop: ``Accelerator(mixed_precision, dynamo_backend)``, ``prepare``, ``accelerator.backward``.

    Usage: ``accelerate_loop(workload, Settings(precision="bf16"), device)``
    """
    from accelerate import Accelerator

    _reset_accelerate_state()
    recorder = StepRecorder(workload, device)
    with MemoryWatch(device) as memory, _tf32(settings.tf32):
        # Accelerate's dynamo_backend compiles the whole model: the blocks are compiled in place instead
        accelerator = Accelerator(cpu=device.type == "cpu", mixed_precision=_LOOP_PRECISION["accelerate"][
            settings.precision])
        model = workload.build_model(settings.attention)
        blocks = compile_blocks(model, settings)
        optimizer = _fused_adamw(model.to(device), workload, device)
        step_model, optimizer, loader = accelerator.prepare(model, optimizer, _loader(workload, settings, device))
        step_model.train()
        recorder.start()
        for batch in loader:  # already on the device
            recorder.batch(batch)
            loss = step_model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            recorder.step(loss.item())
        mixed_precision = accelerator.mixed_precision
    _reset_accelerate_state()
    return recorder.result(model, memory, mixed_precision=mixed_precision, compiled_blocks=blocks)


def fabric_loop(workload: Workload, settings: Settings, device: torch.device) -> RunResult:
    """The Lightning Fabric loop: ``Fabric(accelerator, precision)``, ``setup``, ``fabric.backward``.

    Usage: ``fabric_loop(workload, Settings(precision="bf16"), device)``
    """
    from lightning_fabric import Fabric

    recorder = StepRecorder(workload, device)
    with MemoryWatch(device) as memory, _tf32(settings.tf32):
        fabric = Fabric(accelerator=device.type, devices=1, precision=_LOOP_PRECISION["fabric"][settings.precision])
        model = workload.build_model(settings.attention)
        optimizer = _fused_adamw(model.to(fabric.device), workload, device)
        blocks = compile_blocks(model, settings)  # in place, before setup wraps the model
        step_model, optimizer = fabric.setup(model, optimizer)
        loader = fabric.setup_dataloaders(_loader(workload, settings, device))
        step_model.train()
        recorder.start()
        for batch in loader:
            recorder.batch(batch)
            loss = step_model(**batch).loss
            fabric.backward(loss)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            recorder.step(loss.item())
    return recorder.result(model, memory, precision=str(fabric.strategy.precision.precision), compiled_blocks=blocks)


class _DictOutput(nn.Module):
    """The tiny VLM as the HF Trainer expects a model: a dict with ``loss``; its own mean loss (no loss kwargs)."""

    accepts_loss_kwargs = False  # batch = optimizer batch here, so the model's token mean is already exact

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, **batch: Tensor) -> dict[str, Tensor]:
        out = self.model(**batch)
        return {"loss": out.loss, "logits": out.logits}


def hf_trainer(workload: Workload, settings: Settings, device: torch.device) -> RunResult:
    """``transformers.Trainer`` with ``TrainingArguments`` equivalent to the settings, timed by a callback.

    Usage: ``hf_trainer(workload, Settings(precision="bf16", group_by_length=True), device)``
    """
    from transformers import Trainer, TrainerCallback

    class Clock(TrainerCallback):
        def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            recorder.start()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            recorder.step()

    class RecordingTrainer(Trainer):
        def training_step(self, model: nn.Module, inputs: dict[str, Any], *args: Any, **kwargs: Any) -> Tensor:
            recorder.batch(inputs)
            loss = super().training_step(model, inputs, *args, **kwargs)
            recorder.losses.append(loss)  # detached; read after training, so no extra device sync
            return loss

    _reset_accelerate_state()
    _fresh_transformers_tf32()
    recorder = StepRecorder(workload, device)
    with MemoryWatch(device) as memory, _tf32(settings.tf32), tempfile.TemporaryDirectory() as out:
        model = workload.build_model(settings.attention)
        blocks = compile_blocks(model, settings)  # TrainingArguments.torch_compile would compile the whole model
        trainer = RecordingTrainer(model=_DictOutput(model), args=_training_arguments(workload, settings, device, out),
                                   train_dataset=workload.dataset, data_collator=workload.collate, callbacks=[Clock()])
        trainer.train()
        args = trainer.args
    _reset_accelerate_state()
    return recorder.result(model, memory, sampler=args.train_sampling_strategy, bf16=args.bf16,
                           compiled_blocks=blocks, auto_find_batch_size=args.auto_find_batch_size,
                           dataloader_num_workers=args.dataloader_num_workers)


def _fresh_transformers_tf32() -> None:
    """transformers' enable_tf32 is lru_cached: without this it sets TF32 in the first HF run of the process only,
    and later rounds of the same configuration would run without the TF32 it asked for."""
    try:
        from transformers.utils import import_utils
    except ImportError:
        return
    cache_clear = getattr(getattr(import_utils, "enable_tf32", None), "cache_clear", None)
    if cache_clear is not None:
        cache_clear()


def _training_arguments(workload: Workload, settings: Settings, device: torch.device, out: str) -> Any:
    """TrainingArguments equal to the other loops: same steps, batch, lr, fused AdamW, no clipping, no logging."""
    from transformers import TrainingArguments

    return TrainingArguments(
        output_dir=out, max_steps=workload.total_steps, per_device_train_batch_size=workload.batch_size,
        learning_rate=workload.lr, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=0.0,
        optim="adamw_torch_fused", seed=0, report_to=[], save_strategy="no", eval_strategy="no",
        logging_strategy="no", disable_tqdm=True, use_cpu=device.type == "cpu", remove_unused_columns=False,
        dataloader_drop_last=True, dataloader_num_workers=settings.num_workers,
        dataloader_persistent_workers=settings.num_workers > 0, dataloader_pin_memory=device.type == "cuda",
        train_sampling_strategy="group_by_length" if settings.group_by_length else "sequential",
        bf16=settings.precision == "bf16", fp16=settings.precision == "fp16", tf32=settings.tf32 or None,
        auto_find_batch_size=settings.auto_find_batch_size,
    )
