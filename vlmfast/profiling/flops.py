"""FLOPs per training step and MFU: measured by torch's FlopCounterMode once per batch shape, or by formula.

Usage::

    meter = FlopsMeter(model)                          # method="measured" (default) or "analytic"
    with meter.count(micro_batch):                     # FlopCounterMode the first time this shape is seen
        loss = model(**move_to_device(micro_batch, device)).loss
        loss.backward()
    step_flops = meter.flops(micro_batch)              # model FLOPs of that forward + backward
    mfu = step_flops / step_time / 1e12 / peak_tflops(device, "bf16")

What is counted (DESIGN.md): the vision tower too, frozen towers forward only (measured: autograd does not run
their backward; analytic: 2N instead of 6N per token), and real tokens only: the language model's FLOPs are
scaled by its share of unpadded tokens (the attention mask). Measured counts are what torch executes for matmuls,
convolutions and attention kernels (FlopCounterMode's registry); with activation checkpointing they include the
recomputed forward (hardware FLOPs), the analytic formula never does (model FLOPs, as nanoGPT and torchtitan count).
The analytic formula: 6·N per token (2·N frozen) + 12·L·H·d·S per token for attention, per tower, N without
embedding tables (a lookup is not a matmul).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from vlmfast.profiling.phase_timer import Parts, find_submodules

__all__ = [
    "PEAK_TFLOPS",
    "FlopsMeter",
    "TowerShape",
    "analytic_flops",
    "measure_flops",
    "peak_tflops",
    "shape_key",
    "transformer_flops",
]

# Dense (no sparsity) peak TFLOP/s from the vendors' data sheets: {name fragment: {precision: TFLOP/s}}. fp32 means
# plain fp32 (TF32 off); "tf32" is what fp32 matmuls reach with TF32 on. Matched against
# torch.cuda.get_device_name() in order, so longer names (H100 PCIe) come before shorter ones (H100).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0},
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 417.5, "fp32": 60.0},
    "H100": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},  # SXM
    "H800": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "GH200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A800": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.1, "fp16": 362.1, "tf32": 183.0, "fp32": 91.6},
    "L40": {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "A6000": {"bf16": 154.8, "fp16": 154.8, "tf32": 77.4, "fp32": 38.7},
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},
    "RTX 3090": {"bf16": 71.0, "fp16": 71.0, "tf32": 35.6, "fp32": 35.6},
    "V100": {"fp16": 125.0, "fp32": 15.7},
    "T4": {"fp16": 65.0, "fp32": 8.1},
    "MI300X": {"bf16": 1307.4, "fp16": 1307.4, "tf32": 653.7, "fp32": 163.4},
    "MI250X": {"bf16": 383.0, "fp16": 383.0, "fp32": 95.7},
}


def peak_tflops(device: torch.device | str, precision: str = "fp32", tf32: bool = False,
                override: float | None = None, device_name: str | None = None) -> float | None:
    """The device's dense peak TFLOP/s at `precision` (override wins); None on CPU or for an unknown GPU."""
    if override is not None:
        return override
    device = torch.device(device)
    if device.type != "cuda" and device_name is None:
        return None
    name = device_name or torch.cuda.get_device_name(device)
    key = "tf32" if precision == "fp32" and tf32 else precision
    for fragment, peaks in PEAK_TFLOPS.items():
        if fragment.lower() in name.lower():
            return peaks.get(key, peaks.get("fp32"))
    return None


# ---- measured -----------------------------------------------------------------------------------------------
@dataclass
class MeasuredFlops:
    """FLOPs of one forward+backward: the total and per sub-model (`vision`, `projector`, `language_model`)."""

    total: float
    by_role: dict[str, float]
    lm_tokens: int | None = None  # tokens (padded) the language model ran on, for the real-token correction


def measure_flops(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> float:
    """FLOPs torch executes in ``fn(*args, **kwargs)`` (e.g. a forward + backward), by FlopCounterMode."""
    with FlopCounterMode(display=False) as mode:
        fn(*args, **kwargs)
    return float(mode.get_total_flops())


def shape_key(batch: Any) -> tuple:
    """The shape bucket of a batch: the shapes and dtypes of its tensors (what determines the FLOPs)."""
    if isinstance(batch, torch.Tensor):
        return (tuple(batch.shape), str(batch.dtype))
    if isinstance(batch, Mapping):
        return tuple((key, shape_key(value)) for key, value in sorted(batch.items(), key=lambda kv: str(kv[0])))
    if isinstance(batch, (list, tuple)):
        # Host metadata (e.g. packing's per-row document_lengths, plain ints) does not change what runs: without
        # this, every new document layout would count as a new shape and be measured again.
        return tuple(shape_key(value) for value in batch) if any(_holds_tensor(v) for v in batch) else ()
    return ()


def _holds_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, Mapping):
        return any(_holds_tensor(v) for v in value.values())
    return isinstance(value, (list, tuple)) and any(_holds_tensor(v) for v in value)


