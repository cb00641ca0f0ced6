"""Where a training step's time goes: data wait, host-to-device copy, forward, backward, optimizer, communication.

Usage::

    timer = PhaseTimer(device, every_steps=10)
    timer.attach(model)                       # optional: vision / projector / language-model forward times
    for step in range(1, steps + 1):
        timer.begin_step(step)
        with timer.phase("data_wait"):
            batch = next(loader)
        with timer.phase("h2d"):
            batch = move_to_device(batch, device)
        with timer.phase("forward"):
            loss = model(**batch).loss
        with timer.phase("backward"):
            loss.backward()
        with timer.phase("optimizer"):
            optimizer.step()
            optimizer.zero_grad()
        metrics.update(timer.end_step())      # perf/* on sampled steps, {} on the others
    report.update(timer.summary())            # step time p50/p90/p99, phase shares, MFU

Only every `every_steps`-th step is sampled. On a sampled step each phase is timed by CUDA events on the current
stream (GPU) or the wall clock (CPU), and `end_step` waits for the step's last event: one host-device sync per
sampled step, none on the others, where `phase()` returns a shared no-op context. A phase may be entered several
times per step (once per micro-batch); its times add up. Top-level phases must not nest; whatever no phase covers is
reported as `perf/other_time`, so the phases and "other" sum to the step time.

On CUDA, sampled forward/backward phases also count the host-device synchronisations they cause (`.item()`,
`.cpu()`, `.tolist()`, data-dependent shapes) through torch's sync debug mode: `perf/host_syncs`.
Gradient all-reduce inside DDP's backward is measured by wrapping the communication hook: :func:`timed_comm_hook`
(`perf/comm_hook_time`: time from a bucket's hook call to its all-reduce finishing, overlapped with backward).
"""

from __future__ import annotations

import contextlib
import time
import warnings
from collections import defaultdict, deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import nn

__all__ = ["PHASES", "Parts", "PhaseTimer", "find_submodules", "percentile", "timed_comm_hook"]

# Top-level phases, in step order. They tile the step (no nesting), so with "other" they sum to the step time.
PHASES = ("data_wait", "h2d", "forward", "backward", "optimizer", "comm")
# A VLM's parts: role (reported as perf/<role>_forward_time) -> its modules ("vision", "projector", "language_model").
Parts = dict[str, tuple[nn.Module, ...]]
_NO_OP = contextlib.nullcontext()
_SYNC_WARNING = "synchroniz"  # torch's sync debug mode warns "called a synchronizing CUDA operation"


def _nvtx(name: str, enabled: bool) -> contextlib.AbstractContextManager[Any]:
    return torch.cuda.nvtx.range(name) if enabled else _NO_OP


def percentile(values: list[float], q: float) -> float:
    """The q-quantile (0..1) by linear interpolation; 0.0 for no values."""
    if not values:
        return 0.0
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def find_submodules(model: nn.Module, batches: Iterable[Any] | None = None) -> Parts:
    """The vision tower, projector and language model of a VLM, learned from the model, never from attribute names.

    The tower and the projector as :func:`~vlmfast.common.image_path.find_image_modules` finds them (the stand-in
    ``get_image_features`` call: nothing computed, works sharded or on the meta device; else a probe forward of
    `batches`, mappings on the model's device, read only then). The language model: the outermost module besides the
    tower that holds the text embedding (``get_input_embeddings()``, else ``get_output_embeddings()``, else the first
    embedding the ids of `batches` reach), and more than that embedding; the projector only where the language model
    is known (else it cannot be told apart from it). {} for a model without a vision tower (a text model: its forward
    is all language model). Pass the plain model (before DDP / torch.compile wrap it).
    Usage: ``find_submodules(llava)`` -> ``{"vision": (tower,), "projector": (projector,), "language_model": (lm,)}``
    """
    from vlmfast.common.image_path import find_image_modules

    batches = _Replayable(batches)  # two probes may read it: each sample is collated once
    try:
        found = find_image_modules(model, batches)
    except ValueError:
        return {}
    parts: Parts = {"vision": (model.get_submodule(found.tower),)}
    language = _language_model(model, found.tower, batches)
    if language is None:  # the projector is what the image call runs besides the tower and the text model: unknown
        return parts
    parts["language_model"] = (model.get_submodule(language),)
    projectors = [path for path in found.projectors if not _nested(path, language)]
    if projectors:
        parts["projector"] = tuple(model.get_submodule(path) for path in projectors)
    return parts


