"""OptimizedTrainer: the loop. Split the optimizer batch into micro-batches, forward/backward, one optimizer step.

Usage::

    result = OptimizedTrainer(model, dataset, TrainSpec(batch_size=16, micro_batch_size=4), collate_fn=collate).fit()
    result.history[-1]["loss"], trainer.state.step

The loop owns the order of events (docs/architecture.md); the engine owns backward, gradient sync, precision and
the optimizer step; each strategy acts at the protocol's named points. The loader yields the whole per-rank
optimizer batch, so the effective batch never depends on the micro-batch size (Composer's design).
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader, Dataset

from vlmfast.checkpoints.async_save import AsyncCheckpointer
from vlmfast.checkpoints.save_dir import SaveDirLock, prepare_save_dir
from vlmfast.checkpoints.store import check_global_batch, check_resume_compatible, latest_checkpoint, save_checkpoint
from vlmfast.common.utils import derived_seed, resolve_device, rng_state, seed_everything, set_rng_state
from vlmfast.data.batch import batch_size_of, count_input_tokens, move_to_device
from vlmfast.data.fingerprint import describe_changes, fingerprint_changes, map_position
from vlmfast.data.loader import ResumableLoader
from vlmfast.data.packing import build_packing_collator, packed_batch_counts
from vlmfast.data.packing_check import check_packing, choose_packing_level, probe_samples
from vlmfast.data.prefetch import device_batches, host_batch
from vlmfast.data.rank_balance import CostModel
from vlmfast.data.sample_checks import SampleCheck
from vlmfast.data.timeout import DataLoaderTimeoutError
from vlmfast.engines import build_engine
from vlmfast.engines.collectives import barrier, broadcast_object, gather_objects, sum_step_totals
from vlmfast.engines.ddp import ddp_errors_explained
from vlmfast.engines.portable_state import describe_transfer, state_transfer_refusal, transfer_accepts
from vlmfast.engines.process_group import apply_nccl_presets, explain_rank_failure, init_distributed
from vlmfast.memory.advice import explain_oom, memory_summary, oom_advice
from vlmfast.memory.monitor import MemoryMonitor
from vlmfast.memory.stats import memory_stats, peak_memory_gb, reset_peak_memory
from vlmfast.profiling import RunProfiler
from vlmfast.profiling.phase_timer import Parts, find_submodules
from vlmfast.reporting.report import MetricsLogger, RunReport
from vlmfast.spec import SpecError, TrainSpec, check_environment
from vlmfast.strategies.accumulation import AccumulationPlan, GradientAccumulation, LossFn
from vlmfast.strategies.base import Step, Strategy, overrides
from vlmfast.strategies.optimizer import Optimization
from vlmfast.strategies.registry import BuildContext, build_micro_batching, build_strategies
from vlmfast.train.batch_size import BatchSizeSearch, search_micro_batch_size
from vlmfast.train.callbacks import Callback
from vlmfast.train.evaluation import evaluate_loss
from vlmfast.train.interrupt import InterruptGuard
from vlmfast.train.save_resume import needs_final_save, resume_run, run_checkpoint_bytes, save_run
from vlmfast.train.state import FitResult, TrainState
from vlmfast.train.step_estimate import estimate_step_seconds
from vlmfast.train.straggler import ComputeClock, straggler_seconds

log = logging.getLogger(__name__)

__all__ = ["FitResult", "OptimizedTrainer", "TrainState"]


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
        self.spec = spec = TrainSpec.coerce(spec)
        check_environment(spec)  # fail before any work
        apply_nccl_presets(spec.ddp.nccl_presets)  # NCCL reads its environment when the group starts
        env = init_distributed(spec.ddp.timeout_minutes)  # before the device: binds this rank to its GPU
        self.rank, self.world_size = env.rank, env.world_size
        self.device = resolve_device(spec.device)
        seed_everything(spec.seed + self.rank)  # DDP syncs weights from rank 0; dropout should differ
        self.callbacks = list(callbacks)
        self.collate_fn, self.eval_data = collate_fn, eval_data
        self.train_data = train_data  # as given (the doctor probes a few samples of it)
        self.should_stop = False  # a callback may set it; the run ends after the current step
        self._interrupt: str | None = None  # a signal received here (set by fit)
        self._stop_agreed = False  # under several ranks: some rank wants to stop (agreed in the step's all-reduce)
        self.state = TrainState()
        self.resharded: dict[str, Any] | None = None  # a resume on another rank count or engine: what changed
        self._say: Callable[[str], None] = _to_stderr  # fit() routes it through its progress bar
        self._packing_measured = False  # packing.level auto measured id-level packing exact on these samples
        self._packing_auto: str | None = None  # packing.level auto: why ids were refused ("" when they were not)

        if spec.packing.enabled and spec.packing.level == "auto":
            self.spec = spec = self._resolve_packing_level(spec, model, loss_fn)
        self.engine = build_engine(spec, self.device, self.world_size)
        self.task: str | None = None  # the `--task` that built the model (the CLI sets it): a plain export records it
        if spec.save.export.dir is not None:
            self._check_export_dir(model)  # now, not after the whole run
        self.accumulation = GradientAccumulation(
            weighting=spec.loss.weighting, label_key=spec.loss.label_key, ignore_index=spec.loss.ignore_index,
            shift_labels=spec.loss.shift_labels, loss_fn=loss_fn)
        self.optimization = Optimization(spec.optimizer, spec.scheduler, spec.max_steps, self.device)
        self.memory_monitor = self._build_memory_monitor()
        dump = self.memory_monitor.dump_snapshot if self.memory_monitor and spec.memory.record_history else None
        self.micro_batching = build_micro_batching(spec, model, describe_memory=self._describe_memory, on_oom=dump)
        self.strategies: list[Strategy] = [
            self.engine.precision, self.accumulation, self.optimization,
            *build_strategies(spec, BuildContext(self.device, self.world_size, probe_batches=self._probe_batches,
                                                 probe_batch=self._probe_batch)),
            self.micro_batching]
        model = model.to(self.device)
        for strategy in self.strategies:
            model = strategy.apply(model)
        sample_check = self._sample_check(model)  # before the engine wraps or shards it: a plain, local probe
        parts = self._model_parts(model)  # likewise: a probe forward after FSDP2 / ZeRO-3 shard it would all-gather
        self.model = self.engine.setup(model, self.optimization.build)  # last: strategies change the plain model
        self._contexts = [s for s in self.strategies if overrides(s, "forward_context")]
        measure = self.world_size > 1 and (spec.log.straggler or spec.data.rank_balance != "off")
        self.compute_clock = ComputeClock(self.engine.module, self.device) if measure else None
        self.state.micro_batch_size = self.micro_batching.micro_batch_size
        self.timer = RunProfiler(spec.profile, self.model, self.device, precision=spec.precision, tf32=spec.tf32,
                                 log_dir=spec.log.dir, is_main_process=self.is_main_process,
                                 keep_steps=spec.log.history_steps, parts=parts)
        if spec.packing.packs_ids:
            if not isinstance(self.accumulation.shift_labels, bool):  # "auto": measured now (a document's first
                probe = self._first_sample_batch()  # label is dropped only for a model that shifts labels)
                self.accumulation.resolve_conventions([probe] if probe is not None else [])
            self.collate_fn = build_packing_collator(
                spec.packing, self.engine.module, collate_fn, shift_labels=self.accumulation.shift_labels is not False,
                ignore_index=spec.loss.ignore_index)
            # Measured, not assumed: packed documents must give the padded batch's outputs (refused here if not)
            if not self._packing_measured:  # packing.level auto measured it already
                check_packing(self.engine.module, probe_samples(train_data), self.collate_fn, loss_fn=loss_fn,
                              device=self.device)
        # save.async: the step only waits for a host copy; the write runs in a thread (checkpoint_async.py)
        self.checkpointer = AsyncCheckpointer() if spec.save.async_ else None
        if self.checkpointer is not None:
            self.callbacks.insert(0, self.checkpointer)  # polls for a failed save each step; waits at the end
        pin = spec.data.pin_memory if spec.data.pin_memory is not None else self.device.type == "cuda"
        self.loader = device_batches(  # data.device_prefetch: the next batch is copied while this step runs
            ResumableLoader(train_data, spec.batch_size, spec.data, spec.seed, self.collate_fn,
                            pin_memory=pin, rank=self.rank, world_size=self.world_size,
                            # samples collated per micro-batch in the workers (not for packed rows); a token
                            # budget's batch collated whole to plan on, its micro-batches then from their samples
                            micro_batch_size=None if spec.packing.packs_ids
                            else spec.batch_size if spec.micro_batch_tokens else spec.resolved_micro_batch_size,
                            sample_check=sample_check, cost_model=self._cost_model(model),
                            step_seconds=self._estimate_step_seconds if spec.data.num_workers == "auto" else None),
            spec.data, self.device)

    def _cost_model(self, model: nn.Module) -> CostModel | None:
        """data.rank_balance: cost: the spec's coefficients, else the model's FLOP counts (the same on every run)."""
        data = self.spec.data
        if data.rank_balance != "cost":
            return None
        if data.rank_balance_cost is not None:
            return CostModel(**data.rank_balance_cost.model_dump())
        return CostModel.from_model(model)

    def _balance_metrics(self) -> dict[str, float]:
        """The imbalance (max / mean - 1 of the per-rank estimated cost) of the batch just trained, dealt and as the
        positional deal would have been (data.rank_balance)."""
        sampler = getattr(getattr(self.loader, "source", self.loader), "sampler", None)
        deals = getattr(sampler, "deals", None)
        if not deals:
            return {}
        position = self.loader.state_dict()
        dealt = deals.pop((position["epoch"], position["batch_in_epoch"] - 1), None)  # read once: bounded
        return {} if dealt is None else {"balance/imbalance": dealt[0], "balance/imbalance_positional": dealt[1]}

    def _probe_batches(self, count: int = 16) -> Iterator[Any]:
        """The first training samples, each collated alone by the user's collate_fn, on the device (for strategies
        that learn from a forward: modality sync)."""
        collate = self.collate_fn or torch.utils.data.default_collate
        for sample in probe_samples(self.train_data, count=count):
            yield move_to_device(collate([sample]), self.device)

    def _resolve_packing_level(self, spec: TrainSpec, model: nn.Module, loss_fn: LossFn | None) -> TrainSpec:
        """``packing.level: auto`` made ids or embeddings, measured on the first samples (before any strategy)."""
        model.to(self.device)  # measured where it trains (the strategies' own moves come later)
        samples = probe_samples(self.train_data)
        level, why = choose_packing_level(model, spec.packing, samples, self.collate_fn, loss_fn=loss_fn)
        self._packing_measured = level == "ids" and bool(samples)
        self._packing_auto = why
        if why:
            log.info("packing.level auto: embeddings (id-level packing refused: %s)", why)
        fields = spec.model_dump()
        fields["packing"]["level"] = level
        return TrainSpec.model_validate(fields)

    def _probe_batch(self, count: int = 4) -> Any:
        """The first ``count`` training samples collated together (padded) by the user's collate_fn, on the device;
        None when no sample can be spared (a DataLoader, a one-shot stream)."""
        samples = probe_samples(self.train_data, count=count)
        if not samples:
            return None
        return move_to_device((self.collate_fn or torch.utils.data.default_collate)(samples), self.device)

    def _sample_check(self, model: nn.Module) -> SampleCheck | None:
        """data.check_samples' checks with the vocabulary the ids meet: read off the model, else learned from the
        first embedding the first sample's ids reach (a model without get_input_embeddings or a config)."""
        if self.spec.data.check_samples == "off":
            return None
        data = self.train_data
        spare = hasattr(data, "__getitem__") and hasattr(data, "__len__")  # never take samples from a stream
        return SampleCheck.for_model(getattr(model, "_orig_mod", model),  # compiled: probe the eager module
                                     self.spec.loss.label_key, self.spec.loss.ignore_index,
                                     probe_batch=self._first_sample_batch if spare else None)

    def _model_parts(self, model: nn.Module) -> Parts:
        """The vision tower / projector / language model for the profile's time split and FLOPs by tower, learned on
        the plain model (find_submodules: the stand-in get_image_features call, else a probe forward of the first
        samples, never taken from a stream); {} when the profile measures nothing."""
        if not (self.spec.profile.timing or self.spec.profile.mfu):
            return {}
        data = self.train_data

        def probe_batches() -> Iterator[Any]:  # read only when the stand-in call cannot decide
            if hasattr(data, "__getitem__") and hasattr(data, "__len__"):
                try:
                    yield from self._probe_batches(count=4)
                except Exception:  # a bad sample is the loader's to skip and count, not the probe's to fail on
                    return

        return find_submodules(getattr(model, "_orig_mod", model), batches=probe_batches())  # compiled: eager parts

    def _estimate_step_seconds(self) -> float | None:
        """One step's time, from forward passes of the first samples (data.num_workers auto sizes the loader by it,
        before any worker starts); None when the samples cannot be spared or run (the loader's rate alone decides)."""
        size = self.spec.resolved_micro_batch_size
        if self.engine.shards_parameters:  # its forward all-gathers: a rank whose probe failed would strand the rest
            return None
        try:
            samples = probe_samples(self.train_data, count=size)
            if not samples:
                return None
            batch = self.engine.prepare_inputs(
                move_to_device((self.collate_fn or torch.utils.data.default_collate)(samples), self.device))
            # the plain module: DDP's wrapper would broadcast buffers, a collective no other rank may be in
            return estimate_step_seconds(self.engine.module, batch, self.device, self.forward_context,
                                         micro_batches=-(-self.spec.batch_size // size))
        except Exception as exc:  # a bad first sample is the loader's to skip and count, not the estimate's
            log.info("num_workers auto: no step-time estimate (%s: %s); the loader's rate alone decides",
                     type(exc).__name__, exc)
            return None

    def _first_sample_batch(self) -> Any:
        """The first sample collated alone, on the device; None when it cannot be read or collated (a bad sample is
        the loader's to skip and count, not the probe's to fail on)."""
        try:
            return next(self._probe_batches(count=1), None)
        except Exception:
            return None

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
        return self.engine.optimizer

    @property
    def scheduler(self) -> torch.optim.lr_scheduler.LRScheduler:
        return self.optimization.scheduler

    @property
    def is_main_process(self) -> bool:
        return self.rank == 0

    # ---- the loop -------------------------------------------------------------------------------------------
    def fit(self) -> FitResult:
        """Train until `max_steps` (resuming first when `save.resume` finds a checkpoint)."""
        save_dir_lock = self._prepare_save_dir()  # one writer per save.dir, room for a checkpoint: before any step
        try:
            return self._fit()
        finally:
            getattr(self.loader, "close", lambda: None)()  # the prefetch thread and loader workers, even on error
            if save_dir_lock is not None:
                save_dir_lock.release()

    def _prepare_save_dir(self) -> SaveDirLock | None:
        if not self.is_main_process:
            return None
        spec = self.spec
        return prepare_save_dir(spec.save.dir, lambda: run_checkpoint_bytes(
            spec.save.dir, self.engine.module, spec.optimizer.name, spec.optimizer.momentum,
            master_weights=self.engine.writes_shards and spec.precision != "fp32",
            trainable_only=self._trainable_only()))

    def _fit(self) -> FitResult:
        resumed_from = resume_run(self.engine, self.load_state_dict, self.spec.save.resume, self.spec.save.dir,
                                  check=self.check_resumable)
        if resumed_from is not None and self.state.step >= self.spec.max_steps:
            return self._nothing_to_do(resumed_from)
        if self.spec.save.dir is not None:  # now, before any step: a checkpoint written when data is stuck needs it
            self._data_fingerprint()
        # Workers start here, on this thread, before any step, and read only the batches the run still needs.
        getattr(self.loader, "start", lambda batches: None)(max(self.spec.max_steps - self.state.step, 0))
        self.model.train()
        reset_peak_memory(self.device)
        history: list[dict[str, Any]] = []
        result = FitResult(history=history, report=None, resumed_from=resumed_from)  # type: ignore[arg-type]
        metrics_logger = MetricsLogger(self.spec.log, self.spec.max_steps, self.state.step, self.is_main_process,
                                       config=self.spec.to_dict())  # W&B / MLflow record the spec as the run's config
        self._say = metrics_logger.write  # through the progress bar while it runs
        self._fire("on_fit_start")
        start, first_step, first_loss = time.perf_counter(), self.state.step, None
        rank_failure = explain_rank_failure(self.world_size, self.spec.ddp.timeout_minutes)  # no silent hang
        with metrics_logger, InterruptGuard(self.spec.save.on_interrupt) as guard, rank_failure:
            if resumed_from is not None:
                metrics_logger.write(f"resumed from {resumed_from} at step {self.state.step}")
            if self.resharded:
                metrics_logger.write(self.resharded["note"])
                metrics_logger.log_event("resumed", self.state.step, **self.resharded)
            tick = time.perf_counter()
            while self.state.step < self.spec.max_steps and not self._should_stop(guard):
                self.timer.begin_step(self.state.step + 1)
                waited = time.perf_counter()
                with self.timer.phase("data_wait"):
                    batch = self._next_batch()
                data_time = time.perf_counter() - waited  # blocked on the loader only, not the loop's bookkeeping
                metrics = self._train_batch(batch)
                metrics.update(self._balance_metrics())
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
                metrics_logger.write(f"{interrupted} received: " + ("saving a final checkpoint and stopping" if
                                     self.spec.save.dir else "stopping (no save.dir: no checkpoint is written)"))
            result.checkpoint = self._final_save() or result.checkpoint
            barrier()  # nobody leaves before rank 0's checkpoint is on disk and DDP work is done
            if self.eval_data is not None and not result.interrupted:
                result.eval_loss = self._record_eval(result)
            if not result.interrupted:  # save.export: a completed run only
                result.exported = self._export_at_end(metrics_logger)
            result.report = self._build_report(history, time.perf_counter() - start)
            if result.checkpoint is not None:
                result.report.extra["checkpoint"] = str(result.checkpoint)
            if result.exported is not None:
                result.report.extra["exported"] = str(result.exported)
            if self.resharded:
                result.report.extra["resumed"] = self.resharded["note"]
            # history may hold only the latest steps (log.history_steps): the run's first loss and step count
            result.report.steps, result.report.first_loss = self.state.step - first_step, first_loss
            result.report.extra.update(self.timer.finish(history))
            result.report.extra.update(_balance_summary(history))
            if bad := getattr(self.loader, "sample_counts", dict)().get("bad"):
                result.report.extra["bad samples skipped"] = bad
            if self.is_main_process:
                metrics_logger.compare(result.report, eval_loss=result.eval_loss)  # spec; vs the previous run
                metrics_logger.write(result.report.to_text())
                self._write_report(metrics_logger.whole_run(result.report))  # report.json: all sessions
        self._say = _to_stderr
        self._fire("on_fit_end", result)
        return result

    def _nothing_to_do(self, checkpoint: Path) -> FitResult:
        """A resume whose checkpoint is already at max_steps: one line, and no step, report, evaluation or export
        (no callback runs either). Returns an empty history, no report, the checkpoint it found."""
        if self.is_main_process:
            _to_stderr(f"nothing to do: {checkpoint} is at step {self.state.step} and max_steps is "
                       f"{self.spec.max_steps} (raise max_steps to train further)")
        return FitResult(history=[], resumed_from=checkpoint, checkpoint=checkpoint)

    def _next_batch(self) -> Any:
        """The next batch; when it does not come within data.timeout_s, the final checkpoint, then the error."""
        try:
            return next(self.loader)
        except DataLoaderTimeoutError as exc:
            exc.checkpoint = self._save_when_data_is_stuck(exc)
            raise

    def _save_when_data_is_stuck(self, exc: DataLoaderTimeoutError) -> Path | None:
        """The interrupt's final save (the stuck batch is not counted: a resume loads it again). Not under several
        ranks: the others wait inside the step's collectives, so a save's collectives would not match theirs."""
        path: Path | None = None
        if self.world_size > 1:
            note = "no final checkpoint: the other ranks wait in a collective (they stop at ddp.timeout_minutes)"
        elif self.spec.save.dir is None:
            note = "no checkpoint written: save.dir is not set"
        else:
            try:
                path = self._final_save() or latest_checkpoint(self.spec.save.dir)
            except Exception as save_error:  # the data error stays the one raised; the save's is named
                note = f"the final checkpoint could not be written: {type(save_error).__name__}: {save_error}"
            else:
                note = f"the checkpoint of step {self.state.step} is {path}" if path else "no step was run"
        log.error("%s; %s", exc, note)
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(note)
        return path

    def train_step(self, batch: Any, micro_batch_size: int, host: Any = None) -> tuple[torch.Tensor, AccumulationPlan]:
        """Forward and backward of one per-rank batch in micro-batches of `micro_batch_size` samples; the gradients
        sum to the full-batch gradient (each micro-batch weighted by its share of the loss items). Returns this
        rank's share of the loss (a device tensor) and the plan. The OOM fallback wraps this call. `host`: the host
        batch a prefetched `batch` was copied from (loss tokens are counted there: no device read)."""
        plan = self.accumulation.plan(batch, micro_batch_size, host=host)
        loss = torch.zeros((), device=self.device)
        for index, host_micro_batch in enumerate(plan.micro_batches):
            with self.timer.phase("h2d"):
                micro_batch = self.engine.prepare_inputs(move_to_device(host_micro_batch, self.device))
            # Around backward too (DDP / FSDP2 reduce in backward); FLOPs are counted once per batch shape.
            with ddp_errors_explained(self.world_size), self.engine.sync_context(self.model, index == plan.last), \
                    self.timer.count_flops(host_micro_batch):
                with self.forward_context(), self.timer.phase("forward"):
                    share = self.accumulation.micro_batch_loss(self.model, micro_batch, plan, index)
                with self.timer.phase("backward"):
                    self.engine.backward(share)
            self.timer.add_flops(host_micro_batch)
            loss += share.detach().float()
        return loss, plan

    def optimizer_step(self, loss: torch.Tensor, plan: AccumulationPlan, counts: tuple[int, int] = (0, 0)) -> Step:
        """Every strategy's step points around the engine's update; the step's one host read is `step.read()`.
        `counts`: this rank's (samples, tokens), summed over ranks in the loss's all-reduce ("global_samples",
        "global_tokens" in `step.values` after the read)."""
        self.engine.finish_gradients()
        with self.timer.phase("comm"):
            loss, stop, totals = sum_step_totals(loss, bool(self.should_stop or self._interrupt), counts)
        step = Step(self.state.step + 1, self.engine, loss, plan)
        if stop is not False:
            step.defer("stop", stop)
        for name, total in zip(("global_samples", "global_tokens"), totals, strict=True):
            if torch.is_tensor(total):
                step.defer(name, total)
            else:
                step.values[name] = float(total)
        for strategy in self.strategies:
            strategy.after_backward(step)
        step.read()
        self._stop_agreed = bool(step.values.get("stop", 0.0))
        if all([strategy.before_step(step) for strategy in self.strategies]):  # a list: every strategy sees it
            with explain_oom("optimizer step", self.spec, self.device, self.optimization.trainable_params, step.number):
                result = self.engine.step()  # the first AdamW step allocates its states: an OOM is explained
            step.applied = result.applied
            if result.grad_norm is not None:
                step.values["grad_norm"] = float(result.grad_norm)
        else:
            self.engine.skip_step()
        for strategy in self.strategies:
            strategy.after_step(step)
        return step

    def _train_batch(self, batch: Any) -> dict[str, Any]:
        """One optimizer step on one per-rank batch; returns the step's metrics."""
        host = host_batch(self.loader, batch)  # device prefetch: tokens are counted on the host copy, not the GPU's
        if self.compute_clock is not None:
            self.compute_clock.start()
        loss, plan = self.micro_batching.run(lambda size: self.train_step(batch, size, host=host),
                                             cleanup=self.engine.discard_gradients)
        ranks = {}
        if self.compute_clock is not None:  # before the optimizer step: compute up to the last gradient
            compute = self.compute_clock.seconds()
            ranks = {"balance/compute_s": compute, "balance/straggler_s": straggler_seconds(compute, self.device)}
        samples, tokens = packed_batch_counts(host) if self.spec.packing.packs_ids else (
            batch_size_of(batch), count_input_tokens(host))  # packed rows hold several samples
        with self.timer.phase("optimizer"):
            step = self.optimizer_step(loss, plan, (samples, tokens))
        self.state.step = step.number
        self.state.skipped_steps += not step.applied
        self.state.micro_batch_size = self.micro_batching.micro_batch_size
        self.state.accumulation_steps = len(plan.micro_batches)
        # every rank's, summed in the loss's all-reduce: ranks hold different shares (rank balance, packing)
        global_samples, global_tokens = round(step.values["global_samples"]), round(step.values["global_tokens"])
        self.state.samples_seen += global_samples
        self.state.tokens_seen += global_tokens
        return {"step": step.number, "loss": step.values["loss"], **step.metrics,
                "micro_batch_size": self.state.micro_batch_size, "accumulation_steps": self.state.accumulation_steps,
                "samples": samples, "tokens": tokens, "global_samples": global_samples,
                "global_tokens": global_tokens, "skipped": not step.applied, **ranks,
                **({"grad_norm": step.values["grad_norm"]} if "grad_norm" in step.values else {})}

    def _describe_memory(self) -> str:
        advice = "\n".join(f"  - {line}" for line in oom_advice(self.spec))
        return f"memory: {memory_summary(self.device)}\ntry, cheapest first:\n{advice}"

    def _should_stop(self, guard: InterruptGuard) -> bool:
        self._interrupt = guard.requested
        if self.world_size > 1:  # only what all ranks agreed on at the last step: a local flag would desync them
            return self._stop_agreed
        return bool(self.should_stop or guard.requested)

    def forward_context(self) -> AbstractContextManager[Any]:
        """Every strategy's forward context (precision's autocast first), entered around each micro-batch."""
        if len(self._contexts) == 1:
            return self._contexts[0].forward_context()
        stack = ExitStack()
        for strategy in self._contexts:
            stack.enter_context(strategy.forward_context())
        return stack

    # ---- batch-size search and evaluation ------------------------------------------------------------------
    def find_micro_batch_size(self, safety_margin: float = 0.9) -> BatchSizeSearch:
        """Largest micro-batch (up to batch_size) whose forward+backward+step fits; all state restored afterwards."""
        return search_micro_batch_size(
            self.train_step, engine=self.engine, model=self.model, loader=self.loader,
            max_size=self.spec.batch_size, device=self.device, safety_margin=safety_margin)

    def evaluate(self, data: Dataset | DataLoader | None = None) -> float:
        """Loss-token-weighted mean loss over `data` (default: eval_data), in eval mode."""
        data = data if data is not None else self.eval_data
        if data is None:
            raise ValueError("evaluate() needs eval_data (pass it to OptimizedTrainer or to evaluate)")
        loader = data if isinstance(data, DataLoader) else DataLoader(
            data, batch_size=self.spec.batch_size, shuffle=False, collate_fn=self.collate_fn)
        with explain_oom("evaluation", self.spec, self.device, self.optimization.trainable_params):
            return self._evaluate(loader)

    def _evaluate(self, loader: Any) -> float:
        return evaluate_loss(self.model, loader, self.accumulation, forward_context=self.forward_context,
                             to_device=lambda b: self.engine.prepare_inputs(move_to_device(b, self.device)),
                             max_batches=self.spec.eval.max_batches,
                             micro_batch_size=self.micro_batching.micro_batch_size)

    def _record_eval(self, result: FitResult) -> float:
        """The held-out loss, and one more per strategy that evaluates other weights (EMA: `eval_loss_ema`)."""
        metrics = {"step": self.state.step, "eval_loss": self.evaluate()}
        for strategy in self.strategies:
            for name, context in strategy.eval_contexts().items():
                with context:
                    metrics[f"eval_loss_{name}"] = self.evaluate()
        result.eval_history.append(metrics)
        self._fire("on_eval", metrics)
        return metrics["eval_loss"]

    def _periodic_eval_and_save(self, result: FitResult) -> None:
        every_eval = self.spec.eval.every_steps
        if self.eval_data is not None and every_eval and self.state.step % every_eval == 0:
            result.eval_loss = self._record_eval(result)
        every_save = self.spec.save.every_steps
        if every_save and self.state.step % every_save == 0 and self.state.step < self.spec.max_steps:
            result.checkpoint = self.save()

    # ---- checkpoints ----------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Everything needed to continue exactly: engine (model, optimizer), strategies, data position, counters,
        RNG, spec. Every rank calls it (an engine may gather with a collective)."""
        lora, trainable_only = self._lora(), self._trainable_only()
        return {
            "engine": self.engine.state_dict(trainable_only=trainable_only),
            **({"frozen": lora.fingerprint()} if trainable_only else {}),
            "strategies": {s.name: s.state_dict() for s in self.strategies},
            "loader": self.loader.state_dict(),
            "trainer": {**self.state.state_dict(), "world_size": self.world_size},
            "rng": gather_objects(rng_state()),  # every rank's generators: dropout differs per rank
            "spec": self.spec.to_dict(),
            "data": self._data_fingerprint(),  # compared on resume (vlmfast.data.fingerprint)
        }

    def _lora(self) -> Any:
        return next((s for s in self.strategies if s.name == "lora"), None)

    def _trainable_only(self) -> bool:
        """Whether a checkpoint holds the trainable state alone: a LoRA run (its frozen base is fingerprinted)."""
        return self._lora() is not None and self.engine.keeps_trainable_only

    def _data_fingerprint(self) -> dict[str, Any] | None:
        fingerprint = getattr(self.loader, "fingerprint", None)
        return fingerprint() if fingerprint is not None else None

    def check_resumable(self, state: dict[str, Any]) -> None:
        """Refuse a checkpoint written by a different run (spec), on another number of ranks or on other data (its
        fingerprint; save.accept_data_change accepts that), naming the change."""
        saved_world = state["trainer"].get("world_size", 1)
        if refusal := state_transfer_refusal(state["spec"], saved_world, self.spec, self.world_size):
            raise SpecError(f"cannot resume: {refusal}")
        check_global_batch(state["spec"].get("batch_size", self.spec.batch_size), saved_world, self.spec.batch_size,
                           self.world_size)
        # verified above: the same global batch on another rank count, an engine pair whose state carries over
        check_resume_compatible(state["spec"], self.spec.to_dict(), accepted=transfer_accepts(state["spec"], self.spec))
        lora = self._lora()
        if state.get("frozen") and lora is not None and state["frozen"] != lora.fingerprint():
            raise SpecError(
                f"cannot resume: the frozen base weights differ from the checkpoint's (fingerprint "
                f"{state['frozen'][:16]}... saved, {lora.fingerprint()[:16]}... now): a LoRA checkpoint holds the "
                "adapters only, on the base it was trained on. Load that base model, or start a new run "
                "(save.resume: never, or another save.dir)")
        saved, current = state.get("data"), self._data_fingerprint()
        changes = fingerprint_changes(saved, current) if saved and current else {}
        if changes and not self.spec.save.accept_data_change:
            position = state.get("loader", {})
            raise SpecError(
                f"cannot resume: the training data differs from the checkpoint's: {describe_changes(changes)}. The "
                f"saved data position (epoch {position.get('epoch')}, batch {position.get('batch_in_epoch')}) points "
                "into the old data, so the run would not continue as the uninterrupted one. Restore the data to "
                "continue exactly, set save.accept_data_change: true to go on with the new data (the position is "
                "mapped onto it), or start a new run (save.resume: never, or another save.dir)")

    def _data_position(self, state: dict[str, Any]) -> dict[str, Any]:
        """The checkpoint's data position, mapped onto the new data when a change was accepted; said in the log."""
        position, saved, current = state["loader"], state.get("data"), self._data_fingerprint()
        if not saved:
            log.info("the checkpoint has no data fingerprint (written by an older vlmfast): the training data is not "
                     "checked against it; the next checkpoint will have one")
            return position
        changes = fingerprint_changes(saved, current) if current else {}
        if not changes:
            return position
        batches = getattr(self.loader, "batches_per_epoch", lambda length: None)
        mapped = map_position(position, batches(saved.get("length")), batches(current.get("length")))  # type: ignore[union-attr]
        log.warning("resuming on changed training data (save.accept_data_change): %s; the data position epoch %d, "
                    "batch %d becomes epoch %d, batch %d of the new data", describe_changes(changes),
                    position["epoch"], position["batch_in_epoch"], mapped["epoch"], mapped["batch_in_epoch"])
        return mapped

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (refuses a checkpoint of a different run: see checkpoint.REFUSED_ON_RESUME)."""
        self.check_resumable(state)
        self.engine.load_state_dict(state["engine"] if "engine" in state else _engine_state_of_v01(state))
        for strategy in self.strategies:
            strategy.load_state_dict(state["strategies"].get(strategy.name, {}))
        self.loader.load_state_dict(self._data_position(state))
        self.state.load_state_dict(state["trainer"])
        self.state.micro_batch_size = self.micro_batching.micro_batch_size  # the sizer restored its own
        rng = state["rng"]
        if isinstance(rng, list) and len(rng) != self.world_size:  # another rank count: no rank's own generators
            seed_everything(derived_seed(self.spec.seed, self.state.step, self.rank))
        else:
            set_rng_state(rng[self.rank] if isinstance(rng, list) else rng)  # 0.1 saved rank 0's only
        self.resharded = describe_transfer(state["spec"], state["trainer"].get("world_size", 1), self.spec,
                                           self.world_size)  # another rank count or engine: said in _fit

    def export(self, directory: str | Path, merge: bool = False, processor: Any = None, overwrite: bool = False,
               what: str = "export folder") -> Path | None:
        """Write the trained model in a format the Hugging Face ecosystem loads
        (:func:`vlmfast.checkpoints.export.export_model`: a LoRA run's adapter folder, or with ``merge`` the merged
        model; a Hugging Face model's save_pretrained folder; else model.safetensors and vlmfast_export.json), with
        ``processor`` next to it, through a private folder that then takes `directory`'s place. A `directory` holding
        anything but a previous export of the same kind is refused unless ``overwrite``. Rank 0 writes; returns the
        folder there; errors name the folder as `what`.
        Usage: ``trainer.fit(); trainer.export("out", processor=processor)``"""
        from vlmfast.checkpoints.export import export_model

        if refusal := self._export_refusal():
            raise ValueError(f"export: {refusal}")
        path = export_model(self.engine.module, directory, merge=merge, processor=processor, overwrite=overwrite,
                            task=self.task, what=what) if self.is_main_process else None
        barrier()
        return path

    def _check_export_dir(self, model: nn.Module) -> None:
        """save.export.dir, when the trainer is built: an engine that can export, a folder it may write."""
        from vlmfast.checkpoints.export import check_export_target, export_kind

        if refusal := self._export_refusal():
            raise SpecError(f"save.export.dir: {refusal}")
        export = self.spec.save.export
        kind = export_kind(model, export.merge, lora=self.spec.lora.enabled or None)
        check_export_target(export.dir, kind, export.overwrite, what="save.export.dir")  # type: ignore[arg-type]

    def _export_refusal(self) -> str | None:
        """Why this trainer cannot export, or None."""
        if not self.engine.shards_parameters and self.engine.local_state_dict:
            return None
        return (f"the {type(self.engine).__name__} shards the weights (FSDP2, ZeRO-3), and gathering them for an "
                "export is not supported yet: save a checkpoint and export it from one process")

    def _export_at_end(self, metrics_logger: MetricsLogger) -> Path | None:
        """save.export: the trained model exported at the end of a completed fit(); the log says where."""
        from vlmfast.strategies.lora import is_peft_model

        export = self.spec.save.export
        if export.dir is None:
            return None
        path = self.export(export.dir, merge=export.merge, overwrite=export.overwrite, what="save.export.dir")
        if path is not None:
            lora = is_peft_model(self.engine.module)
            what = ("the merged model" if export.merge else "the LoRA adapters") if lora else "the model"
            metrics_logger.write(f"exported {what} to {path}")
        return path

    def save(self, directory: str | Path | None = None) -> Path:
        """Write a checkpoint now (atomic; all ranks call it, rank 0 writes) and return its path."""
        write = self.checkpointer.save if self.checkpointer is not None and self.is_main_process else save_checkpoint
        path = save_run(self.engine, self.state_dict, directory or self.spec.save.dir or "checkpoints",
                        self.state.step, self.spec.save.keep_last, meta={"samples_seen": self.state.samples_seen},
                        write=write, trainable_only=self._trainable_only())
        if self.is_main_process:
            pending = " (being written in the background: save.async)" if self.checkpointer is not None else ""
            self._say(f"checkpoint of step {self.state.step}: {path}{pending}")
            self._fire("on_save", path)
        return path

    def _final_save(self) -> Path | None:
        """The end-of-run checkpoint, unless the last periodic save already wrote this step (rank 0 decides)."""
        if self.spec.save.dir is None or self.state.step == 0:
            return None
        self._finish_saves()  # save.async: the save in flight may be this very step
        due = broadcast_object(needs_final_save(self.spec.save.dir, self.state.step))
        path = self.save() if due else None
        self._finish_saves()  # the run ends with its last checkpoint on disk
        return path

    def _finish_saves(self) -> None:
        if self.checkpointer is not None:
            self.checkpointer.wait()

    # ---- reporting ------------------------------------------------------------------------------------------
    def _throughput(self, metrics: dict[str, Any], step_time: float, data_time: float) -> dict[str, Any]:
        out = {"step_time": step_time, "data_time": data_time,
               "samples_per_s": metrics["global_samples"] / step_time,
               "tokens_per_s": metrics["global_tokens"] / step_time}
        if self.state.step % self.spec.log.memory_every_steps == 0 or self.state.step == 1:
            out.update(memory_stats(self.device))
        return out

    def _build_report(self, history: list[dict[str, Any]], wall_time: float) -> RunReport:
        return RunReport.from_history(
            history, wall_time, world_size=self.world_size, peak_memory_gb=peak_memory_gb(self.device),
            device=self.device.type, skipped_steps=self.state.skipped_steps,
            # strategies[0] is the engine's precision plugin: the engine's own lines describe it
            strategies=[*self.engine.describe(), *filter(None, (s.describe() for s in self.strategies[1:])),
                        *self._describe_data()],
        )

    def _describe_data(self) -> list[str]:
        """Report lines for the data-side switches, which are not strategies (they act in the loader)."""
        packing, grouping = self.spec.packing, self.spec.data.group_by_length
        lines = [f"packing: rows of {packing.max_tokens} tokens ({packing.algorithm})"] if packing.packs_ids else []
        if self._packing_auto is not None:  # packing.level auto: which level, and why
            lines.append(f"packing.level auto: {packing.level}" + (
                f" (id-level packing refused: {self._packing_auto[:200]})" if self._packing_auto
                else " (id-level packing measured exact)" if self._packing_measured else " (not verified)"))
        autotune = getattr(self.loader, "autotune", None)  # num_workers auto: the choice, the step rate, why
        lines += [f"data: num_workers auto {autotune.reason}"] if autotune is not None else []
        return lines + ([f"data: grouped by {grouping.replace('_', ' ')}"] if grouping != "none" else [])

    def _write_report(self, report: RunReport) -> None:
        if self.spec.log.dir is not None:
            report.write_json(Path(self.spec.log.dir) / "report.json")

    def _fire(self, event: str, *args: Any) -> None:
        for callback in self.callbacks:
            hook = getattr(callback, event, None)
            if hook is not None:
                hook(self, *args)


def _to_stderr(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def _bound(history: list[dict[str, Any]], keep: int) -> None:
    """Drop the oldest metrics beyond `keep` (in chunks: amortised O(1) per step)."""
    if len(history) > keep + max(keep // 4, 1):
        del history[: len(history) - keep]


def _engine_state_of_v01(state: dict[str, Any]) -> dict[str, Any]:
    """The engine's part of a checkpoint written by vlmfast 0.1 (model and optimizer at the top level)."""
    old = {key: state[key] for key in ("model", "optimizer") if key in state}
    old["optimizer"] = old.get("optimizer") or state["strategies"].get("optimizer", {}).get("optimizer")
    old["precision"] = state["strategies"].get("precision", {})
    return {key: value for key, value in old.items() if value is not None}


def _balance_summary(history: list[dict[str, Any]]) -> dict[str, str]:
    """Report lines of the per-rank figures (data.rank_balance, log.straggler): means over the logged steps."""
    out = {}
    for key, label, unit in (("balance/straggler_s", "straggler time per step (max - min rank compute)", "ms"),
                             ("balance/imbalance", "estimated rank imbalance (max / mean - 1), dealt", ""),
                             ("balance/imbalance_positional", "estimated rank imbalance, positional deal", "")):
        values = [h[key] for h in history if key in h]
        if values:
            mean = sum(values) / len(values)
            out[label] = f"{mean * 1000:.1f} ms" if unit == "ms" else f"{mean:.2f}"
    return out