def _count_flash_attn_ops() -> None:
    """flash-attn's kernels are custom ops FlopCounterMode cannot see into: give it their formulas (when installed)."""
    from vlmfast.attention.backends import flash_attn_installed

    if not flash_attn_installed():
        return
    try:
        import flash_attn  # noqa: F401  (registers torch.ops.flashattn.*)
    except ImportError:
        return
    from vlmfast.profiling.flash_flops import register_flash_attn_flops

    register_flash_attn_flops()


def real_token_fraction(batch: Any, lm_tokens: int | None) -> float:
    """Share of the language model's tokens that are not padding, from the attention mask (1.0 without one)."""
    mask = batch.get("attention_mask") if isinstance(batch, Mapping) else None
    if not isinstance(mask, torch.Tensor) or mask.numel() == 0:
        return 1.0
    padding = mask.numel() - int(mask.sum())  # call on the host batch: no device sync
    total = lm_tokens if lm_tokens and lm_tokens >= mask.numel() else mask.numel()
    return 1.0 - padding / total


class FlopsMeter:
    """Model FLOPs per micro-batch, measured once per shape bucket (or by formula); see the module docstring."""

    def __init__(self, model: nn.Module, method: str = "measured", per_shape: bool = False,
                 parts: Parts | None = None) -> None:
        if method not in ("auto", "measured", "analytic"):
            raise ValueError(f"profile.flops must be 'auto', 'measured' or 'analytic', got {method!r}")
        self.model = model
        self.method = method  # "auto" becomes one of the other two at the first micro-batch
        # measured: FlopCounterMode costs ~6x a step, so by default only the first micro-batch is counted and other
        # shapes are scaled from it; per_shape counts every new shape (exact, for measurement scripts)
        self.per_shape = per_shape
        self.buckets: dict[tuple, MeasuredFlops] = {}
        self._sizes: dict[tuple, int] = {}  # elements of the batch each bucket was counted on
        self._pending_size = 0
        self._roles = find_submodules(model) if parts is None else parts  # learned (phase_timer.find_submodules)
        if method == "measured":
            _count_flash_attn_ops()
        self._towers: dict[int, tuple[int, bool]] = {}  # analytic: (matmul params, trainable) per tower, once

    def will_measure(self, micro_batch: Any) -> bool:
        """Whether :meth:`count` would run FlopCounterMode on this micro-batch: measured, and nothing counted yet
        (`per_shape`: or a new shape)."""
        self._resolve(micro_batch)
        if self.method != "measured":
            return False
        return not self.buckets or (self.per_shape and shape_key(micro_batch) not in self.buckets)

    def count(self, micro_batch: Any) -> contextlib.AbstractContextManager[None]:
        """Wrap the forward + backward of `micro_batch`: counted under FlopCounterMode when :meth:`will_measure`."""
        if not self.will_measure(micro_batch):
            return contextlib.nullcontext()
        self._pending_size = _batch_elements(micro_batch)
        return self._measure(shape_key(micro_batch))

    def flops(self, micro_batch: Any) -> float:
        """Model FLOPs of one forward + backward of `micro_batch` (pass the host batch: the mask is read)."""
        self._resolve(micro_batch)
        if self.method == "analytic":
            towers = describe_towers(self.model, micro_batch, tower_params=self._tower_params, parts=self._roles)
            return sum(transformer_flops(tower) for tower in towers)
        measured = self.buckets.get(shape_key(micro_batch))
        scale = 1.0
        if measured is None:
            if not self.buckets:
                return 0.0  # nothing measured yet (the caller skipped count()): no figure rather than a wrong one
            # Another shape: the counted one scaled by the batch's elements (dense FLOPs grow with tokens/pixels;
            # the attention term's quadratic part is left out of the scaling). FlopsMeter(per_shape=True) counts each.
            reference, measured = next(iter(self._sizes.items())), next(iter(self.buckets.values()))
            scale = _batch_elements(micro_batch) / max(reference[1], 1)
        lm = measured.by_role.get("language_model", measured.total if not measured.by_role else 0.0)
        fraction = real_token_fraction(micro_batch, measured.lm_tokens * scale if measured.lm_tokens else None)
        return scale * measured.total - scale * lm * (1.0 - fraction)

    def _resolve(self, micro_batch: Any) -> None:
        """`auto`: the formula when this model and batch allow it (free), else FlopCounterMode."""
        if self.method != "auto":
            return
        try:
            describe_towers(self.model, micro_batch, tower_params=self._tower_params, parts=self._roles)
            self.method = "analytic"
        except (ValueError, AttributeError, TypeError):
            self.method = "measured"

    def _tower_params(self, module: nn.Module) -> tuple[int, bool]:
        if id(module) not in self._towers:  # walking every parameter costs more than a small model's step
            self._towers[id(module)] = (matmul_params(module), any(p.requires_grad for p in module.parameters()))
        return self._towers[id(module)]

    @contextlib.contextmanager
    def _measure(self, key: tuple) -> Iterator[None]:
        lm_tokens: list[int] = []
        handle = None
        if "language_model" in self._roles:
            handle = self._roles["language_model"][0].register_forward_pre_hook(
                lambda module, args, kwargs: lm_tokens.append(_leading_tokens(args, kwargs)), with_kwargs=True)
        mode = FlopCounterMode(display=False)
        try:
            with mode:
                yield
        finally:
            if handle is not None:
                handle.remove()
        self.buckets[key] = MeasuredFlops(float(mode.get_total_flops()), self._by_role(mode),
                                          lm_tokens[0] if lm_tokens else None)
        self._sizes[key] = self._pending_size

    def _by_role(self, mode: FlopCounterMode) -> dict[str, float]:
        counts = mode.get_flop_counts()
        names = {id(module): name for name, module in self.model.named_modules()}
        root = type(self.model).__name__
        by_role = {}
        for role, modules in self._roles.items():
            paths = [f"{root}.{names[id(module)]}" for module in modules]
            by_role[role] = float(sum(sum(counts.get(path, {}).values()) for path in paths))
        return by_role


