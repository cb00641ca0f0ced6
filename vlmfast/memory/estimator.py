"""Will this training fit on my GPU, and if not, which spec changes make it fit.

Usage::

    from vlmfast.memory.known_models import estimate_from_hf_config
    est = estimate_from_hf_config("llava-1.5-7b", micro_batch_size=4, gpu_memory_gb=24)   # no download: meta device
    print(est.to_table())
    print(est.cheapest_fixes())     # ['micro_batch_size: 1 ...', 'activation_checkpointing.enabled: true', ...]

    est = estimate_memory(model, activation_probe=lambda mbs: model(**make_batch(mbs)).loss, gpu_memory_gb=80)

Memory per GPU = model states (weights, gradients, optimizer states; per component, sharded by ZeRO) + activations
(measured: the bytes autograd saves for backward during one small probe forward pass, scaled to the micro-batch).
This module holds the core: results, components and the estimate itself. The rest:

- ``vlmfast.memory.options``: ``EstimateOptions`` and bytes per parameter (``optimizer_state_bytes``, re-exported
  here);
- ``vlmfast.memory.zero``: DeepSpeed's ZeRO formulas and how each stage shards the model states;
- ``vlmfast.memory.activations``: measuring what autograd saves, the built-in probes, checkpointing;
- ``vlmfast.memory.fixes``: the cheapest spec changes that make an estimate fit;
- ``vlmfast.memory.known_models``: ``KNOWN_CONFIGS``, ``estimate_from_hf_config`` (meta-device models);
- ``vlmfast.memory.estimate_cli``: ``vlmfast estimate-memory``.

Bytes per parameter. A trainable parameter costs, with AdamW:

====================================  =======  =====  ====================  =====
precision                             weights  grads  optimizer             total
====================================  =======  =====  ====================  =====
fp32                                  4        4      8 (m, v)              16
bf16/fp16 mixed (the default)         2        2      12 (fp32 master 4,    16
                                                      m 4, v 4)
bf16/fp16, ``master_weights=False``   2        2      4 (m, v in 16 bits)   8
====================================  =======  =====  ====================  =====

The mixed row is the ZeRO paper's 2 + 2 + K (K = 12) that DeepSpeed's accounting starts from. The last row is the
reference guide's accounting ("optimizer = 2 x M_params", everything in 16 bits): it reproduces the guide's LLaVA-7B
figures (14.6 + 14.6 + 28 GB). A frozen parameter (``requires_grad`` False, or named in ``frozen``) costs its
weights only. Other optimizers: SGD without momentum has no state, with momentum one; Adafactor keeps a row and a
column second-moment vector per matrix (exact sizes from the shapes: a few thousand floats where AdamW keeps
millions) and a full one per vector; 8-bit AdamW (bitsandbytes) keeps m and v in one byte each for tensors of 4096+
elements and in 32 bits below that, as bitsandbytes does.

Activations (``vlmfast.memory.activations``) leave out transient backward buffers (a layer's gradient temporaries,
the logits' gradient), and nothing counts allocator fragmentation, which is why ``fits`` keeps 10% headroom.

GB in this module means GiB (1024**3 bytes), as ``torch.cuda`` reports memory; the reference guide's "GB" is 1e9.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from vlmfast.common.module_tree import matches
from vlmfast.common.utils import PRECISION_DTYPES
from vlmfast.memory.activations import (
    ModelProbe,
    _accepts_seq_len,
    _batch_probe,
    _first_param,
    _Measurement,
    default_activation_probe,
    measure_saved_activations,
)
from vlmfast.memory.fixes import FixPlan, plan_fixes
from vlmfast.memory.options import (
    EstimateOptions,
    OptimizerName,
    Precision,
    StateBytes,
    optimizer_state_bytes,
)
from vlmfast.memory.zero import DS_BUFFER_FACTOR, _largest_layer_params, _shard

__all__ = [
    "ComponentMemory",
    "EstimateOptions",
    "MemoryEstimate",
    "assign_components",
    "component_of",
    "estimate_memory",
    "optimizer_state_bytes",
]

GB = 1024**3
HEADROOM = 0.10  # CUDA context, allocator fragmentation, backward temporaries; the guide alerts at 90% too
PROBE_BATCH_SIZES = (1, 2)

# Component names by module-path segment; the projector is looked for first (Qwen2-VL's merger sits inside
# `visual`), then the vision tower; everything else is the language model (embeddings, layers, norm, lm_head).
PROJECTOR_SEGMENTS = ("multi_modal_projector", "mm_projector", "projector", "connector", "merger", "aligner")
VISION_SEGMENTS = ("vision_tower", "vision_model", "visual", "vision_encoder", "image_encoder", "vision")
DEFAULT_COMPONENT = "language_model"
COMPONENT_ORDER = ("vision_tower", "projector", "language_model")


# ----------------------------------------------------------------------------------------------------------------
# options and results


@dataclass(frozen=True)
class ComponentMemory:
    """One component's parameters and its per-GPU model-state bytes (``optimizer`` includes ``master``).

    Usage: ``est.component("vision_tower").grads``
    """

    name: str
    params: int
    trainable: int
    weights: int
    grads: int
    optimizer: int
    master: int = 0
    roots: tuple[str, ...] = ()

    @property
    def total(self) -> int:
        """Per-GPU bytes of this component's model states."""
        return self.weights + self.grads + self.optimizer


