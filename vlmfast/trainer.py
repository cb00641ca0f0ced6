"""OptimizedTrainer: the loop. Split the optimizer batch into micro-batches, forward/backward, one optimizer step.

Usage::

    result = OptimizedTrainer(model, dataset, TrainSpec(batch_size=16, micro_batch_size=4), collate_fn=collate).fit()
    result.history[-1]["loss"], trainer.state.step

The trainer owns the order of events; each strategy (precision, accumulation, optimizer, ...) owns what happens at
its points. The loader yields the whole per-rank optimizer batch, so the effective batch never depends on the
micro-batch size (Composer's design).
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from vlmfast.callbacks import Callback
from vlmfast.checkpoint import check_resume_compatible
from vlmfast.data.batch import batch_size_of, count_input_tokens, move_to_device
from vlmfast.data.loader import ResumableLoader
from vlmfast.data.packing import build_packing_collator, packed_batch_counts
from vlmfast.data.prefetch import device_batches
from vlmfast.distributed.backend import build_backend
from vlmfast.distributed.ddp import explain_ddp_error
from vlmfast.distributed.process_group import apply_nccl_presets, explain_rank_failure, init_distributed
from vlmfast.evaluation import evaluate_loss
from vlmfast.interrupt import InterruptGuard
from vlmfast.memory.advice import memory_summary, oom_advice
from vlmfast.memory.batch_size import BatchSizeSearch, search_trainer_micro_batch_size
from vlmfast.memory.monitor import MemoryMonitor
from vlmfast.memory.stats import memory_stats, peak_memory_gb, reset_peak_memory
from vlmfast.profiling import RunProfiler
from vlmfast.reporting import MetricsLogger, RunReport
from vlmfast.run_checkpoints import resume_trainer, save_if_configured, save_trainer
from vlmfast.spec import SpecError, TrainSpec, check_environment
from vlmfast.strategies.accumulation import (
    AccumulationPlan,
    GradientAccumulation,
    LossFn,
    all_reduce_gradients,
    scale_gradients,
)
from vlmfast.strategies.attention import AttentionBackend
from vlmfast.strategies.base import Strategy
from vlmfast.strategies.checkpointing import ActivationCheckpointing
from vlmfast.strategies.compile import TorchCompile
from vlmfast.strategies.nonfinite import handle_nonfinite
from vlmfast.strategies.oom import OOMFallback
from vlmfast.strategies.optimizer import Optimization
from vlmfast.strategies.precision import MixedPrecision
from vlmfast.utils import resolve_device, rng_state, seed_everything, set_rng_state

log = logging.getLogger(__name__)


@dataclass
class TrainState:
    """Counters that a checkpoint restores; `step` counts optimizer steps."""

    step: int = 0
    micro_batch_size: int = 0
    accumulation_steps: int = 1
    samples_seen: int = 0
    tokens_seen: int = 0
    skipped_steps: int = 0
    consecutive_skips: int = 0


@dataclass
class FitResult:
    """What `fit` returns: per-step metrics of this run, the report, and how it ended."""

    history: list[dict[str, Any]]
    report: RunReport
    interrupted: str | None = None  # the signal name when SIGTERM/SIGINT ended the run
    checkpoint: Path | None = None
    eval_loss: float | None = None
    resumed_from: Path | None = None
    eval_history: list[dict[str, Any]] = field(default_factory=list)


class OptimizedTrainer:
    """Train `model` on `train_data` as `spec` says. See the module docstring for usage."""

    def __init__(
        self,
        model: nn.Module,
        train_data: Dataset | DataLoader,
        spec: TrainSpec | dict[str, Any] | str | Path,
        loss_fn: LossFn | None = None,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        eval_data: Dataset | DataLoader | None = None,
        callbacks: Sequence[Callback] = (),
    ) -> None:
        self.spec = TrainSpec.coerce(spec)
        check_environment(self.spec)  # fail before any work
        apply_nccl_presets(self.spec.ddp.nccl_presets)  # NCCL reads its environment when the group starts
        env = init_distributed(self.spec.ddp.timeout_minutes)  # before the device: binds this rank to its GPU
        self.rank, self.world_size = env.rank, env.world_size
        self.device = resolve_device(self.spec.device)
        seed_everything(self.spec.seed + self.rank)  # DDP syncs weights from rank 0; dropout should differ
        self.callbacks = list(callbacks)
        self.collate_fn = collate_fn
        self.eval_data = eval_data
        self.should_stop = False  # a callback may set it; the run ends after the current step
        self._interrupt: str | None = None  # a signal received here (set by fit)
        self._stop_agreed = False  # under DDP: some rank wants to stop (agreed inside the step's all-reduce)
        mbs = self.spec.resolved_micro_batch_size
        self.state = TrainState(micro_batch_size=mbs, accumulation_steps=-(-self.spec.batch_size // mbs))

        self.backend = build_backend(self.spec, self.device, self.world_size)
        self.deepspeed = self.backend if self.backend.name == "deepspeed" else None  # it also owns backward/step
        self.strategies = self._build_strategies(loss_fn)
        model = model.to(self.device)
        for strategy in self.strategies:
            model = strategy.apply(model)
        self.model = model = self.backend.wrap(model, self.optimization)  # last: strategies change the plain model
        self.timer = RunProfiler(self.spec.profile, model, self.device, precision=self.spec.precision,
                                 tf32=self.spec.tf32, log_dir=self.spec.log.dir, is_main_process=self.is_main_process,
                                 keep_steps=self.spec.log.history_steps)
        # DDP + OOM fallback: DDP's in-backward all-reduce would strand a peer whose rank hit the OOM, so gradients
        # stay local (no_sync) until all ranks agree the step finished, then are averaged by hand.
        self._manual_grad_sync = self.oom is not None and self.world_size > 1 and hasattr(model, "no_sync")
        if self._manual_grad_sync and self.spec.ddp.comm_hook != "none":
            log.warning("ddp.comm_hook %s does not apply with oom.enabled on several ranks: gradients are averaged "
                        "by vlmfast after all ranks agree (see docs/oom.md)", self.spec.ddp.comm_hook)
        self._backward = self.deepspeed.backward if self.deepspeed else self.precision.backward
        self._context_strategies = [s for s in self.strategies
                                    if type(s).forward_context is not Strategy.forward_context]
        if self.spec.packing.enabled:  # after apply: accumulation resolved whether the model shifts labels
            self.collate_fn = build_packing_collator(
                self.spec.packing, _unwrap(model), collate_fn, shift_labels=bool(self.accumulation.shift_labels),
                ignore_index=self.spec.loss.ignore_index)
        pin = self.spec.data.pin_memory if self.spec.data.pin_memory is not None else self.device.type == "cuda"
        self.loader = device_batches(  # data.device_prefetch: the next batch is copied while this step runs
            ResumableLoader(train_data, self.spec.batch_size, self.spec.data, self.spec.seed, self.collate_fn,
                            pin_memory=pin, rank=self.rank, world_size=self.world_size,
                            micro_batch_size=None if self.spec.packing.enabled else mbs),  # samples, collated per mb
            self.spec.data, self.device)

    def _build_strategies(self, loss_fn: LossFn | None) -> list[Strategy]:
        """The strategies the spec turns on, in the order they change the model (the backend wraps it last)."""
        spec, mbs = self.spec, self.spec.resolved_micro_batch_size
        # DeepSpeed (bf16 weights + fp32 masters) and FSDP (its mixed-precision policy) own precision: no autocast.
        precision = "fp32" if self.backend.owns_precision else spec.precision
        self.precision = MixedPrecision(precision, self.device, tf32=spec.tf32)
        loss = spec.loss
        self.accumulation = GradientAccumulation(
            mbs, weighting=loss.weighting, label_key=loss.label_key, ignore_index=loss.ignore_index,
            shift_labels=loss.shift_labels, loss_fn=loss_fn, world_size=self.world_size,
        )
        self.optimization = Optimization(spec, self.device)
        strategies: list[Strategy] = [self.precision, self.accumulation, self.optimization]
        if spec.attention.backend is not None:
            strategies.append(AttentionBackend(spec.attention, precision=spec.precision))
        if spec.activation_checkpointing.enabled:  # after Optimization: it must see which modules are frozen
            strategies.append(ActivationCheckpointing(spec.activation_checkpointing))
        self.memory_monitor = self._build_memory_monitor()
        self.oom: OOMFallback | None = None
        if spec.oom.enabled:
            dump = self.memory_monitor.dump_snapshot if spec.memory.record_history and spec.log.dir else None
            self.oom = OOMFallback(spec.oom, mbs, describe_memory=self._describe_memory, on_oom=dump)
            strategies.append(self.oom)
        if spec.compile.enabled:  # last: it traces the checkpointed blocks; the backend (DDP) wraps the compiled model
            strategies.append(TorchCompile(spec.compile))
        return strategies

    def _build_memory_monitor(self) -> MemoryMonitor | None:
        """Leak detection, allocator history and the timeline plot, fed by the trainer's memory readings."""
        memory = self.spec.memory
        if not (memory.leak_check or memory.record_history or (memory.timeline_plot and self.spec.log.dir)):
            return None
        monitor = MemoryMonitor(memory, self.device, self.spec.log.dir, every_steps=self.spec.log.memory_every_steps)
        self.callbacks.insert(0, monitor)
        return monitor

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.optimization.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        return self.optimization.scheduler

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    # ---- the loop -------------------------------------------------------------------------------------------
    def fit(self) -> FitResult:
        """Train until `max_steps` (resuming first when `save.resume` finds a checkpoint)."""
        resumed_from = resume_trainer(self)
        self.model.train()
        reset_peak_memory(self.device)
        history: list[dict[str, Any]] = []
        result = FitResult(history=history, report=None, resumed_from=resumed_from)  # type: ignore[arg-type]
        metrics_logger = MetricsLogger(self.spec.log, self.spec.max_steps, self.state.step, self.is_main_process)
        self._fire("on_fit_start")
        start, first_step, first_loss = time.perf_counter(), self.state.step, None
        rank_failure = explain_rank_failure(self.world_size, self.spec.ddp.timeout_minutes)  # no silent hang
        with metrics_logger, InterruptGuard(self.spec.save.on_interrupt) as guard, rank_failure:
            if resumed_from is not None:
                metrics_logger.write(f"resumed from {resumed_from} at step {self.state.step}")
            tick = time.perf_counter()
            while self.state.step < self.spec.max_steps and not self._should_stop(guard):
                self.timer.begin_step(self.state.step + 1)
                with self.timer.phase("data_wait"):
                    batch = next(self.loader)
                data_time = time.perf_counter() - tick
                metrics = self.train_step(batch)
                metrics.update(self.timer.end_step())
                now = time.perf_counter()
                metrics.update(self._throughput(metrics, step_time=now - tick, data_time=data_time))
                tick = now
                history.append(metrics)
                first_loss = metrics["loss"] if first_loss is None else first_loss
                _bound(history, self.spec.log.history_steps)
                metrics_logger.log_step(metrics)
                self._fire("on_step_end", metrics)
                self._periodic_eval_and_save(result)
            interrupted = guard.requested or (self._stop_agreed and not self.should_stop and "a signal on another rank")
            result.interrupted = interrupted or None
            if interrupted:
                metrics_logger.write(f"{interrupted} received: saving a final checkpoint and stopping")
            result.checkpoint = save_if_configured(self, final=True) or result.checkpoint
            if self.world_size > 1:  # nobody leaves before rank 0's checkpoint is on disk and DDP work is done
                torch.distributed.barrier()
            if self.eval_data is not None and not result.interrupted:
                result.eval_loss = self._record_eval(result)
            result.report = self._build_report(history, time.perf_counter() - start)
            # history may hold only the latest steps (log.history_steps): the run's first loss and step count
            result.report.steps, result.report.first_loss = self.state.step - first_step, first_loss
            result.report.extra.update(self.timer.finish(history))
            if bad := getattr(self.loader, "sample_counts", dict)().get("bad"):
                result.report.extra["bad samples skipped"] = bad
            if self.is_main_process:
                metrics_logger.write(result.report.to_text())
                self._write_report(result.report)
        getattr(self.loader, "close", lambda: None)()  # the prefetch thread, if any
        self._fire("on_fit_end", result)
        return result

    def train_step(self, batch: Any) -> dict[str, Any]:
        """One optimizer step on one per-rank batch: accumulate gradients, then update. Returns the step metrics."""
        plan, loss = self._forward_backward_with_fallback(batch)
        with self.timer.phase("optimizer"):
            loss, grad_norm, stepped = self._apply_update(plan, loss)
        lr = self.scheduler.get_last_lr()[0]  # the rate this step used, read before the scheduler moves on
        self.scheduler.step()
        self.state.step += 1
        self.state.micro_batch_size = self.accumulation.micro_batch_size
        self.state.accumulation_steps = len(plan.micro_batches)
        if self.spec.packing.enabled:  # rows hold several samples
            samples, tokens = packed_batch_counts(batch)
        else:
            samples, tokens = batch_size_of(batch), count_input_tokens(batch)
        self.state.samples_seen += samples * self.world_size
        self.state.tokens_seen += tokens * self.world_size
        metrics = {"step": self.state.step, "loss": loss, "lr": lr,
                   "micro_batch_size": self.state.micro_batch_size, "accumulation_steps": self.state.accumulation_steps,
                   "samples": samples, "tokens": tokens, "skipped": not stepped}
        if grad_norm is not None:
            metrics["grad_norm"] = grad_norm
        return metrics

    def _forward_backward_with_fallback(self, batch: Any) -> tuple[AccumulationPlan, torch.Tensor]:
        """Gradients of the whole batch; with the OOM fallback, retried at smaller micro-batches until they fit."""
        if self.oom is None:
            return self._forward_backward(batch, self.accumulation.micro_batch_size)
        result = self.oom.run(lambda mbs: self._forward_backward(batch, mbs), cleanup=self._discard_gradients)
        if self._manual_grad_sync:
            all_reduce_gradients(self.optimization.trainable, self.world_size, self.spec.ddp.bucket_cap_mb)
        return result

    def _forward_backward(self, batch: Any, micro_batch_size: int) -> tuple[AccumulationPlan, torch.Tensor]:
        self.accumulation.micro_batch_size = micro_batch_size
        plan = self.accumulation.plan(batch)
        return plan, self._accumulate_gradients(plan)

    def _discard_gradients(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.precision.reset_after_oom()

    def _describe_memory(self) -> str:
        advice = "\n".join(f"  - {line}" for line in oom_advice(self.spec))
        return f"memory: {memory_summary(self.device)}\ntry, cheapest first:\n{advice}"

    def _accumulate_gradients(self, plan: AccumulationPlan) -> torch.Tensor:
        """Forward/backward every micro-batch; gradients sum to the full-batch gradient. Returns the loss tensor."""
        total = torch.zeros((), device=self.device)
        scale = self.accumulation.backward_scale()
        last = len(plan.micro_batches) - 1
        sync_each = self.spec.ddp.sync_each_micro_batch
        for index, micro_batch in enumerate(plan.micro_batches):
            if index != last and self.accumulation.skippable(plan, index):
                continue
            host_micro_batch = micro_batch
            with self.timer.phase("h2d"):
                micro_batch = self._to_device(micro_batch)
            sync = (index == last or sync_each) and not self._manual_grad_sync
            try:
                # Around backward too (FSDP2 reduces in backward); FLOPs are counted once per batch shape.
                with self.backend.sync_context(self.model, sync), self.timer.count_flops(host_micro_batch):
                    with self._forward_context(), self.timer.phase("forward"):
                        share = self.accumulation.micro_batch_loss(self.model, micro_batch, plan, index)
                    with self.timer.phase("backward"):
                        self._backward(share * scale if scale != 1.0 else share)
                self.timer.add_flops(host_micro_batch)
            except RuntimeError as exc:
                explained = explain_ddp_error(exc) if self.world_size > 1 else exc
                if explained is not exc:
                    raise explained from exc
                raise
            total += share.detach().float()
        return total

    def _to_device(self, micro_batch: Any) -> Any:
        return self.backend.prepare_inputs(move_to_device(micro_batch, self.device))

    def _global_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """Sum the ranks' loss shares. The same all-reduce carries "I want to stop" (a signal or a callback), so all
        ranks leave the loop at the same step. Outside the OOM-retry region: every rank reaches it once per step."""
        if self.world_size == 1:
            return loss
        wants_stop = float(bool(self.should_stop or self._interrupt))
        summed = torch.stack([loss, torch.tensor(wants_stop, device=loss.device)])
        with self.timer.phase("comm"):
            torch.distributed.all_reduce(summed)
        self._stop_agreed = bool(summed[1] > 0)
        return summed[0]

    def _apply_update(self, plan: AccumulationPlan, loss: torch.Tensor) -> tuple[float, float | None, bool]:
        """Unscale, correct, clip, check for NaN/Inf, step. The only place the optimizer steps."""
        loss = self._global_loss(loss)
        if self.deepspeed is not None:
            return self._deepspeed_update(plan, loss)
        self.precision.unscale_gradients(self.optimizer)
        factor = self.accumulation.correction(plan)
        if factor != 1.0:
            scale_gradients(self.optimization.trainable, factor)
            loss = loss * factor
        norm = self.optimization.clip()
        values = (torch.stack([loss, norm.float()]) if norm is not None else loss.reshape(1)).tolist()  # one sync
        loss_value, norm_value = values[0], (values[1] if norm is not None else None)
        scaler_owns_grads = self.precision.scaler is not None  # fp16: inf grads are the GradScaler's business
        finite = math.isfinite(loss_value) and (scaler_owns_grads or norm_value is None or math.isfinite(norm_value))
        if not finite:
            handle_nonfinite(self.state, self.spec.loss, loss_value, norm_value, self.optimization.nonfinite_groups())
            self.precision.skip_step()
            self.optimizer.zero_grad(set_to_none=True)
            return loss_value, norm_value, False
        self.state.consecutive_skips = 0
        stepped = self.precision.optimizer_step(self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return loss_value, norm_value, stepped

    def _deepspeed_update(self, plan: AccumulationPlan, loss: torch.Tensor) -> tuple[float, float | None, bool]:
        """The engine reduces, clips and steps; vlmfast checks the loss first (a NaN stops before the update)."""
        if self.accumulation.correction(plan) != 1.0:
            raise SpecError("with deepspeed.enabled, loss weights must be known before backward (the engine reduces "
                            "gradients as they come): let loss_fn return the mean loss and set loss.label_key, or "
                            "loss.weighting: samples")
        loss_value = float(loss)
        finite = math.isfinite(loss_value)
        if not finite:  # raises unless fp16, whose loss scaler skips the overflowing step inside the engine
            handle_nonfinite(self.state, self.spec.loss, loss_value, None, self.optimization.nonfinite_groups())
        norm, applied = self.deepspeed.step()
        if finite:
            self.state.consecutive_skips = 0
        return loss_value, (float(norm) if norm is not None else None), applied and finite

    def _should_stop(self, guard: InterruptGuard) -> bool:
        self._interrupt = guard.requested
        if self.world_size > 1:  # only what all ranks agreed on at the last step: a local flag would desync them
            return self._stop_agreed
        return bool(self.should_stop or guard.requested)

    def _forward_context(self) -> AbstractContextManager[Any]:
        if len(self._context_strategies) == 1:
            return self._context_strategies[0].forward_context()
        stack = ExitStack()
        for strategy in self._context_strategies:
            stack.enter_context(strategy.forward_context())
        return stack

    # ---- batch-size search and evaluation ------------------------------------------------------------------
    def find_micro_batch_size(self, safety_margin: float = 0.9) -> BatchSizeSearch:
        """Largest micro-batch (up to batch_size) whose forward+backward+step fits; all state restored afterwards."""
        return search_trainer_micro_batch_size(self, safety_margin)

    def evaluate(self, data: Dataset | DataLoader | None = None) -> float:
        """Loss-token-weighted mean loss over `data` (default: eval_data), in eval mode."""
        data = data if data is not None else self.eval_data
        if data is None:
            raise ValueError("evaluate() needs eval_data (pass it to OptimizedTrainer or to evaluate)")
        loader = data if isinstance(data, DataLoader) else DataLoader(
            data, batch_size=self.spec.batch_size, shuffle=False, collate_fn=self.collate_fn)
        return evaluate_loss(self.model, loader, self.accumulation, to_device=self._to_device,
                             forward_context=self._forward_context, max_batches=self.spec.eval.max_batches)

    def _record_eval(self, result: FitResult) -> float:
        eval_loss = self.evaluate()
        metrics = {"step": self.state.step, "eval_loss": eval_loss}
        result.eval_history.append(metrics)
        self._fire("on_eval", metrics)
        return eval_loss

    def _periodic_eval_and_save(self, result: FitResult) -> None:
        every_eval = self.spec.eval.every_steps
        if self.eval_data is not None and every_eval and self.state.step % every_eval == 0:
            result.eval_loss = self._record_eval(result)
        every_save = self.spec.save.every_steps
        if every_save and self.state.step % every_save == 0 and self.state.step < self.spec.max_steps:
            result.checkpoint = save_if_configured(self)

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: model, strategies, data position, counters, RNG, spec."""
        return {
            **self.backend.weights_state_dict(self.model, self.optimizer),
            "strategies": {s.name: s.state_dict() for s in self.strategies},
            "loader": self.loader.state_dict(),
            "trainer": asdict(self.state),
            "rng": rng_state(),
            "spec": self.spec.to_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (refuses a checkpoint of a different run: see checkpoint.REFUSED_ON_RESUME)."""
        check_resume_compatible(state["spec"], self.spec.to_dict())
        if "model" in state:  # absent when the backend keeps sharded checkpoints (DeepSpeed)
            self.backend.load_weights_state_dict(self.model, self.optimizer, state)
        for strategy in self.strategies:
            strategy.load_state_dict(state["strategies"].get(strategy.name, {}))
        self.loader.load_state_dict(state["loader"])
        saved = dict(state["trainer"])
        if self.oom is not None:  # the fallback's size (restored above) carries on; otherwise the spec's
            self.accumulation.micro_batch_size = self.oom.micro_batch_size
        saved["micro_batch_size"] = self.accumulation.micro_batch_size  # the split may change, the gradient not
        saved["accumulation_steps"] = -(-self.spec.batch_size // self.accumulation.micro_batch_size)
        self.state = TrainState(**saved)
        set_rng_state(state["rng"])

    def save(self, directory: str | Path | None = None) -> Path:
        """Write a checkpoint now (atomic; all ranks call it, rank 0 writes) and return its path."""
        return save_trainer(self, directory)

    # ---- reporting ------------------------------------------------------------------------------------------
    def _throughput(self, metrics: dict[str, Any], step_time: float, data_time: float) -> dict[str, Any]:
        out = {"step_time": step_time, "data_time": data_time,
               "samples_per_s": metrics["samples"] * self.world_size / step_time,
               "tokens_per_s": metrics["tokens"] * self.world_size / step_time}
        if self.state.step % self.spec.log.memory_every_steps == 0 or self.state.step == 1:
            out.update(memory_stats(self.device))
        return out

    def _build_report(self, history: list[dict[str, Any]], wall_time: float) -> RunReport:
        return RunReport.from_history(
            history, wall_time, world_size=self.world_size, peak_memory_gb=peak_memory_gb(self.device),
            device=self.device.type, skipped_steps=self.state.skipped_steps,
            strategies=[s.describe() for s in self.strategies  # a backend that owns precision describes it
                        if not (s is self.precision and self.backend.owns_precision)]
            + self.backend.describe() + self._describe_data(),
        )

    def _describe_data(self) -> list[str]:
        """Report lines for the data-side switches, which are not strategies (they act in the loader)."""
        packing, grouping = self.spec.packing, self.spec.data.group_by_length
        lines = [f"packing: rows of {packing.max_tokens} tokens ({packing.algorithm})"] if packing.enabled else []
        return lines + ([f"data: grouped by {grouping.replace('_', ' ')}"] if grouping != "none" else [])

    def _write_report(self, report: RunReport) -> None:
        if self.spec.log.dir is not None:
            report.write_json(Path(self.spec.log.dir) / "report.json")

    def _fire(self, event: str, *args: Any) -> None:
        for callback in self.callbacks:
            hook = getattr(callback, event, None)
            if hook is not None:
                hook(self, *args)


def _bound(history: list[dict[str, Any]], keep: int) -> None:
    """Drop the oldest metrics beyond `keep` (in chunks: amortised O(1) per step)."""
    if len(history) > keep + max(keep // 4, 1):
        del history[: len(history) - keep]


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)