def _nested(a: str, b: str) -> bool:
    """Whether module paths `a` and `b` are the same module or one holds the other ("" is the root)."""
    return a == b or not a or not b or a.startswith(f"{b}.") or b.startswith(f"{a}.")


def _language_model(model: nn.Module, tower: str, batches: Iterable[Any]) -> str | None:
    """The outermost module holding the text embedding, not holding the tower nor inside it; None when unknown."""
    names = {id(module): name for name, module in model.named_modules()}
    for embedding in _text_embeddings(model, batches):
        parts = names.get(id(embedding), "").split(".")
        for depth in range(1, len(parts)):  # the embedding itself (depth len(parts)) does not tell the model apart
            path = ".".join(parts[:depth])
            if not _nested(path, tower):
                return path
    return None


def _text_embeddings(model: nn.Module, batches: Iterable[Any]) -> Iterator[nn.Module]:
    """Where the text goes in or comes out: the input embedding, the output head, then (only when neither placed the
    language model) the first embedding a probe batch's ids reach."""
    from vlmfast.common.image_path import text_embedding_modules

    yield from text_embedding_modules(model)
    from vlmfast.data.sample_checks import embedding_module_reached_by_ids

    for batch in batches:
        if isinstance(batch, Mapping) and isinstance(batch.get("input_ids"), torch.Tensor):
            reached = embedding_module_reached_by_ids(model, batch)
            if reached is not None:
                yield reached
            return


class _Replayable:
    """An iterable read lazily and kept: a second pass sees the same items without reading the source again."""

    def __init__(self, source: Iterable[Any] | None) -> None:
        self._source = iter(source) if source is not None else iter(())
        self._seen: list[Any] = []

    def __iter__(self) -> Iterator[Any]:
        index = 0
        while True:
            if index == len(self._seen):
                try:
                    self._seen.append(next(self._source))
                except StopIteration:
                    return
            yield self._seen[index]
            index += 1