@dataclass
class MemoryEstimate:
    """Per-GPU memory of one training configuration, by component; ``to_table()`` prints it.

    Usage: ``est.gpu_bytes / 2**30``, ``est.fits(80)``, ``est.cheapest_fixes(24)``, ``est.reestimate(zero_stage=3)``
    """

    options: EstimateOptions
    components: list[ComponentMemory]
    activation_bytes: int
    zero3_gathered_bytes: int
    cpu_bytes: int
    largest_layer_params: int
    seq_len: int | None = None
    activations_measured: bool = True  # False when not measured, or measured on text only for a VLM
    activations_text_only: bool = False  # the built-in probe ran a VLM without images: a lower bound
    gpu_memory_gb: float | None = None
    notes: list[str] = field(default_factory=list)
    _reestimate: Callable[[EstimateOptions], MemoryEstimate] | None = field(default=None, repr=False, compare=False)

    @property
    def params(self) -> int:
        """All parameters."""
        return sum(c.params for c in self.components)

    @property
    def trainable_params(self) -> int:
        """Parameters that get gradients and optimizer states."""
        return sum(c.trainable for c in self.components)

    @property
    def model_state_bytes(self) -> int:
        """Per-GPU weights + gradients + optimizer states, plus ZeRO-3's gathered layer."""
        return sum(c.total for c in self.components) + self.zero3_gathered_bytes

    @property
    def gpu_bytes(self) -> int:
        """Per-GPU total: model states and activations."""
        return self.model_state_bytes + self.activation_bytes

    def component(self, name: str) -> ComponentMemory:
        """The row of one component ('vision_tower', 'projector', 'language_model', or a custom name)."""
        for row in self.components:
            if row.name == name:
                return row
        raise KeyError(f"no component {name!r}; components: {[c.name for c in self.components]}")

    def usable_bytes(self, gpu_memory_gb: float | None = None, headroom: float = HEADROOM) -> int:
        """The part of the GPU the estimate may fill: capacity minus headroom."""
        return int(self._gpu_gb(gpu_memory_gb) * GB * (1 - headroom))

    def fits(self, gpu_memory_gb: float | None = None, headroom: float = HEADROOM) -> bool:
        """Whether the per-GPU total fits the GPU (GiB) with ``headroom`` (a fraction) left free."""
        return self.gpu_bytes <= self.usable_bytes(gpu_memory_gb, headroom)

    def reestimate(self, **changes: Any) -> MemoryEstimate:
        """The same model and probe with some options changed (``EstimateOptions`` field names)."""
        if self._reestimate is None:
            raise RuntimeError("this estimate was not made by estimate_memory and cannot be re-run")
        if "frozen" in changes:
            changes["frozen"] = tuple(changes["frozen"])
        return self._reestimate(dataclasses.replace(self.options, **changes))

    def plan_fixes(self, gpu_memory_gb: float | None = None) -> FixPlan[MemoryEstimate]:
        """Spec changes in the reference guide's priority order, applied cumulatively until the estimate fits."""
        return plan_fixes(self, self._gpu_gb(gpu_memory_gb))

    def cheapest_fixes(self, gpu_memory_gb: float | None = None) -> list[str]:
        """The spec changes of ``plan_fixes``; empty if it fits already. Ends with a warning line if even they fail."""
        plan = self.plan_fixes(gpu_memory_gb)
        if plan.fits:
            return plan.changes
        short = (plan.estimate.gpu_bytes - plan.estimate.usable_bytes(self._gpu_gb(gpu_memory_gb))) / GB
        return [*plan.changes, f"still {short:.1f} GiB over with all of these: more GPUs (world_size with ZeRO-3), "
                               "a shorter sequence, or a larger GPU"]

    def to_table(self) -> str:
        """A text table in GiB: rows per component, activations, totals, and the verdict when a GPU size is known."""
        return _format_table(self)

    def _gpu_gb(self, gpu_memory_gb: float | None) -> float:
        gpu = gpu_memory_gb if gpu_memory_gb is not None else self.gpu_memory_gb
        if gpu is None:
            raise ValueError("no GPU size: pass gpu_memory_gb (GiB)")
        return gpu


