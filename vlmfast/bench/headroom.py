"""Memory headroom: the largest micro-batch that fits per strategy under one memory budget, and the run that the
OOM fallback completes where the plain loop crashes.

The budget is what the starting point (fp32, eager attention) needs for one step on ``batch_size`` of the data set's
longest samples, so the plain loop just fits the benchmark's batch and every strategy shows what it adds.

- CUDA: real memory. The budget is the plain step's measured peak; ``torch.cuda.set_per_process_memory_fraction``
  caps the process at it and every probe runs forward, backward and the optimizer step until the allocator raises.
- CPU (no allocator limit to hit): a memory model. A step needs the model states (weights, gradients, AdamW's two
  moments: 16 bytes per parameter, the same for every strategy here) plus the bytes autograd saves for backward,
  measured on a real forward pass of the probe's micro-batch (``vlmfast.hooks.saved_tensor_bytes``: what
  checkpointing, bf16 and SDPA change). A probe over the budget raises ``torch.OutOfMemoryError``; the largest
  size is found by vlmfast's own binary search (``find_max_micro_batch_size``).

The fallback run: batch = twice the plain loop's largest micro-batch. The hand-written loop raises out of memory at
step 1; vlmfast with ``oom.enabled`` halves the micro-batch, keeps the batch (gradient accumulation) and completes;
the HF Trainer's ``auto_find_batch_size`` completes too, but by shrinking the batch itself. On CPU the out-of-memory
condition is ``vlmfast.testing.simulated_oom`` at the plain loop's largest micro-batch.

Usage::

    result = run_headroom(build_workload("cpu"), torch.device("cpu"))
    result["largest_micro_batch"]["checkpointing"]["largest"]
"""

from __future__ import annotations

import contextlib
import io
import logging
import tempfile
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from vlmfast.bench.runners import _DictOutput, _fused_adamw, _reset_accelerate_state
from vlmfast.bench.workload import BenchDataset, Workload
from vlmfast.data.batch import move_to_device
from vlmfast.hooks import apply_activation_checkpointing, find_max_micro_batch_size, free_memory, saved_tensor_bytes
from vlmfast.strategies.precision import autocast_context
from vlmfast.testing import simulated_oom

__all__ = ["HEADROOM_STRATEGIES", "run_headroom"]

log = logging.getLogger(__name__)

# Strategy -> (precision, attention backend, activation checkpointing). Packing is left out: it changes what a row
# holds, so its micro-batch is not a number of samples.
HEADROOM_STRATEGIES: dict[str, tuple[str, str, bool]] = {
    "plain (fp32, eager)": ("fp32", "eager", False),
    "bf16": ("bf16", "eager", False),
    "sdpa": ("fp32", "sdpa", False),
    "checkpointing": ("fp32", "eager", True),
    "checkpointing + bf16 + sdpa": ("bf16", "sdpa", True),
}
STATE_BYTES_PER_PARAM = 16  # fp32 weights 4 + gradients 4 + AdamW m 4 + v 4 (autocast keeps fp32 weights)


class _LongestSamples:
    """Batches of n of the data set's longest samples (the worst case a length-grouped run meets first)."""

    def __init__(self, workload: Workload, pool: int = 32) -> None:
        lengths = workload.dataset.lengths
        self.indices = sorted(range(len(lengths)), key=lambda i: -lengths[i])[:pool]
        self.samples = [workload.dataset[i] for i in self.indices]
        self.collate = workload.collate

    def batch(self, n: int) -> dict[str, torch.Tensor]:
        return self.collate([self.samples[i % len(self.samples)] for i in range(n)])

    def dataset(self, workload: Workload, size: int) -> BenchDataset:
        return BenchDataset(workload.dataset.base, [workload.dataset.order[self.indices[i % len(self.indices)]]
                                                    for i in range(size)])


def _strategy_model(workload: Workload, strategy: str, device: torch.device) -> nn.Module:
    _, attention, checkpointing = HEADROOM_STRATEGIES[strategy]
    model = workload.build_model(attention).to(device).train()
    if checkpointing:
        apply_activation_checkpointing(model)
    return model


def _cpu_probe(workload: Workload, strategy: str, samples: _LongestSamples, budget: int,
               device: torch.device) -> Callable[[int], None]:
    """probe(n): raises torch.OutOfMemoryError when states + saved activations of n samples exceed the budget."""
    model = _strategy_model(workload, strategy, device)
    precision = HEADROOM_STRATEGIES[strategy][0]
    states = STATE_BYTES_PER_PARAM * workload.num_parameters

    def probe(n: int) -> None:
        batch = move_to_device(samples.batch(n), device)
        with autocast_context(precision, device):
            needed = states + saved_tensor_bytes(lambda: model(**batch).loss)
        if needed > budget:
            raise torch.OutOfMemoryError(f"CPU memory model: {needed / 2**20:.1f} MiB needed, budget "
                                         f"{budget / 2**20:.1f} MiB")

    return probe