class PhaseTimer:
    """Per-phase step times, sampled every `every_steps` steps; see the module docstring."""

    def __init__(self, device: torch.device, every_steps: int = 10, warmup_steps: int = 1,
                 peak_tflops: float | None = None, nvtx: bool = False, keep_steps: int = 10_000) -> None:
        if every_steps < 1:
            raise ValueError(f"PhaseTimer every_steps must be >= 1, got {every_steps}")
        self.device = torch.device(device)
        self.every_steps = every_steps
        self.warmup_steps = warmup_steps  # first steps (allocator warm-up, lazy init) are never sampled
        self.peak_tflops = peak_tflops  # for perf/mfu; None: TFLOP/s only
        self.sampling = False
        self._cuda = self.device.type == "cuda"
        self.nvtx = nvtx and self._cuda  # NVTX ranges on every step (push/pop cost ~1 us), for Nsight Systems
        self._steps_begun = 0
        self._step_start = 0.0
        self._step_flops = 0.0
        self._phase_name: str | None = None
        # (name, start mark, end mark, index of the enclosing phase or -1): a nested phase's time is taken out of
        # the enclosing one (e.g. an all-reduce "comm" inside "optimizer"), so phases never count twice.
        self._intervals: list[tuple[str, Any, Any, int]] = []
        self._open: list[int] = []  # indices of the phases entered and not yet left
        self._host_syncs = 0
        self._last_recorded = (False, False)  # did the last end_step add a step time / a sample
        # Bounded, so a million-step run does not grow: percentiles and shares are over the latest `keep_steps`.
        self.step_times: deque[float] = deque(maxlen=keep_steps)  # wall-clock time of non-warm-up steps
        self.samples: deque[dict[str, float]] = deque(maxlen=max(1, keep_steps // every_steps))  # sampled steps
        self._hooks: list[Any] = []
        self.parts: Parts = {}  # what attach() timed

    # ---- the loop's calls -----------------------------------------------------------------------------------
    def attach(self, model: nn.Module, batches: Iterable[Any] | None = None, parts: Parts | None = None) -> list[str]:
        """Time the forward of the vision tower / projector / language model when the model has them (returns which):
        `parts` as :func:`find_submodules` returns them, else learned here (`batches`: for a probe forward where the
        model's ``get_image_features`` cannot show its tower; never after FSDP2 / ZeRO-3 shard the model)."""
        self.parts = find_submodules(model, batches) if parts is None else parts
        for role, modules in self.parts.items():
            for module in modules:  # a projector of several modules: their times add up
                self._hooks.append(module.register_forward_pre_hook(self._submodule_start(role)))
                self._hooks.append(module.register_forward_hook(self._submodule_end(role), always_call=True))
        return list(self.parts)

    def detach(self) -> None:
        """Remove the sub-model hooks."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()

    def begin_step(self, step: int) -> None:
        """Start a step (call before the batch is fetched); decides whether this step is sampled."""
        self._steps_begun += 1
        self.sampling = self._steps_begun > self.warmup_steps and step % self.every_steps == 0
        self._intervals.clear()
        self._open.clear()
        self._host_syncs = 0
        self._step_flops = 0.0
        self._step_start = time.perf_counter()
        if self.sampling:
            self._begin_mark = self._mark()

    def phase(self, name: str) -> contextlib.AbstractContextManager[None]:
        """Time `name` (one of PHASES) on a sampled step; a shared no-op on the others."""
        if not self.sampling:
            return torch.cuda.nvtx.range(f"vlmfast/{name}") if self.nvtx else _NO_OP
        if name not in PHASES:
            raise ValueError(f"unknown phase '{name}'; use one of {', '.join(PHASES)}")
        return self._timed_phase(name)

    def add_flops(self, flops: float) -> None:
        """FLOPs done in this step (e.g. from vlmfast.profiling.flops.FlopsMeter); gives perf/tflops and perf/mfu."""
        self._step_flops += flops

    def end_step(self) -> dict[str, float]:
        """Finish the step: perf/* metrics on a sampled step, {} otherwise."""
        wall = time.perf_counter() - self._step_start
        self._last_recorded = (self._steps_begun > self.warmup_steps, self.sampling)
        if self._last_recorded[0]:
            self.step_times.append(wall)
        if not self.sampling:
            return {}
        self.sampling = False
        end_mark = self._mark()
        metrics = self._sampled_metrics(self._elapsed(self._begin_mark, end_mark), self._phase_times())
        self.samples.append(metrics)
        return metrics

    def discard_last(self) -> None:
        """Leave the last step out of the statistics (e.g. it ran under torch.profiler, which slows it)."""
        timed, sampled = self._last_recorded
        if timed:
            self.step_times.pop()
        if sampled:
            self.samples.pop()
        self._last_recorded = (False, False)

    def summary(self) -> dict[str, float]:
        """Step time p50/p90/p99 (every step) and mean phase shares, TFLOP/s and MFU (sampled steps)."""
        out: dict[str, float] = {}
        if self.step_times:
            out |= {f"perf/step_time_p{q}": percentile(self.step_times, q / 100) for q in (50, 90, 99)}
            out["perf/step_time_mean"] = sum(self.step_times) / len(self.step_times)
        if not self.samples:
            return out
        total = sum(s["perf/step_time"] for s in self.samples) or 1e-12
        for key in sorted({k for s in self.samples for k in s}):
            if key.endswith("_time") and key != "perf/step_time":
                out[key.removesuffix("_time") + "_share"] = sum(s.get(key, 0.0) for s in self.samples) / total
        out["perf/data_wait_ratio"] = out.get("perf/data_wait_share", 0.0)
        out["perf/sampled_steps"] = float(len(self.samples))
        flops = sum(s.get("perf/flops", 0.0) for s in self.samples)
        if flops:
            out["perf/tflops"] = flops / total / 1e12
            if self.peak_tflops:
                out["perf/mfu"] = out["perf/tflops"] / self.peak_tflops
        return out

    # ---- measurement ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _timed_phase(self, name: str) -> Iterator[None]:
        outer, self._phase_name = self._phase_name, name
        index = len(self._intervals)
        self._intervals.append((name, self._mark(), None, self._open[-1] if self._open else -1))
        self._open.append(index)
        try:
            with self._count_host_syncs(name), _nvtx(f"vlmfast/{name}", self.nvtx):
                yield
        finally:
            self._open.pop()
            name, start, _, parent = self._intervals[index]
            self._intervals[index] = (name, start, self._mark(), parent)
            self._phase_name = outer

    @contextlib.contextmanager
    def _count_host_syncs(self, name: str) -> Iterator[None]:
        # Only where user code runs (model, loss); the trainer's own once-per-step sync is not the user's doing.
        if not (self._cuda and name in ("forward", "backward")):
            yield
            return
        previous = torch.cuda.get_sync_debug_mode()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                yield
            finally:
                torch.cuda.set_sync_debug_mode(previous)
        self._host_syncs += sum(_SYNC_WARNING in str(w.message) for w in caught)
        for w in caught:  # hand the other warnings on
            if _SYNC_WARNING not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)

    def record_interval(self, name: str, start: Any, end: Any) -> None:
        """Add a measured interval (marks from :meth:`mark`), e.g. from a communication hook."""
        self._intervals.append((name, start, end, -1))

    def mark(self) -> Any:
        """A point in time on this device's timeline (a recorded CUDA event, or perf_counter on CPU)."""
        return self._mark()

    def _mark(self) -> Any:
        if self._cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _elapsed(self, start: Any, end: Any) -> float:
        if self._cuda:
            end.synchronize()
            return start.elapsed_time(end) / 1e3
        return end - start

    def _phase_times(self) -> dict[str, float]:
        durations = [self._elapsed(start, end) if end is not None else 0.0 for _, start, end, _ in self._intervals]
        exclusive = list(durations)
        for (_, _, _, parent), seconds in zip(self._intervals, durations, strict=True):
            if parent >= 0:
                exclusive[parent] -= seconds
        times: dict[str, float] = defaultdict(float)
        for (name, _, _, _), seconds in zip(self._intervals, exclusive, strict=True):
            times[name] += max(seconds, 0.0)
        return times

    def _sampled_metrics(self, step_time: float, times: dict[str, float]) -> dict[str, float]:
        metrics = {"perf/step_time": step_time}
        covered = 0.0
        for name, seconds in times.items():
            metrics[f"perf/{name}_time"] = seconds
            covered += seconds if name in PHASES else 0.0
        metrics["perf/other_time"] = max(step_time - covered, 0.0)
        metrics["perf/data_wait_ratio"] = times.get("data_wait", 0.0) / step_time if step_time > 0 else 0.0
        if self._cuda:
            metrics["perf/host_syncs"] = float(self._host_syncs)
        if self._step_flops:
            metrics["perf/flops"] = self._step_flops
            metrics["perf/tflops"] = self._step_flops / step_time / 1e12
            if self.peak_tflops:
                metrics["perf/mfu"] = metrics["perf/tflops"] / self.peak_tflops
        return metrics

    # ---- sub-model hooks ------------------------------------------------------------------------------------
    def _submodule_start(self, role: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any) -> None:
            if torch.compiler.is_compiling():  # traced into a compiled block, `sampling` would guard a recompile
                return
            # Forward phase only: activation-checkpoint recomputation in backward re-enters modules.
            if self.sampling and self._phase_name == "forward":
                module._vlmfast_phase_start = self._mark()  # type: ignore[attr-defined]

        return hook

    def _submodule_end(self, role: str) -> Callable[..., None]:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if torch.compiler.is_compiling():
                return
            start = module.__dict__.pop("_vlmfast_phase_start", None)
            if start is not None and self.sampling:
                self._intervals.append((f"{role}_forward", start, self._mark(), -1))

        return hook


def timed_comm_hook(timer: PhaseTimer, hook: Callable[..., Any] | None = None) -> Callable[..., Any]:
    """Wrap a DDP communication hook (default: plain all-reduce) so sampled steps report `perf/comm_hook_time`.

    Usage: ``ddp_model.register_comm_hook(state, timed_comm_hook(timer, fp16_compress_hook))`` (DDP takes one hook,
    so wrap the one you would register; with no hook, pass the process group or None as state).
    """
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    inner = hook or allreduce_hook

    def timed(state, bucket):  # type: ignore[no-untyped-def]  # DDP rejects annotations that are strings
        if not timer.sampling:
            return inner(state, bucket)
        start = timer.mark()
        future = inner(state, bucket)

        def finished(done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            timer.record_interval("comm_hook", start, timer.mark())
            return done.value()

        return future.then(finished)

    return timed