# ----------------------------------------------------------------------------------------------------------------
# components and bytes per parameter


def _segment_root(name: str, segments: Sequence[str]) -> str | None:
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):  # the last part is the parameter's own name
        if part in segments:
            return ".".join(parts[: i + 1])
    return None


def component_of(name: str, components: Mapping[str, Sequence[str]] | None = None) -> tuple[str, str]:
    """(component, module root) of a parameter or module path; root '' for the language-model fallback.

    Usage: ``component_of("model.vision_tower.vision_model.embeddings.patch_embedding.weight")``
    -> ``('vision_tower', 'model.vision_tower')``
    """
    if components is not None:
        for comp, paths in components.items():
            for path in paths:
                if matches(name, path):
                    return comp, path
        return "other", ""
    for comp, segments in (("projector", PROJECTOR_SEGMENTS), ("vision_tower", VISION_SEGMENTS)):
        root = _segment_root(name, segments)
        if root is not None:
            return comp, root
    return DEFAULT_COMPONENT, ""


def assign_components(
    model: nn.Module, components: Mapping[str, Sequence[str]] | None = None
) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """Parameters (shared ones once) grouped by component, in vision -> projector -> language model order.

    Usage: ``{name: len(ps) for name, ps in assign_components(model).items()}``
    """
    groups: dict[str, list[tuple[str, nn.Parameter]]] = {}
    for name, param in model.named_parameters():
        groups.setdefault(component_of(name, components)[0], []).append((name, param))
    order = list(components) if components is not None else list(COMPONENT_ORDER)
    return dict(sorted(groups.items(), key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)))


# ----------------------------------------------------------------------------------------------------------------
# the estimate


@dataclass
class _Context:
    """What stays fixed across re-estimates: the model, its components, the probe and measured activations."""

    model: nn.Module
    groups: dict[str, list[tuple[str, nn.Parameter]]]
    components: Mapping[str, Sequence[str]] | None
    probe: Callable[..., Any] | None
    probe_is_default: bool
    gpu_memory_gb: float | None
    largest_layer: int
    cache: dict[tuple[Any, ...], _Measurement] = field(default_factory=dict)