def _cuda_probe(workload: Workload, strategy: str, samples: _LongestSamples,
                device: torch.device) -> Callable[[int], None]:
    """probe(n): one real forward + backward + optimizer step on n samples (the allocator raises when it is full)."""
    model = _strategy_model(workload, strategy, device)
    optimizer = _fused_adamw(model, workload, device)
    precision = HEADROOM_STRATEGIES[strategy][0]

    def probe(n: int) -> None:
        batch = move_to_device(samples.batch(n), device)
        try:
            with autocast_context(precision, device):
                loss = model(**batch).loss
            loss.backward()
            optimizer.step()
        finally:
            optimizer.zero_grad(set_to_none=True)

    return probe


@contextlib.contextmanager
def _cuda_budget(budget: int | None, device: torch.device) -> Iterator[None]:
    """Cap this process's CUDA memory at `budget` bytes for the block (no cap on CPU or when None)."""
    if budget is None or device.type != "cuda":
        yield
        return
    total = torch.cuda.get_device_properties(device).total_memory
    free_memory()  # cached segments of the previous run count against the cap: start from an empty cache
    torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total), device)
    try:
        yield
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
        free_memory()


def _budget(workload: Workload, samples: _LongestSamples, device: torch.device) -> int:
    """What the plain loop needs for one step on batch_size of the longest samples (see the module docstring)."""
    plain = next(iter(HEADROOM_STRATEGIES))
    if device.type == "cuda":
        free_memory()
        torch.cuda.reset_peak_memory_stats(device)
        _cuda_probe(workload, plain, samples, device)(workload.batch_size)
        # The cap (set_per_process_memory_fraction) limits what the caching allocator *reserves* from the device
        # (c10/cuda/CUDACachingAllocator.cpp checks allowed_memory_maximum against reserved bytes), so the budget
        # is the plain step's peak reserved memory: its peak allocated memory is lower by the allocator's rounding
        # and fragmentation, and capping at that would make the plain batch itself fail.
        peak = torch.cuda.max_memory_reserved(device)
        free_memory()
        return int(peak * 1.02)  # 2 %: segment-size rounding of a fresh run, so the plain batch itself still fits
    model = _strategy_model(workload, plain, device)
    batch = samples.batch(workload.batch_size)
    return STATE_BYTES_PER_PARAM * workload.num_parameters + saved_tensor_bytes(lambda: model(**batch).loss)


def largest_micro_batches(workload: Workload, device: torch.device, max_size: int,
                          budget: int | None = None) -> dict[str, Any]:
    """For each strategy in HEADROOM_STRATEGIES: the largest micro-batch of the longest samples within the budget."""
    samples = _LongestSamples(workload)
    budget = budget or _budget(workload, samples, device)
    found: dict[str, Any] = {}
    for strategy in HEADROOM_STRATEGIES:
        with _cuda_budget(budget, device):
            search = _search(workload, strategy, samples, budget, device, max_size)
        found[strategy] = {"largest": search.largest, "tried": {str(k): v for k, v in sorted(search.tried.items())}}
    return {"budget_bytes": budget, "max_size_tried": max_size, "strategies": found}


def _search(workload: Workload, strategy: str, samples: _LongestSamples, budget: int, device: torch.device,
            max_size: int) -> Any:
    # Its own function: the probe's model and optimizer are released on return, before the next strategy's.
    probe = (_cuda_probe(workload, strategy, samples, device) if device.type == "cuda"
             else _cpu_probe(workload, strategy, samples, budget, device))
    return find_max_micro_batch_size(probe, max_size, device=device)


@contextlib.contextmanager
def _out_of_memory_above(limit: int, budget: int, device: torch.device) -> Iterator[None]:
    """The demo's memory limit: the real CUDA cap, or simulated_oom at the plain loop's largest micro-batch."""
    if device.type == "cuda":
        with _cuda_budget(budget, device):
            yield
    else:
        with simulated_oom(limit):
            yield


def _plain_loop_crashes(workload: Workload, data: BenchDataset, batch: int, steps: int,
                        device: torch.device) -> dict[str, Any]:
    """The hand-written loop at `batch`: how far it gets."""
    model = workload.build_model("eager").to(device).train()
    optimizer = _fused_adamw(model, workload, device)
    loader = torch.utils.data.DataLoader(data, batch_size=batch, collate_fn=workload.collate, drop_last=True)
    done = 0
    try:
        for host in loader:
            if done == steps:
                break
            loss = model(**move_to_device(host, device)).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            done += 1
    except torch.OutOfMemoryError as exc:
        error = f"{type(exc).__name__} at step {done + 1}: {str(exc).splitlines()[0][:120]}"
        return {"completed": False, "steps": done, "error": error}
    return {"completed": True, "steps": done}