def _batch_elements(batch: Any) -> int:
    """Elements of every tensor in a batch: what dense FLOPs scale with between shapes."""
    if isinstance(batch, torch.Tensor):
        return batch.numel()
    if isinstance(batch, Mapping):
        return sum(_batch_elements(value) for value in batch.values())
    if isinstance(batch, (list, tuple)):
        return sum(_batch_elements(value) for value in batch)
    return 0


def _leading_tokens(args: tuple, kwargs: dict) -> int:
    """batch x sequence of the first tensor input of the language model (input_ids or inputs_embeds)."""
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return int(value.shape[0] * value.shape[1])
    return 0


# ---- analytic -----------------------------------------------------------------------------------------------
@dataclass
class TowerShape:
    """One transformer tower for the analytic count: matmul parameters, layers, heads, head size, sequence."""

    params: int  # parameters in matmuls (embedding tables excluded)
    layers: int
    heads: int
    head_dim: int
    seq_len: int  # tokens each token attends over (padded sequence length)
    tokens: int  # tokens processed this micro-batch (real, unpadded)
    trainable: bool = True


def transformer_flops(tower: TowerShape) -> float:
    """Training FLOPs of a tower: (6N + 12·L·H·d·S) per token; forward only (2N + 4·L·H·d·S) when frozen."""
    dense, attention = (6, 12) if tower.trainable else (2, 4)
    per_token = dense * tower.params + attention * tower.layers * tower.heads * tower.head_dim * tower.seq_len
    return float(per_token * tower.tokens)


def analytic_flops(model: nn.Module, micro_batch: Mapping[str, Any]) -> float:
    """Formula FLOPs of one forward + backward of a transformer or VLM (config as TinyVLM or Hugging Face names)."""
    return sum(transformer_flops(tower) for tower in describe_towers(model, micro_batch))