def estimate_memory(
    model: nn.Module,
    *,
    precision: Precision = "bf16",
    optimizer: OptimizerName = "adamw",
    micro_batch_size: int = 1,
    seq_len: int | None = None,
    world_size: int = 1,
    zero_stage: int = 0,
    offload_optimizer: bool = False,
    offload_params: bool = False,
    activation_checkpointing: bool | str = False,
    components: Mapping[str, Sequence[str]] | None = None,
    frozen: Sequence[str] = (),
    activation_probe: Callable[..., Any] | Any | None = None,
    gpu_memory_gb: float | None = None,
    master_weights: bool = True,
    gpus_per_node: int | None = None,
    linear_cross_entropy: bool = False,
    checkpoint_budget_gb: float | None = None,
    micro_batch_tokens: int | None = None,
) -> MemoryEstimate:
    """Per-GPU memory of training ``model`` with these settings (see the module docstring for the accounting).

    Usage: ``estimate_memory(model, micro_batch_size=8, activation_probe=lambda mbs: model(**batch(mbs)).loss)``

    ``components`` maps names to module paths/globs (default: vision tower, projector, language model by module
    name). ``frozen`` names components or module paths whose parameters get no gradients or optimizer states, on
    top of those with ``requires_grad`` False. ``activation_probe``: a callable ``(micro_batch_size[, seq_len]) ->
    loss`` or an example batch for ``model``; it runs a forward at micro-batch 1 and 2 (free on the meta device).
    Without one, vlmfast's tiny VLM and Hugging Face LLaVA / causal LMs get a built-in probe when on the meta device
    or small; other models are estimated without activations (the table says so). ``linear_cross_entropy``: the
    built-in probes compute their loss chunked (no logits kept); ``checkpoint_budget_gb``: the blocks the budget
    planner would checkpoint (``activation_checkpointing.budget_gb``); ``micro_batch_tokens``: rows per micro-batch
    = tokens // sequence length (``micro_batch_size`` is then ignored for activations).
    """
    frozen = (frozen,) if isinstance(frozen, str) else frozen
    opts = EstimateOptions(
        precision=precision, optimizer=optimizer, micro_batch_size=micro_batch_size, seq_len=seq_len,
        world_size=world_size, zero_stage=zero_stage, offload_optimizer=offload_optimizer,
        offload_params=offload_params, activation_checkpointing=activation_checkpointing, frozen=tuple(frozen),
        master_weights=master_weights, gpus_per_node=gpus_per_node, linear_cross_entropy=linear_cross_entropy,
        checkpoint_budget_gb=checkpoint_budget_gb, micro_batch_tokens=micro_batch_tokens,
    )
    probe, is_default = activation_probe, False
    if probe is not None and not callable(probe):
        probe = _batch_probe(model, probe)
    if probe is None and _cheap_to_probe(model):
        base = model.get_base_model() if hasattr(model, "peft_config") else model  # LoRA: the adapted model runs
        probe, is_default = default_activation_probe(base), True
    ctx = _Context(model, assign_components(model, components), components, probe, is_default, gpu_memory_gb,
                   _largest_layer_params(model))
    return _estimate(ctx, opts)


def _cheap_to_probe(model: nn.Module) -> bool:
    first = _first_param(model)
    return first.device.type == "meta" or sum(p.numel() for p in model.parameters()) <= 200_000_000


def _frozen_names(ctx: _Context, opts: EstimateOptions) -> set[str]:
    names = {n for params in ctx.groups.values() for n, p in params if not p.requires_grad}
    for pattern in opts.frozen:
        hits = {n for comp, params in ctx.groups.items() for n, _ in params if comp == pattern or matches(n, pattern)}
        if not hits:
            raise ValueError(f"frozen: {pattern!r} matches no component {sorted(ctx.groups)} and no parameter")
        names |= hits
    return names


def _estimate(ctx: _Context, opts: EstimateOptions) -> MemoryEstimate:
    frozen = _frozen_names(ctx, opts)
    rows, host = [], 0
    for comp, params in ctx.groups.items():
        unsharded = StateBytes()
        for name, param in params:
            unsharded.add_param(param.shape, name not in frozen, opts)
        weights, grads, optim, offloaded = _shard(unsharded, opts)
        host += offloaded
        trainable = sum(p.numel() for n, p in params if n not in frozen)
        master = round(unsharded.master / opts.world_size) if opts.zero_stage else unsharded.master
        rows.append(ComponentMemory(
            comp, sum(p.numel() for _, p in params), trainable, weights, grads, optim,
            0 if opts.offload_optimizer else master,
            tuple(sorted({component_of(n, ctx.components)[1] for n, _ in params} - {""})),
        ))
    unit = 2 if opts.mixed else 4
    gathered = 2 * unit * ctx.largest_layer if opts.zero_stage == 3 else 0  # its weights and gradients
    activations, seq_len, notes = _activations(ctx, opts, frozen)
    return MemoryEstimate(
        options=opts, components=rows, activation_bytes=activations, zero3_gathered_bytes=gathered,
        cpu_bytes=round(host * opts.ranks_per_node * DS_BUFFER_FACTOR), largest_layer_params=ctx.largest_layer,
        seq_len=seq_len, activations_measured=ctx.probe is not None and getattr(ctx.probe, "includes_images", True),
        activations_text_only=ctx.probe is not None and not getattr(ctx.probe, "includes_images", True),
        gpu_memory_gb=ctx.gpu_memory_gb, notes=notes,
        _reestimate=lambda new: _estimate(ctx, new),
    )