def _vlmfast_fallback(workload: Workload, data: BenchDataset, batch: int, steps: int,
                      device: torch.device) -> dict[str, Any]:
    """OptimizedTrainer with oom.enabled at `batch`: completes at a smaller micro-batch, same batch."""
    from vlmfast import OptimizedTrainer, TrainSpec

    spec = TrainSpec(max_steps=steps, batch_size=batch, device=str(device), optimizer={"lr": workload.lr},
                     data={"shuffle": False}, oom={"enabled": True}, log={"progress": "off"},
                     profile={"flops": "analytic"})
    trainer = OptimizedTrainer(workload.build_model("eager"), data, spec, collate_fn=workload.collate)
    with contextlib.redirect_stderr(io.StringIO()):
        fit = trainer.fit()
    return {"completed": trainer.state.step == steps, "steps": trainer.state.step, "batch_size": batch,
            "micro_batch_size": trainer.state.micro_batch_size,
            "accumulation_steps": trainer.state.accumulation_steps, "final_loss": fit.history[-1]["loss"],
            "report": next((s for s in fit.report.strategies if s.startswith("oom")), "")}


def _hf_auto_find_batch_size(workload: Workload, data: BenchDataset, batch: int, steps: int,
                             device: torch.device) -> dict[str, Any]:
    """The HF Trainer with auto_find_batch_size at `batch`: completes by shrinking the batch (x0.9 per OOM)."""
    from transformers import Trainer, TrainingArguments

    _reset_accelerate_state()
    with tempfile.TemporaryDirectory() as out, contextlib.redirect_stdout(io.StringIO()):
        args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=batch,
                                 learning_rate=workload.lr, report_to=[], save_strategy="no", logging_strategy="no",
                                 disable_tqdm=True, use_cpu=device.type == "cpu", remove_unused_columns=False,
                                 auto_find_batch_size=True, train_sampling_strategy="sequential",
                                 dataloader_drop_last=True)
        trainer = Trainer(model=_DictOutput(workload.build_model("eager")), args=args, train_dataset=data,
                          data_collator=workload.collate)
        trainer.train()
    _reset_accelerate_state()
    final = trainer._train_batch_size
    return {"completed": trainer.state.global_step >= 1, "steps": trainer.state.global_step,
            "batch_size_requested": batch, "batch_size_used": final,
            "note": "the batch itself shrank: fewer samples per optimizer step than asked for" if final < batch
            else "no shrink needed"}


def oom_fallback_demo(workload: Workload, device: torch.device, plain_largest: int, budget: int,
                      steps: int = 3) -> dict[str, Any]:
    """Batch = 2 x the plain loop's largest micro-batch: the plain loop, vlmfast's fallback and HF's shrinking."""
    samples = _LongestSamples(workload)
    batch = 2 * plain_largest
    data = samples.dataset(workload, batch * steps)
    out: dict[str, Any] = {"batch_size": batch, "steps": steps,
                           "limit": f"CUDA memory capped at {budget / 2**30:.2f} GiB" if device.type == "cuda" else
                           f"simulated_oom({plain_largest}): forward passes over {plain_largest} samples raise"}
    runs: dict[str, Callable[..., dict[str, Any]]] = {"hand-written": _plain_loop_crashes,
                                                      "vlmfast (oom.enabled)": _vlmfast_fallback}
    import importlib.util

    if importlib.util.find_spec("transformers") is not None:
        runs["hf-trainer (auto_find_batch_size)"] = _hf_auto_find_batch_size
    for name, run in runs.items():
        try:
            with _out_of_memory_above(plain_largest, budget, device):
                out[name] = run(workload, data, batch, steps, device)
        except Exception as exc:  # reported, not raised: the other runs still tell their story
            out[name] = {"completed": False, "error": f"{type(exc).__name__}: {str(exc)[:200]}"}
        free_memory()
    return out


def run_headroom(workload: Workload, device: torch.device, max_size: int | None = None,
                 steps: int = 3) -> dict[str, Any]:
    """Largest micro-batch per strategy, then the OOM-fallback demo at twice the plain loop's largest."""
    max_size = max_size or 8 * workload.batch_size
    found = largest_micro_batches(workload, device, max_size)
    plain = found["strategies"][next(iter(HEADROOM_STRATEGIES))]["largest"]
    found["budget_kind"] = ("CUDA: the plain step's measured peak, enforced by set_per_process_memory_fraction"
                            if device.type == "cuda" else "CPU memory model: 16 B/parameter model states + bytes "
                            "autograd saves for backward (measured)")
    found["oom_fallback"] = oom_fallback_demo(workload, device, plain, found["budget_bytes"], steps)
    return found
