"""`vlmfast doctor`: measure a few steps of a job, then say what is slow and which spec change to try first.

Usage::

    evidence = Evidence.from_history(result.history, spec, device="cuda", device_memory_gb=80.0)
    for finding in diagnose(evidence):
        print(finding.to_text())                     # ranked: evidence, then the exact spec change
    table = one_flag_at_a_time(run_job, spec, findings)   # optional: apply each change alone, measure the gain

The rules follow the reference decision tree ("measure first"), in this order of questions: is the device waiting
for data (data wait, host-to-device copy)? Is the step dominated by communication? Inside compute: does attention
take the time (memory-bandwidth bound: SDPA/flash), are matmuls off the tensor cores (fp32: bf16/TF32), are
host-device syncs stalling the queue, is compute spent on padding (packing/grouping)? And memory: is there headroom
for a larger micro-batch (or no checkpointing), or is the run close to OOM (checkpointing, ZeRO; LoRA when full
fine-tuning's weights, gradients and optimizer states are most of the memory)? Each finding
carries its measured evidence and the part of the step time at stake, which ranks the findings. Everything here is
a pure function of per-step metrics (the PhaseTimer's ``perf/*``, the trainer's ``mem/*``, ``tokens``) plus run
facts, so it is testable without a device.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from vlmfast.profiling.phase_timer import percentile
from vlmfast.profiling.trial_budget import TrialBudgetExceeded, trial_budget
from vlmfast.spec import TrainSpec

__all__ = ["Evidence", "Finding", "FlagTrial", "diagnose", "format_findings", "format_trials",
           "one_flag_at_a_time", "rank_findings", "ranked_trials", "trial_advice", "with_changes"]

# Thresholds (share of step time) from which a phase is worth a finding; below them the gain is noise.
DATA_WAIT_MIN = 0.10
H2D_MIN = 0.05
COMM_MIN = 0.15
ATTENTION_MIN = 0.15
PADDING_MIN = 0.20
HEADROOM_MAX = 0.50  # peak below this share of device memory: room for a larger micro-batch
OOM_RISK_MIN = 0.90  # peak above this share: one longer batch away from OOM
LORA_TRAINABLE_MIN = 0.5  # LoRA is proposed when at least this share of the parameters trains...
LORA_STATE_MIN = 0.5  # ...and their weights, gradients and optimizer states are at least this share of the peak


@dataclass
class Evidence:
    """What a short run measured: sampled ``perf/*`` steps plus the facts the rules need."""

    samples: list[dict[str, float]]  # PhaseTimer.end_step() dicts (sampled steps only)
    spec: TrainSpec
    device: str = "cpu"  # "cpu" or "cuda"
    world_size: int = 1
    peak_memory_gb: float | None = None
    device_memory_gb: float | None = None  # total device memory; None: no memory rules
    padding_fraction: float | None = None  # share of language-model tokens that are padding
    top_ops: list[dict[str, Any]] = field(default_factory=list)  # from the torch.profiler window
    mfu: float | None = None
    bf16_supported: bool = True
    tokens_per_s: float | None = None  # real input tokens per second at the p50 step (tokens_per_step / step p50)
    tokens_per_step: float | None = None  # mean real (non-padding) input tokens per timed step
    startup_s: float | None = None  # seconds the steps (warm-up included) spent above the p50: compile, autotuning
    vision_frozen: bool | None = None  # the vision tower has no trainable parameter (None: no tower found)
    vocab_size: int | None = None  # rows of the language head: the logits are tokens x vocab
    tokens_per_micro_batch: float | None = None  # padded tokens a micro-batch holds now
    length_spread: float | None = None  # longest / median sample length in a few batches
    packing_refused: str | None = None  # why packing would be refused for this model and data (None: it packs)
    packing_level: str = "ids"  # the level that packs exactly ("embeddings" where id-level packing is refused)
    trainable_params: int | None = None  # parameters that train (a LoRA run: adapters and modules_to_save)
    total_params: int | None = None
    model_state_gb: float | None = None  # estimated weights + gradients + optimizer states, as the run trains
    lora_model_state_gb: float | None = None  # the same with LoRA adapters of rank spec.lora.r (the estimator)


    @classmethod
    def from_history(cls, history: Sequence[Mapping[str, Any]], spec: TrainSpec, **facts: Any) -> Evidence:
        """Evidence from a run's per-step metrics (rows with ``perf/step_time`` are the sampled steps)."""
        samples = [{k: float(v) for k, v in row.items() if k.startswith("perf/") and isinstance(v, (int, float))}
                   for row in history if "perf/step_time" in row and not _excluded(row)]
        peaks = [row["mem/peak_gb"] for row in history if "mem/peak_gb" in row]
        facts.setdefault("peak_memory_gb", max(peaks) if peaks else None)
        mfus = [s["perf/mfu"] for s in samples if "perf/mfu" in s]
        facts.setdefault("mfu", sum(mfus) / len(mfus) if mfus else None)
        # One definition for every figure the doctor compares: the p50 of the timed steps. Tokens/s is the real
        # tokens of a step at that p50 (a mean over the steps would count a recompile's step the p50 leaves out).
        timed = [row for row in history if "perf/step_time" in row and not _excluded(row) and "tokens" in row]
        p50 = percentile([s["perf/step_time"] for s in samples], 0.5) if samples else 0.0
        per_step = sum(row["tokens"] for row in timed) / len(timed) if timed else None
        facts.setdefault("tokens_per_step", per_step)
        facts.setdefault("tokens_per_s", per_step / p50 if per_step is not None and p50 > 0 else None)
        # What the steps spent above the p50, warm-up steps included (traced steps are slowed by the profiler):
        # the one-off cost of a compile or an autotuning pass, paid again at the start of every run.
        walls = [row["step_time"] for row in history if "step_time" in row and not row.get("perf/traced")]
        facts.setdefault("startup_s", sum(max(0.0, wall - p50) for wall in walls) if walls and samples else None)
        return cls(samples=samples, spec=spec, **facts)

    def share(self, phase: str) -> float:
        """Mean share of step time spent in `phase` (e.g. "data_wait", "comm_hook") over the sampled steps."""
        total = sum(s["perf/step_time"] for s in self.samples)
        return sum(s.get(f"perf/{phase}_time", 0.0) for s in self.samples) / total if total > 0 else 0.0

    def mean_ms(self, phase: str) -> float:
        values = [s.get(f"perf/{phase}_time", 0.0) for s in self.samples]
        return 1e3 * sum(values) / len(values) if values else 0.0

    @property
    def step_ms(self) -> float:
        return 1e3 * percentile([s["perf/step_time"] for s in self.samples], 0.5)


@dataclass
class Finding:
    """One diagnosis: what is slow (with the measured evidence), how much is at stake, and the spec change."""

    key: str
    title: str
    at_stake: float  # estimated share of step time (or risk weight) the change addresses: the ranking key
    evidence: str
    change: dict[str, Any] = field(default_factory=dict)  # dotted spec overrides (empty: a code change)
    advice: str = ""
    measured: str = ""  # doctor --apply: the change's measured gain (rank_findings)
    trial: bool = True  # doctor --apply times the change; False: it changes what is trained (LoRA), not a speed flag

    def to_text(self, rank: int | None = None) -> str:
        head = f"{rank}. " if rank is not None else ""
        change = ", ".join(f"{key}={value}" for key, value in self.change.items())
        lines = [f"{head}{self.title}  [{self.at_stake:.0%} of step time at stake]", f"   evidence: {self.evidence}"]
        if change:
            lines.append(f"   change:   {change}   (--set {' --set '.join(_set_args(self.change))})")
        if self.advice:
            lines.append(f"   also:     {self.advice}")
        if self.measured:
            lines.append(f"   measured: {self.measured}")
        return "\n".join(lines)


def _set_args(change: Mapping[str, Any]) -> list[str]:
    return [f"{key}={str(value).lower() if isinstance(value, bool) else value}" for key, value in change.items()]


def with_changes(spec: TrainSpec, change: Mapping[str, Any]) -> TrainSpec:
    """A copy of `spec` with dotted overrides applied and validated (raises ValueError naming the field)."""
    data = spec.to_dict() if hasattr(spec, "to_dict") else spec.model_dump()
    for dotted, value in change.items():
        *parents, leaf = dotted.split(".")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    try:
        return TrainSpec.model_validate(data)
    except ValidationError as exc:
        raise ValueError(f"spec change {dict(change)} is not valid here: {exc.errors()[0]['msg']}") from exc


def _first_valid(spec: TrainSpec, candidates: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The first candidate change that this version's spec accepts (sections land independently)."""
    for change in candidates:
        try:
            with_changes(spec, change)
        except ValueError:
            continue
        return dict(change)
    return {}


# ---- the rules --------------------------------------------------------------------------------------------------
def diagnose(evidence: Evidence) -> list[Finding]:
    """All findings, most time at stake first. Empty when nothing measured stands out."""
    if not evidence.samples:
        raise ValueError("doctor: no timed steps to diagnose; run more steps than profile.warmup_steps with "
                         "profile.timing: true")
    rules = (_data_loading, _host_to_device, _communication, _attention, _precision, _host_syncs, _padding,
             _token_budget, _vision_tower, _oom_risk, _lora, _logits_memory, _memory_headroom, _compile)
    findings = [finding for rule in rules if (finding := rule(evidence)) is not None]
    return sorted(findings, key=lambda f: f.at_stake, reverse=True)


def _data_loading(ev: Evidence) -> Finding | None:
    share = ev.share("data_wait")
    if share < DATA_WAIT_MIN:
        return None
    workers = ev.spec.data.num_workers
    more = min(os.cpu_count() or 2, 8) if workers in (0, "auto") else min(2 * int(workers), os.cpu_count() or 2)
    change = _first_valid(ev.spec, [{"data.num_workers": "auto"} if workers != "auto" else {},
                                    {"data.num_workers": more, "data.persistent_workers": True}])
    return Finding(
        "data_loading", "Data-bound: the step waits for the DataLoader", share,
        f"data wait {ev.mean_ms('data_wait'):.1f} ms of a {ev.step_ms:.1f} ms step ({share:.0%}) with "
        f"data.num_workers={workers}",
        change, "prefetch_factor 2-4, precomputed/sharded data (vlmfast shards), resize images on the device "
        "(data.device_image_size); a sleeping or slow __getitem__ shows up here")


def _host_to_device(ev: Evidence) -> Finding | None:
    share = ev.share("h2d")
    if share < H2D_MIN:
        return None
    change = _first_valid(ev.spec, [{"data.pin_memory": True, "data.device_prefetch": True},
                                    {"data.pin_memory": True}])
    return Finding("h2d", "Host-to-device copies block the step", share,
                   f"copy {ev.mean_ms('h2d'):.1f} ms per step ({share:.0%})", change,
                   "pinned memory makes non_blocking copies asynchronous; prefetching overlaps them with compute")


def _communication(ev: Evidence) -> Finding | None:
    share = ev.share("comm") + ev.share("comm_hook")
    if ev.world_size < 2 or share < COMM_MIN:
        return None
    ddp = ev.spec.ddp
    candidates: list[dict[str, Any]] = []
    if ddp.sync_each_micro_batch:
        candidates.append({"ddp.sync_each_micro_batch": False})
    if ev.device == "cuda" and ddp.comm_hook == "none":
        candidates.append({"ddp.comm_hook": "bf16" if ev.bf16_supported else "fp16"})
    candidates.append({"ddp.bucket_cap_mb": ddp.bucket_cap_mb * 2})
    return Finding("communication", "Communication-heavy: gradient all-reduce takes a large share", share,
                   f"all-reduce {ev.mean_ms('comm') + ev.mean_ms('comm_hook'):.1f} ms per {ev.step_ms:.1f} ms step "
                   f"({share:.0%}, partly overlapped with backward) on {ev.world_size} ranks",
                   _first_valid(ev.spec, candidates),
                   "a larger batch_size with gradient accumulation all-reduces once per more samples; "
                   "ddp.static_graph: true; ddp.comm_hook: powersgd for slow links")


def _attention(ev: Evidence) -> Finding | None:
    """Eager attention (softmax + batched matmuls, or SDPA's math kernel) taking a large share of the trace.

    Judged on the operators that ran: SDPA's fused kernels (flash, memory-efficient, cuDNN, and the CPU flash
    kernel) are already the fast path, and plain matmuls (aten::mm) or the optimizer's kernels are no attention."""
    if not ev.top_ops:
        return None
    eager = [op for op in ev.top_ops if attention_kind(op["name"]) in ("eager", "math")]
    fused = [op for op in ev.top_ops if attention_kind(op["name"]) == "fused"]
    share = sum(op["share"] for op in eager)
    if share < ATTENTION_MIN:
        return None
    compute = ev.share("forward") + ev.share("backward")
    names = ", ".join(op["name"] for op in eager[:3])
    evidence = (f"eager attention operators take {share:.0%} of profiled {ev.top_ops[0]['clock']} time ({names})"
                + (f"; fused attention kernels also ran ({fused[0]['name']})" if fused else ""))
    if any(attention_kind(op["name"]) == "math" for op in eager):
        return Finding("attention", "SDPA runs its math kernel (no fused kernel accepted the inputs)",
                       share * compute * 0.5, evidence, None,
                       "a fused kernel needs a supported dtype, head size and mask (see attention.sdpa_kernels and "
                       "docs/attention.md); flash needs CUDA and fp16/bf16")
    change = _first_valid(ev.spec, [{"attention.backend": "sdpa"}, {"attention.implementation": "sdpa"}])
    return Finding("attention", "Attention is memory-bandwidth bound (eager softmax/bmm)", share * compute * 0.5,
                   evidence, change, "use torch SDPA or FlashAttention (attn_implementation='sdpa'/"
                   "'flash_attention_2' for Hugging Face models); below ~512 tokens the gain is small")


def attention_kind(op_name: str) -> str | None:
    """'fused' (an SDPA flash / efficient / cuDNN kernel, CPU flash included), 'math' (SDPA's math fallback),
    'eager' (softmax, bmm, baddbmm: attention written out), or None (anything else: mm, the optimizer ...).

    Usage: ``attention_kind("aten::_scaled_dot_product_flash_attention_for_cpu")  # -> "fused"``
    """
    name = op_name.lower().rsplit("::", 1)[-1]
    if "_attention_math" in name:
        return "math"
    if any(kernel in name for kernel in ("flash_attention", "efficient_attention", "cudnn_attention",
                                         "fused_attention", "flash_attn")):
        return "fused"
    if name.lstrip("_").startswith("softmax") or name in ("bmm", "baddbmm"):
        return "eager"
    return None


def _precision(ev: Evidence) -> Finding | None:
    if ev.device != "cuda" or ev.spec.precision != "fp32":
        return None
    compute = ev.share("forward") + ev.share("backward")
    mfu = f"MFU {ev.mfu:.0%}" if ev.mfu is not None else "fp32 matmuls"
    candidates = [{"precision": "bf16"}] if ev.bf16_supported else []
    candidates.append({"tf32": True})
    return Finding("precision", "Low tensor-core use: matmuls run in fp32", 0.5 * compute,
                   f"{mfu} at precision fp32 (tf32={ev.spec.tf32}); forward+backward are {compute:.0%} of the step",
                   _first_valid(ev.spec, candidates), "bf16 autocast halves activation memory as well")


def _host_syncs(ev: Evidence) -> Finding | None:
    syncs = [s["perf/host_syncs"] for s in ev.samples if "perf/host_syncs" in s]
    per_step = sum(syncs) / len(syncs) if syncs else 0.0
    if per_step < 1:
        return None
    return Finding("host_syncs", "Host-device syncs in model or loss code stall the GPU queue",
                   min(0.02 * per_step, 0.3),
                   f"{per_step:.0f} synchronising call(s) per step inside forward/backward (.item(), .cpu(), "
                   ".tolist(), boolean masks)", {},
                   "keep values on the device inside the step; log them every N steps (torch.cuda."
                   "set_sync_debug_mode('warn') shows where)")


def _padding(ev: Evidence) -> Finding | None:
    padding = ev.padding_fraction
    if padding is None or padding < PADDING_MIN:
        return None
    compute = ev.share("language_model_forward") * 3 or ev.share("forward") + ev.share("backward")
    # Checked advice only: packing is offered when the model packs exactly (collect_evidence measured it)
    pack = {"packing.enabled": True, **({"packing.level": ev.packing_level} if ev.packing_level != "ids" else {})}
    candidates = ([] if ev.packing_refused else [pack]) + [{"data.group_by_length": "length"}]
    change = _first_valid(ev.spec, candidates)
    advice = ("packing concatenates short samples (document masks keep them apart); grouping by length "
              "pads each batch only to its own longest sample")
    if ev.packing_refused:
        advice = f"grouping by length pads each batch only to its own longest sample ({ev.packing_refused})"
    return Finding("padding", "Compute spent on padding", padding * min(compute, 1.0),
                   f"{padding:.0%} of language-model tokens are padding", change, advice)


LENGTH_SPREAD_MIN = 4.0  # longest / median sample length from which fixed-size micro-batches waste the device
LOGITS_SHARE_MIN = 0.2  # share of peak memory the logits path takes from which chunked cross-entropy is proposed


def _token_budget(ev: Evidence) -> Finding | None:
    """Long-tailed lengths split into micro-batches of a fixed sample count: cut them by tokens instead."""
    spec = ev.spec
    padding, spread, tokens = ev.padding_fraction, ev.length_spread, ev.tokens_per_micro_batch
    if (padding is None or spread is None or tokens is None or padding < PADDING_MIN or spread < LENGTH_SPREAD_MIN
            or spec.micro_batch_tokens is not None or spec.packing.enabled):
        return None
    compute = ev.share("forward") + ev.share("backward")
    return Finding("token_budget", "Long-tailed lengths in fixed-size micro-batches", 0.8 * padding * min(compute, 1),
                   f"samples differ {spread:.0f}x in length and {padding:.0%} of tokens are padding; a micro-batch "
                   f"holds {tokens:.0f} padded tokens", _first_valid(spec, [{"micro_batch_tokens": int(tokens)}]),
                   "micro_batch_tokens keeps each micro-batch within the memory of today's (same peak), packs short "
                   "samples many at a time and long ones few at a time, and trims each to its own longest sample")


def _logits_memory(ev: Evidence) -> Finding | None:
    """The [tokens, vocab] logits (and the fp32 log-softmax the loss keeps) dwarf what the hidden states need."""
    if ev.vocab_size is None or ev.tokens_per_micro_batch is None or ev.spec.linear_cross_entropy.enabled:
        return None
    logits_gb = ev.tokens_per_micro_batch * ev.vocab_size * 4 * 2 / 2**30  # fp32 logits + their log-softmax
    share = logits_gb / ev.peak_memory_gb if ev.peak_memory_gb else None
    if (share is not None and share < LOGITS_SHARE_MIN) or (share is None and logits_gb < 0.5):
        return None
    where = f" (~{share:.0%} of the {ev.peak_memory_gb:.2f} GiB peak)" if share is not None else ""
    return Finding("logits_memory", "The logits take much of the activation memory", 0.3 * min(share or 0.5, 1.0),
                   f"{ev.tokens_per_micro_batch:.0f} tokens x {ev.vocab_size} vocabulary = ~{logits_gb:.2f} GiB of "
                   f"fp32 logits and log-softmax per micro-batch{where}",
                   _first_valid(ev.spec, [{"linear_cross_entropy.enabled": True}]),
                   "chunked linear cross-entropy never materialises them (same loss and gradients); the room it "
                   "frees fits a larger micro-batch or less checkpointing")


def _vision_tower(ev: Evidence) -> Finding | None:
    share = ev.share("vision_forward")
    forward = ev.share("forward")
    if forward <= 0 or share / forward < 0.4:
        return None
    evidence = (f"vision tower {ev.mean_ms('vision_forward'):.1f} ms = {share / forward:.0%} of forward "
                f"({share:.0%} of the step)")
    cache_on = _spec_value(ev.spec, "vision_cache.enabled")
    if ev.vision_frozen and cache_on is False:
        # A frozen tower recomputes the same features every epoch: from epoch 2 the cache removes its forward.
        return Finding("vision_tower", "A frozen vision tower recomputes the same features every epoch",
                       0.9 * share, f"{evidence}; the tower is frozen",
                       _first_valid(ev.spec, [{"vision_cache.enabled": True}]),
                       "the gain starts in epoch 2 (epoch 1 fills the cache; a short trial shows only its cost); "
                       "needs deterministic images (no random augmentation); disk: image tokens x width x dtype "
                       "bytes per image (`vlmfast estimate-memory --vision-cache`)")
    return Finding("vision_tower", "The vision tower dominates the forward pass", 0.5 * share, evidence,
                   {}, "frozen tower: vision_cache.enabled caches its features from epoch 2; otherwise "
                   "fewer/lower-resolution image tiles, bf16, or activation_checkpointing.scope: vision")


def _memory_fraction(ev: Evidence) -> float | None:
    if ev.peak_memory_gb is None or not ev.device_memory_gb:
        return None
    return ev.peak_memory_gb / ev.device_memory_gb


def _oom_risk(ev: Evidence) -> Finding | None:
    used = _memory_fraction(ev)
    if used is None or used < OOM_RISK_MIN:
        return None
    spec = ev.spec
    candidates = []
    if not spec.activation_checkpointing.enabled:
        candidates.append({"activation_checkpointing.enabled": True})
    if not spec.oom.enabled:
        candidates.append({"oom.enabled": True})
    if ev.world_size > 1:
        candidates.append({"engine": "deepspeed", "deepspeed.zero_stage": 2})
    return Finding("oom_risk", "Out-of-memory risk: peak memory is close to the device's", 0.5 + (used - 0.9) * 5,
                   f"peak {ev.peak_memory_gb:.2f} GiB of {ev.device_memory_gb:.2f} GiB ({used:.0%})",
                   _first_valid(spec, candidates),
                   "a longer batch than the ones seen (more images, longer text) would not fit; `vlmfast "
                   "estimate-memory` shows which part to shrink")


def _lora(ev: Evidence) -> Finding | None:
    """Close to OOM with most parameters training, their states most of the peak: LoRA trains adapters instead."""
    used = _memory_fraction(ev)
    if (used is None or used < OOM_RISK_MIN or _spec_value(ev.spec, "lora.enabled") is not False
            or not ev.trainable_params or not ev.total_params or ev.model_state_gb is None
            or ev.lora_model_state_gb is None or ev.peak_memory_gb is None):
        return None
    share = ev.trainable_params / ev.total_params
    if share < LORA_TRAINABLE_MIN or ev.model_state_gb < LORA_STATE_MIN * ev.peak_memory_gb:
        return None
    change = _first_valid(ev.spec, [{"lora.enabled": True}])
    if not change:
        return None
    r = ev.spec.lora.r
    saved = max(ev.model_state_gb - ev.lora_model_state_gb, 0.0)
    return Finding("lora", "Full fine-tuning's weights, gradients and optimizer states fill the memory",
                   0.5 * min(saved / ev.peak_memory_gb, 1.0) + 0.2,
                   f"{_billions(ev.trainable_params)} of {_billions(ev.total_params)} parameters train ({share:.0%}); "
                   f"peak {ev.peak_memory_gb:.2f} GiB of {ev.device_memory_gb:.2f} GiB ({used:.0%}); weights, "
                   f"gradients and optimizer states ~{ev.model_state_gb:.2f} GiB, ~{ev.lora_model_state_gb:.2f} GiB "
                   f"with LoRA r {r} (the estimator, unsharded: vlmfast estimate-memory --lora-r {r})", change,
                   "a different training, not a speed flag (doctor --apply does not time it): low-rank adapters on the "
                   "frozen language model (pip install 'vlmfast[lora]'); lora.modules_to_save: [your projector] "
                   "trains it fully; compare the quality on your evaluation (docs/lora.md)", trial=False)


def _billions(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e8 else f"{n / 1e6:.1f}M"


def _memory_headroom(ev: Evidence) -> Finding | None:
    used = _memory_fraction(ev)
    if used is None or used >= HEADROOM_MAX:
        return None
    spec = ev.spec
    candidates = []
    ckpt = spec.activation_checkpointing
    if ckpt.enabled and ckpt.budget_gb is None and ev.peak_memory_gb is not None and ev.device_memory_gb:
        # Most of the free room as the activation budget: the plan keeps at least what checkpointing every block
        # keeps (never more memory than now when the room is smaller) and recomputes less when it is larger.
        room = 0.8 * (ev.device_memory_gb - ev.peak_memory_gb)
        candidates.append({"activation_checkpointing.budget_gb": round(room, 2)})
    if ckpt.enabled:
        candidates.append({"activation_checkpointing.enabled": False})
    mbs = spec.resolved_micro_batch_size
    if mbs < spec.batch_size:
        candidates.append({"micro_batch_size": min(2 * mbs, spec.batch_size)})
    change = _first_valid(spec, candidates)
    if not change:
        return None
    return Finding("memory_headroom", "Unused memory: a larger micro-batch or no recomputation fits", 0.1 * (1 - used),
                   f"peak {ev.peak_memory_gb:.2f} GiB of {ev.device_memory_gb:.2f} GiB ({used:.0%})", change,
                   "`vlmfast find-batch-size` finds the largest micro-batch that fits")


def _compile(ev: Evidence) -> Finding | None:
    compute = ev.share("forward") + ev.share("backward")
    if compute < 0.6 or _spec_value(ev.spec, "compile.enabled") in (True, None):
        return None
    return Finding("compute", "Compute-bound: forward and backward fill the step", 0.15 * compute,
                   f"forward+backward {compute:.0%} of the step; data wait {ev.share('data_wait'):.0%}",
                   _first_valid(ev.spec, [{"compile.enabled": True}]),
                   "fused kernels cut launch overhead and memory traffic; then check MFU against the device peak")


def _spec_value(spec: Any, dotted: str) -> Any:
    for part in dotted.split("."):
        spec = getattr(spec, part, None)
        if spec is None:
            return None
    return spec


def format_findings(findings: Sequence[Finding], evidence: Evidence) -> str:
    """The ranked diagnosis as text, headed by the measured step-time breakdown."""
    phases = ("data_wait", "h2d", "forward", "backward", "optimizer", "comm", "other")
    split = ", ".join(f"{name} {evidence.share(name):.0%}" for name in phases if evidence.share(name) >= 0.005)
    lines = [f"step time p50 {evidence.step_ms:.1f} ms over {len(evidence.samples)} timed steps: {split}"]
    if evidence.mfu is not None:
        lines.append(f"MFU {evidence.mfu:.1%}")
    if _spec_value(evidence.spec, "lora.enabled") and evidence.trainable_params and evidence.total_params:
        lines.append(f"LoRA r {evidence.spec.lora.r}: {evidence.trainable_params:,} of {evidence.total_params:,} "
                     f"parameters train ({evidence.trainable_params / evidence.total_params:.2%})")
    if not findings:
        lines.append("no bottleneck stands out: the step is compute-bound and no flag is predicted to help")
    lines += [finding.to_text(rank) for rank, finding in enumerate(findings, 1)]
    return "\n".join(lines)


# ---- profiling a real job ------------------------------------------------------------------------------------
def doctor_spec(spec: TrainSpec, steps: int = 20, out_dir: str | None = None,
                trace_dir: str | None = None, trace: bool = True) -> TrainSpec:
    """`spec` turned into a short profiling run: every step timed, a torch.profiler window near the end (unless
    `trace` is False: the one-flag-at-a-time trials need only the timings), no checkpoints, no evaluation, no
    progress bar (everything that decides speed is left as the user set it). Metrics, plot and trace go to
    `out_dir` (trace: `trace_dir` when given)."""
    if steps < 4:
        raise ValueError(f"doctor --steps must be >= 4 (warm-up, then timed steps), got {steps}")
    warmup = max(1, steps // 5)
    change: dict[str, Any] = {
        "max_steps": steps, "save.dir": None, "save.every_steps": None, "save.resume": "never",
        "eval.every_steps": None, "log.progress": "off", "log.dir": out_dir, "log.tensorboard": False,
        "memory.leak_check": False, "profile.timing": True, "profile.every_steps": 1, "profile.warmup_steps": warmup,
        "profile.plots": out_dir is not None, "profile.trace.enabled": trace, "profile.trace.format": "chrome",
        "profile.trace.start_step": max(warmup + 1, steps - 2), "profile.trace.warmup_steps": 1,
        "profile.trace.active_steps": min(2, steps - max(warmup + 1, steps - 2) + 1),
        "profile.trace.dir": trace_dir or (f"{out_dir}/profiler" if out_dir else None),
    }
    if spec.scheduler.warmup_steps >= steps:  # lr warm-up does not change speed; the spec demands it < max_steps
        change["scheduler.warmup_steps"] = 0
    return with_changes(spec, change)


def collect_evidence(trainer: Any, result: Any) -> Evidence:
    """Evidence from a finished OptimizedTrainer run with `profile.timing` on."""
    import torch

    from vlmfast.memory.stats import GB

    history = result.history
    if not any("perf/step_time" in row for row in history):
        raise ValueError("doctor: the run reported no perf/* metrics: profile.timing must be on and the trainer "
                         "must drive vlmfast.profiling.RunProfiler")
    device = trainer.device
    cuda = device.type == "cuda"
    profiler = getattr(trainer, "timer", None)  # the trainer's RunProfiler
    trace = getattr(profiler, "trace", None)
    head = getattr(trainer.engine.module, "get_output_embeddings", lambda: None)()
    weight = getattr(head, "weight", None)
    tokens, spread = peek_lengths(trainer.loader, trainer.spec.resolved_micro_batch_size)
    model = trainer.engine.module
    params = list(model.parameters())
    states = model_state_estimates(model, trainer.spec) \
        if cuda and not trainer.spec.lora.enabled and not trainer.engine.shards_parameters else None
    return Evidence.from_history(
        history, trainer.spec, device=device.type, world_size=trainer.world_size,
        peak_memory_gb=result.report.peak_memory_gb,
        device_memory_gb=torch.cuda.get_device_properties(device).total_memory / GB if cuda else None,
        padding_fraction=peek_padding(trainer.loader), top_ops=list(getattr(trace, "top_ops", [])),
        bf16_supported=torch.cuda.is_bf16_supported() if cuda else True,
        vision_frozen=_vision_frozen(trainer.engine.module, getattr(getattr(profiler, "timer", None), "parts", None)),
        vocab_size=int(weight.shape[0]) if isinstance(weight, torch.Tensor) and weight.dim() == 2 else None,
        tokens_per_micro_batch=tokens, length_spread=spread, **_packing_evidence(trainer),
        trainable_params=sum(p.numel() for p in params if p.requires_grad), total_params=sum(p.numel() for p in params),
        model_state_gb=states[0] if states else None, lora_model_state_gb=states[1] if states else None,
    )


def model_state_estimates(model: Any, spec: TrainSpec) -> tuple[float, float] | None:
    """Weights, gradients and optimizer states in GiB (one GPU, unsharded) of ``model`` as it trains now, and with
    LoRA adapters of rank ``spec.lora.r`` on ``spec.lora.towers``: the estimator on meta-device copies (nothing
    allocated). None when the model cannot be adapted (peft missing, no input embedding to find the language model
    by)."""
    import copy

    import torch

    from vlmfast.memory.estimator import estimate_memory
    from vlmfast.memory.stats import GB
    from vlmfast.strategies.lora import LoRASpec, apply_lora

    def meta_copy() -> Any:  # the module tree again, every tensor on the meta device
        memo: dict[int, Any] = {}
        for tensor in [*model.parameters(), *model.buffers()]:
            meta = torch.empty_like(tensor, device="meta")
            memo[id(tensor)] = torch.nn.Parameter(meta, tensor.requires_grad) \
                if isinstance(tensor, torch.nn.Parameter) else meta
        return copy.deepcopy(model, memo)

    def state_bytes(meta: Any) -> int:  # model states only: a probe that runs nothing measures no activations
        return estimate_memory(meta, precision=spec.precision, optimizer=spec.optimizer.name,
                               activation_probe=lambda micro_batch_size: None).model_state_bytes

    try:
        full = state_bytes(meta_copy())
        lora = state_bytes(apply_lora(meta_copy(), LoRASpec(enabled=True, r=spec.lora.r, towers=spec.lora.towers)))
    except Exception:  # an optional figure: a model the copy or the estimator cannot take leaves the rule out
        return None
    return full / GB, lora / GB


def packing_refusal(trainer: Any) -> str | None:
    """Why packing would be refused for the trainer's model and data at both levels (vlmfast.data.packing_check,
    vlmfast.strategies.embedding_packing), None when it packs exactly, is already on, or the data cannot spare
    samples for the check."""
    return packing_offer(trainer)[0]


def packing_offer(trainer: Any) -> tuple[str | None, str]:
    """(why packing is refused or None, the level that packs exactly): ids where measured exact, else embeddings
    where that is, else the id-level refusal."""
    from vlmfast.data.packing import PackingError, build_packing_collator
    from vlmfast.data.packing_check import check_packing, probe_samples

    spec = trainer.spec
    if spec.packing.enabled or getattr(trainer, "train_data", None) is None:
        return None, "ids"
    model = trainer.engine.module
    try:
        collate = build_packing_collator(spec.packing, model, trainer.collate_fn, shift_labels=bool(
            trainer.accumulation.shift_labels), ignore_index=spec.loss.ignore_index)
        check_packing(model, probe_samples(trainer.train_data), collate, loss_fn=trainer.accumulation.loss_fn,
                      device=trainer.device)
    except PackingError as error:
        refusal = f"packing is refused for this model: {str(error).split(';')[0]}"
        return (None, "embeddings") if _packs_by_embeddings(trainer, model) else (refusal, "ids")
    return None, "ids"


def _packs_by_embeddings(trainer: Any, model: Any) -> bool:
    """Whether packing by embeddings is measured exact on the first training samples (the hooks removed after)."""
    from vlmfast.data.packing import PackingError
    from vlmfast.strategies.embedding_packing import EmbeddingPacking

    batch = trainer._probe_batch()
    if batch is None:
        return False
    packing = EmbeddingPacking(max_tokens=trainer.spec.packing.max_tokens)
    try:
        packing.install(model, batch)
        packing.check(model, batch)
    except PackingError:
        return False
    finally:
        packing.remove()
    return True


def _packing_evidence(trainer: Any) -> dict[str, Any]:
    refusal, level = packing_offer(trainer)
    return {"packing_refused": refusal, "packing_level": level}


def peek_lengths(loader: Any, micro_batch_size: int, batches: int = 4) -> tuple[float | None, float | None]:
    """(padded tokens per micro-batch, longest / median sample length) of the next few batches; position restored."""
    if not hasattr(loader, "state_dict"):
        return None, None
    import statistics

    state = loader.state_dict()
    lengths: list[int] = []
    widths: list[int] = []
    try:
        for _ in range(batches):
            batch = next(loader)
            mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
            if mask is None or mask.dim() != 2:
                return None, None
            lengths += [int(n) for n in mask.sum(-1).tolist()]
            widths.append(mask.shape[1])
    except StopIteration:
        pass
    finally:
        loader.load_state_dict(state)
    if not lengths:
        return None, None
    return micro_batch_size * statistics.mean(widths), max(lengths) / max(statistics.median(lengths), 1)


def _vision_frozen(model: Any, parts: Mapping[str, Any] | None = None) -> bool | None:
    """Whether the model's vision tower has no trainable parameter; None without one. The tower as the run's profiler
    learned it (`parts`, :func:`~vlmfast.profiling.phase_timer.find_submodules`), else by the stand-in
    ``get_image_features`` call (:func:`~vlmfast.common.image_path.find_image_modules`: nothing computed, so it is
    safe on a sharded model)."""
    from vlmfast.common.image_path import find_image_modules

    towers = (parts or {}).get("vision")
    if not towers:
        try:
            towers = (model.get_submodule(find_image_modules(model).tower),)
        except ValueError:
            return None
    return not any(p.requires_grad for tower in towers for p in tower.parameters())


def peek_padding(loader: Any, batches: int = 4) -> float | None:
    """Share of padding in the attention masks of the next few batches; the loader's position is restored."""
    if not hasattr(loader, "state_dict"):
        return None
    state = loader.state_dict()
    real = total = 0
    try:
        for _ in range(batches):
            batch = next(loader)
            mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
            if mask is None:
                return None
            real, total = real + int(mask.sum()), total + mask.numel()
    except StopIteration:
        pass
    finally:
        loader.load_state_dict(state)
    return 1.0 - real / total if total else None


# ---- one flag at a time ---------------------------------------------------------------------------------------
@dataclass
class FlagTrial:
    """A measured run with one change applied (or the baseline).

    ``speedup`` is baseline p50 step time / this p50 step time, per real token when the tokens in a step differ
    (the ratio of the printed tokens/s, both at the p50 step). ``startup_s`` is this run's one-off time beyond the
    baseline's (compile, autotuning: what its steps spent above its p50, warm-up included), and ``run_speedup`` the
    gain over the job's ``run_steps`` with it paid: baseline N x p50 / (start-up + N x p50, per the same tokens)."""

    label: str
    change: dict[str, Any]
    step_ms: float
    peak_memory_gb: float | None
    speedup: float = 1.0
    error: str | None = None
    tokens_per_s: float | None = None
    startup_s: float = 0.0
    run_speedup: float = 1.0
    run_steps: int | None = None
    not_measured: str | None = None  # why the trial was abandoned (over the trial limit), or None

    @property
    def advised(self) -> bool:
        """Faster over the whole job once its start-up is paid (the only gain a run gets)."""
        return self.error is None and self.not_measured is None and self.label != "baseline" \
            and self.run_speedup > 1.0

    @property
    def measured(self) -> bool:
        return self.error is None and self.not_measured is None


def one_flag_at_a_time(run: Callable[[TrainSpec], Evidence], spec: TrainSpec, findings: Sequence[Finding],
                       baseline: Evidence | None = None, limit_s: float | None = None) -> list[FlagTrial]:
    """Run the baseline and each finding's change alone. The speed-up is baseline p50 step time / changed p50 step
    time, per real token when both runs count tokens (a change such as packing puts more tokens in a step); the run
    speed-up also pays the change's start-up over the job's `spec.max_steps` steps (see :class:`FlagTrial`). A change
    whose run takes longer than `limit_s` (a compile with a cold cache) is abandoned: its row says not measured."""
    baseline = baseline or run(spec)
    steps = spec.max_steps
    base = FlagTrial("baseline", {}, baseline.step_ms, baseline.peak_memory_gb, tokens_per_s=_rate(baseline),
                     run_steps=steps)
    trials = [base]
    for finding in findings:
        if not finding.change or not finding.trial:
            continue
        label = ", ".join(_set_args(finding.change))
        try:
            with trial_budget(limit_s):
                measured = run(with_changes(spec, finding.change))
        except TrialBudgetExceeded as exc:
            trials.append(FlagTrial(label, finding.change, math.nan, None, math.nan, run_speedup=math.nan,
                                    run_steps=steps, not_measured=_over_the_limit(exc)))
            _forget_compiled_code()
            continue
        except Exception as exc:  # a flag that cannot run here is a result too, not the end of the table
            trials.append(FlagTrial(label, finding.change, math.nan, None, math.nan, f"{type(exc).__name__}: {exc}",
                                    run_speedup=math.nan, run_steps=steps))
            continue
        startup = max(0.0, (measured.startup_s or 0.0) - (baseline.startup_s or 0.0))
        trials.append(FlagTrial(label, finding.change, measured.step_ms, measured.peak_memory_gb,
                                _speedup(baseline, measured), tokens_per_s=_rate(measured), startup_s=startup,
                                run_speedup=_run_speedup(baseline, measured, startup, steps), run_steps=steps))
    return trials


def _over_the_limit(exc: TrialBudgetExceeded) -> str:
    return (f"{exc} (a start-up such as a compile with a cold cache; --trial-limit SECONDS waits longer, 0 for "
            "as long as it takes)")


def _forget_compiled_code() -> None:
    """After an abandoned trial: drop what dynamo compiled or began to, so the next trial starts clean."""
    import torch

    torch._dynamo.reset()


def _rate(ev: Evidence) -> float | None:
    """Real tokens per second at the p50 step (None when the run counted no tokens)."""
    return ev.tokens_per_step * 1e3 / ev.step_ms if ev.tokens_per_step and ev.step_ms > 0 else None


def _work_ratio(base: Evidence, measured: Evidence) -> float:
    """Steps of `measured` that do one baseline step's real tokens (1 when either counted none)."""
    if base.tokens_per_step and measured.tokens_per_step:
        return base.tokens_per_step / measured.tokens_per_step
    return 1.0


def _speedup(base: Evidence, measured: Evidence) -> float:
    if not measured.step_ms > 0:
        return math.nan
    return base.step_ms / (measured.step_ms * _work_ratio(base, measured))


def _run_speedup(base: Evidence, measured: Evidence, startup_s: float, steps: int) -> float:
    """The job's `steps` steps' time on the baseline / with the change (its start-up paid once), for the same
    real tokens."""
    if not measured.step_ms > 0:
        return math.nan
    changed = startup_s + steps * _work_ratio(base, measured) * measured.step_ms / 1e3
    return steps * base.step_ms / 1e3 / changed


def ranked_trials(trials: Sequence[FlagTrial]) -> list[FlagTrial]:
    """The baseline, then the changes by their gain over the whole job (start-up included), failed ones last."""
    base = [t for t in trials if t.label == "baseline"]
    ran = [t for t in trials if t.label != "baseline" and t.measured]
    failed = [t for t in trials if t.label != "baseline" and not t.measured]
    return base + sorted(ran, key=lambda t: -t.run_speedup if not math.isnan(t.run_speedup) else math.inf) + failed


def trial_advice(trials: Sequence[FlagTrial]) -> str:
    """The one change to try first, from the measurements the table shows; the baseline when none pays off."""
    best = next((t for t in ranked_trials(trials) if t.advised), None)
    steps = next((t.run_steps for t in trials if t.run_steps), None)
    over = f"the job's {steps} steps" if steps else "the job"
    if best is None:
        return f"advice: keep the baseline: no change measured faster over {over} once its start-up is counted"
    return (f"advice: try --set {' --set '.join(_set_args(best.change))} first: {best.run_speedup:.2f}x over {over}, "
            f"start-up included")


def format_trials(trials: Sequence[FlagTrial]) -> str:
    """The one-flag-at-a-time table, best gain over the job first, with the definitions and the advice under it."""
    steps = next((t.run_steps for t in trials if t.run_steps), None)
    over = f"{steps} steps" if steps else "the job"
    lines = [f"{'change':<44} {'step p50 ms':>11} {'tokens/s':>9} {'speed-up':>9} {'start-up s':>10} "
             f"{'over ' + over:>15} {'peak GiB':>9}"]
    for trial in ranked_trials(trials):
        peak = f"{trial.peak_memory_gb:.2f}" if trial.peak_memory_gb is not None else "-"
        rate = f"{trial.tokens_per_s:.0f}" if trial.tokens_per_s else "-"
        if trial.error:
            lines.append(f"{trial.label:<44} failed: {trial.error}")
        elif trial.not_measured:
            lines.append(f"{trial.label:<44} not measured: {trial.not_measured}")
        else:
            lines.append(f"{trial.label:<44} {trial.step_ms:>11.1f} {rate:>9} {trial.speedup:>8.2f}x "
                         f"{trial.startup_s:>10.1f} {trial.run_speedup:>14.2f}x {peak:>9}")
    lines += [
        "step p50: median of the timed steps (after the warm-up); tokens: real (non-padding) input tokens; "
        "tokens/s = real tokens per step / step p50",
        "speed-up: baseline step p50 / this step p50, per real token when a step holds more (= the ratio of the "
        "tokens/s)",
        f"start-up: one-off time beyond the baseline's (compile, autotuning: the steps' time above their p50); over "
        f"{over}: baseline time / (start-up + this p50 x the steps), for the job's max_steps",
        trial_advice(trials),
    ]
    return "\n".join(lines)


def rank_findings(findings: Sequence[Finding], trials: Sequence[FlagTrial]) -> list[Finding]:
    """The findings re-ranked by what their change measured (doctor --apply): changes faster over the whole job
    first (best gain first), then the ones not measured, then those measured no faster or failing; each measured
    finding says its figures, so no advice contradicts the table."""
    by_change = {tuple(sorted(t.change.items(), key=str)): t for t in trials if t.label != "baseline"}
    winners, unmeasured, losers = [], [], []
    for finding in findings:
        trial = by_change.get(tuple(sorted(finding.change.items(), key=str))) if finding.change else None
        if trial is None:
            unmeasured.append(finding)
            continue
        finding.measured = _measured_text(trial)
        (winners if trial.advised else losers).append((trial, finding))
    winners.sort(key=lambda pair: -pair[0].run_speedup)
    return [f for _, f in winners] + unmeasured + [f for _, f in losers]


def _measured_text(trial: FlagTrial) -> str:
    if trial.error:
        return f"failed ({trial.error}): not advised"
    if trial.not_measured:
        return f"not measured: {trial.not_measured}"
    over = f"the job's {trial.run_steps} steps" if trial.run_steps else "the job"
    verdict = "advised" if trial.advised else "not advised"
    return (f"{trial.speedup:.2f}x per step (p50 {trial.step_ms:.1f} ms), {trial.run_speedup:.2f}x over {over} with "
            f"{trial.startup_s:.1f} s start-up: {verdict}")


def _excluded(row: Mapping[str, Any]) -> bool:
    """A timed step the profiler left out of its statistics (traced, or FLOPs counted)."""
    return bool(row.get("perf/traced") or row.get("perf/excluded"))