@contextlib.contextmanager
def _as_trained(model: nn.Module, precision: str, frozen: Sequence[nn.Parameter]) -> Iterator[None]:
    """Train mode, frozen parameters frozen, and the training precision: a cast on meta, autocast otherwise."""
    was_training = model.training
    flags = [(p, p.requires_grad) for p in frozen]
    first = _first_param(model)
    original, dtype = first.dtype, PRECISION_DTYPES[precision]  # read before a cast changes `first` in place
    model.train()
    for param, _ in flags:
        param.requires_grad_(False)
    try:
        if first.device.type == "meta" and original != dtype:
            # Meta tensors hold no data: casting there and back is free and exact.
            model.to(dtype)
            try:
                yield
            finally:
                model.to(original)
        elif precision != "fp32" and first.dtype == torch.float32:
            with torch.autocast(first.device.type, dtype=dtype):
                yield
        else:
            yield
    finally:
        model.train(was_training)
        for param, flag in flags:
            param.requires_grad_(flag)


def _probe_call(ctx: _Context, opts: EstimateOptions, mbs: int) -> Callable[[], Any]:
    takes_seq_len = _accepts_seq_len(ctx.probe) and opts.seq_len is not None  # None: the probe's own length
    chunked = opts.linear_cross_entropy and isinstance(ctx.probe, ModelProbe)
    if chunked:
        return lambda: ctx.probe(mbs, seq_len=opts.seq_len, chunked_loss=True)
    return (lambda: ctx.probe(mbs, seq_len=opts.seq_len)) if takes_seq_len else (lambda: ctx.probe(mbs))


def _measure(ctx: _Context, opts: EstimateOptions, frozen: set[str], mbs: int, *, blocks: bool = False) -> Any:
    """What the probe saves at micro-batch ``mbs`` (``blocks``: per-block costs for the budget planner)."""
    takes_seq_len = _accepts_seq_len(ctx.probe) and opts.seq_len is not None
    chunked = opts.linear_cross_entropy and isinstance(ctx.probe, ModelProbe)
    key = (opts.precision, frozenset(frozen), opts.seq_len if takes_seq_len else None, mbs, chunked, blocks)
    if key not in ctx.cache:
        params = [p for group in ctx.groups.values() for n, p in group if n in frozen]
        call = _probe_call(ctx, opts, mbs)
        with _as_trained(ctx.model, opts.precision, params):
            if blocks:
                from vlmfast.memory.checkpoint_budget import measure_block_costs

                ctx.cache[key] = measure_block_costs(ctx.model, call)
            else:
                ctx.cache[key] = measure_saved_activations(ctx.model, call)
    return ctx.cache[key]