def describe_towers(model: nn.Module, batch: Mapping[str, Any],
                    tower_params: Callable[[nn.Module], tuple[int, bool]] | None = None,
                    parts: Parts | None = None) -> list[TowerShape]:
    """The vision tower, projector and language model as TowerShapes, from the model config and the batch.

    `tower_params(module) -> (matmul parameters, trainable)` may cache what is otherwise counted on every call;
    `parts`: the model's parts as :func:`~vlmfast.profiling.phase_timer.find_submodules` learned them (else here)."""
    tower_params = tower_params or _tower_params
    config = getattr(model, "config", None)
    if config is None:
        raise ValueError(f"profile.flops: analytic needs a model with a .config ({type(model).__name__} has none); "
                         "use profile.flops: measured")
    roles = find_submodules(model) if parts is None else parts
    text, vision = _text_config(config), _vision_config(config)
    input_ids = batch.get("input_ids")
    if text is None or not isinstance(input_ids, torch.Tensor):
        raise ValueError("profile.flops: analytic needs input_ids in the batch and a config with layer/head counts "
                         "(num_hidden_layers, num_attention_heads, hidden_size); use profile.flops: measured")
    samples, text_len = input_ids.shape[:2]
    mask = batch.get("attention_mask")
    real_text = int(mask.sum()) if isinstance(mask, torch.Tensor) else samples * text_len
    towers = []
    image_tokens = 0
    if vision is not None and "vision" in roles and isinstance(batch.get("pixel_values"), torch.Tensor):
        layers, heads, dim, patches = vision
        images = batch["pixel_values"].shape[0]
        image_tokens = patches * images if getattr(config, "num_image_tokens", None) else 0  # LLaVA-HF: in input_ids
        towers.append(_tower(_params_of(roles["vision"], tower_params), layers, heads, dim // heads, patches,
                             patches * images))
        if "projector" in roles:
            towers.append(_tower(_params_of(roles["projector"], tower_params), 0, 0, 0, 0, patches * images))
    layers, heads, dim, _ = text
    lm = roles.get("language_model", (model,))
    seq = text_len + image_tokens // max(samples, 1)
    towers.append(_tower(_params_of(lm, tower_params), layers, heads, dim // heads, seq, real_text + image_tokens))
    return towers


def _params_of(modules: tuple[nn.Module, ...],
               tower_params: Callable[[nn.Module], tuple[int, bool]]) -> tuple[int, bool]:
    """(matmul parameters, trainable) of a part made of one or more modules."""
    counted = [tower_params(module) for module in modules]
    return sum(n for n, _ in counted), any(trains for _, trains in counted)


def _tower_params(module: nn.Module) -> tuple[int, bool]:
    return matmul_params(module), any(p.requires_grad for p in module.parameters())


def _tower(params: tuple[int, bool], layers: int, heads: int, head_dim: int, seq_len: int, tokens: int) -> TowerShape:
    return TowerShape(params[0], layers, heads, head_dim, seq_len, tokens, params[1])


def matmul_params(module: nn.Module) -> int:
    """Parameters of `module` outside embedding tables (tied weights counted once, where a matmul uses them)."""
    embedding = {id(p) for m in module.modules() if isinstance(m, nn.Embedding) for p in m.parameters(recurse=False)}
    tied_to_matmul = {id(p) for m in module.modules() if not isinstance(m, nn.Embedding)
                      for p in m.parameters(recurse=False)}
    seen: set[int] = set()
    total = 0
    for p in module.parameters():  # module.parameters() already yields a shared tensor once
        if id(p) not in seen and (id(p) not in embedding or id(p) in tied_to_matmul):
            seen.add(id(p))
            total += p.numel()
    return total


def _text_config(config: Any) -> tuple[int, int, int, int] | None:
    if hasattr(config, "text_layers"):  # vlmfast TinyVLM
        return config.text_layers, config.text_heads, config.text_dim, 0
    text = getattr(config, "text_config", None) or config
    if all(hasattr(text, key) for key in ("num_hidden_layers", "num_attention_heads", "hidden_size")):
        return text.num_hidden_layers, text.num_attention_heads, text.hidden_size, 0
    return None


def _vision_config(config: Any) -> tuple[int, int, int, int] | None:
    if hasattr(config, "vision_layers"):  # vlmfast TinyVLM
        return config.vision_layers, config.vision_heads, config.vision_dim, config.num_image_tokens
    vision = getattr(config, "vision_config", None)
    if vision is not None and all(hasattr(vision, k) for k in ("num_hidden_layers", "num_attention_heads",
                                                              "hidden_size", "image_size", "patch_size")):
        patches = (vision.image_size // vision.patch_size) ** 2
        return vision.num_hidden_layers, vision.num_attention_heads, vision.hidden_size, patches
    return None