def _rows(ctx: _Context, opts: EstimateOptions, notes: list[str]) -> int:
    """Rows per micro-batch: micro_batch_size, or micro_batch_tokens // the sequence length (the longest sample)."""
    if opts.micro_batch_tokens is None:
        return opts.micro_batch_size
    seq_len = opts.seq_len or (ctx.probe.default_seq_len if isinstance(ctx.probe, ModelProbe) else None)
    if seq_len is None:
        notes.append("micro_batch_tokens ignored: the probe has no sequence length (pass seq_len)")
        return opts.micro_batch_size
    rows = max(opts.micro_batch_tokens // seq_len, 1)
    notes.append(f"micro_batch_tokens {opts.micro_batch_tokens}: {rows} row(s) of the longest sample "
                 f"({seq_len} tokens) per micro-batch; shorter samples go more at a time in the same memory")
    return rows


def _budget_activations(ctx: _Context, opts: EstimateOptions, frozen: set[str], rows: int,
                        notes: list[str]) -> int:
    """The backward peak of the plan activation_checkpointing.budget_gb would choose at ``rows`` per micro-batch."""
    from vlmfast.memory.checkpoint_budget import plan_checkpointing

    small, large = (_measure(ctx, opts, frozen, b, blocks=True) for b in PROBE_BATCH_SIZES)
    costs = large.extrapolate(small, rows, this_at=PROBE_BATCH_SIZES[1], other_at=PROBE_BATCH_SIZES[0])
    towers = {"all": ("vision", "language"), "vision": ("vision",), "language_model": ("language",)}[
        opts.checkpoint_scope or "all"]
    plan = plan_checkpointing(costs, int(opts.checkpoint_budget_gb * GB), towers=towers)
    notes.append(f"activation_checkpointing.budget_gb {opts.checkpoint_budget_gb:g}: {plan.describe()}")
    return plan.peak_bytes


def _activations(ctx: _Context, opts: EstimateOptions, frozen: set[str]) -> tuple[int, int | None, list[str]]:
    """(bytes at the requested micro-batch, sequence length measured at, notes)."""
    if ctx.probe is None:
        return 0, opts.seq_len, ["activations not included: pass activation_probe (a callable or a batch)"]
    notes: list[str] = []
    if opts.linear_cross_entropy:
        notes.append("linear_cross_entropy: the loss path keeps no logits" if isinstance(ctx.probe, ModelProbe) else
                     "linear_cross_entropy not reflected: a custom probe computes its own loss")
    rows = _rows(ctx, opts, notes)
    sizes = tuple(getattr(ctx.probe, "probe_sizes", PROBE_BATCH_SIZES))  # a real batch: half of it and all of it
    try:
        measured = [_measure(ctx, opts, frozen, b) for b in sizes]
        budget = _budget_activations(ctx, opts, frozen, rows, notes) if opts.checkpoint_budget_gb else None
    except Exception as exc:
        if not ctx.probe_is_default or isinstance(exc, ValueError):  # a bad seq_len is the caller's to fix
            raise
        return 0, opts.seq_len, [f"activations not included: the built-in probe failed ({type(exc).__name__}: {exc})"]
    scope = opts.checkpoint_scope
    if scope is None:
        counts = [m.full() for m in measured]
    else:
        selected = {i for i, path in enumerate(measured[0].block_paths) if _in_scope(path, scope, ctx.components)}
        counts = [m.checkpointed(selected) for m in measured]
    # Linear in the micro-batch: per-sample slope plus what does not grow with it (e.g. autocast's weight copies).
    slope = max(counts[-1] - counts[0], 0) / (sizes[-1] - sizes[0]) if len(sizes) > 1 else 0.0
    fixed = counts[0] - slope * sizes[0]
    if fixed < 0 or len(sizes) == 1:
        # Real samples differ (a text-only half, a two-image half): when the two points do not fit a line through
        # a positive fixed part, the whole measurement's per-sample average is the better guess.
        slope, fixed = counts[-1] / sizes[-1], 0.0
    total = round(fixed + slope * rows) if budget is None else budget
    if not getattr(ctx.probe, "includes_images", True):
        notes.append("activations measured on text only: the images' share is not included (pass activation_probe="
                     "a real batch, images included)")
    seq_len = opts.seq_len
    if isinstance(ctx.probe, ModelProbe):
        seq_len = opts.seq_len or ctx.probe.default_seq_len
    elif opts.seq_len is not None and not _accepts_seq_len(ctx.probe):
        base = getattr(ctx.probe, "seq_len", None)
        if base:
            total = round(total * opts.seq_len / base)
            notes.append(f"activations scaled linearly from the probe's seq_len {base} to {opts.seq_len}: "
                         "attention that materialises scores (eager, no flash/SDPA) grows quadratically")
        else:
            notes.append("seq_len ignored: the probe takes no seq_len and has no .seq_len to scale from")
    return total, seq_len, notes


def _in_scope(path: str, scope: str, components: Mapping[str, Sequence[str]] | None) -> bool:
    if scope == "all":
        return True
    comp = component_of(f"{path}.weight", components)[0]
    return comp == ("vision_tower" if scope == "vision" else DEFAULT_COMPONENT)


# ----------------------------------------------------------------------------------------------------------------
# the table


def _count(n: int) -> str:
    for unit, scale in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f}{unit}" if unit == "B" else f"{n / scale:.1f}{unit}"
    return str(n)


def _gib(n: float) -> str:
    return f"{n / GB:.2f}"


def _unit(est: MemoryEstimate) -> tuple[str, float]:
    # MiB for small models, where every GiB figure would read 0.00.
    return ("GiB", GB) if est.gpu_bytes >= GB else ("MiB", 1024**2)


def _describe(est: MemoryEstimate) -> str:
    o = est.options
    if o.mixed:
        prec = f"{o.precision} mixed, " + ("fp32 master weights" if o.master_weights else "no fp32 master (16-bit all)")
    else:
        prec = "fp32"
    zero = f"ZeRO-{o.zero_stage}" if o.zero_stage else "no ZeRO"
    offload = [w for w, on in (("optimizer", o.offload_optimizer), ("params", o.offload_params)) if on]
    zero += f" (offload {' + '.join(offload)})" if offload else ""
    seq = f" x seq {est.seq_len}" if est.seq_len else ""
    ckpt = f", checkpointing {o.checkpoint_scope}" if o.checkpoint_scope else ""
    ckpt = f", checkpointing budget {o.checkpoint_budget_gb:g} GiB" if o.checkpoint_budget_gb else ckpt
    ckpt += ", chunked cross-entropy" if o.linear_cross_entropy else ""
    mbs = f"{o.micro_batch_tokens} tokens" if o.micro_batch_tokens else f"{o.micro_batch_size}"
    return f"{prec}, {o.optimizer}, micro-batch {mbs}{seq}, {o.world_size} GPU(s), {zero}{ckpt}"


def _format_table(est: MemoryEstimate) -> str:
    unit, scale = _unit(est)

    def size(n: float) -> str:
        return f"{n / scale:.2f}"

    head = f"{'component':<16}{'params':>10}{'trainable':>11}{'weights':>10}{'grads':>10}{'optimizer':>11}{'total':>10}"
    lines = [f"memory estimate per GPU ({unit}): {_describe(est)}", head, "-" * len(head)]
    for c in est.components:
        lines.append(f"{c.name:<16}{_count(c.params):>10}{_count(c.trainable):>11}{size(c.weights):>10}"
                     f"{size(c.grads):>10}{size(c.optimizer):>11}{size(c.total):>10}")
    width = len(head) - 10

    def row(label: str, value: float) -> str:
        return f"{label:<{width}}{size(value):>10}"

    if est.zero3_gathered_bytes:
        lines.append(row(f"ZeRO-3 gathered layer ({_count(est.largest_layer_params)} params)",
                         est.zero3_gathered_bytes))
    what = ("saved for backward, measured" if est.activations_measured
            else "text only, images not measured" if est.activations_text_only else "not measured")
    lines.append(row(f"activations ({what})", est.activation_bytes))
    lines += ["-" * len(head), row("total per GPU", est.gpu_bytes)]
    if est.cpu_bytes:
        lines.append(row("host RAM per node (offload, x1.5 buffers)", est.cpu_bytes))
    lines += [f"note: {note}" for note in est.notes]
    if est.gpu_memory_gb is not None:
        verdict = "fits" if est.fits() else "does NOT fit"
        lines.append(f"GPU {est.gpu_memory_gb:g} GiB: {verdict} ({_gib(est.gpu_bytes)} GiB needed, "
                     f"{_gib(est.usable_bytes())} GiB usable with {HEADROOM:.0%} headroom)")
    return "\n".join(lines)
