"""The ``gpu-1b`` benchmark size: a 1.4B-parameter LLaVA-shaped Hugging Face VLM with random weights, at the scale
users train.

The model is transformers' own ``LlavaForConditionalGeneration`` built from a config (nothing downloaded): a CLIP
ViT-L/14 tower at 336 px (576 image tokens, 304M parameters), LLaVA's two-layer projector and a TinyLlama-1.1B-shaped
language model (2048 wide, 22 layers, grouped-query attention with 4 key/value heads, 32,064-token vocabulary): real
attention and a real vision tower, in bf16 on the GPU. Samples are one shapes image and a long-tailed text of 424-1448
tokens (1,000-2,024 tokens with the image's), collated the way a Hugging Face processor hands them to the model
(:class:`ProcessorCollator`: the image token expanded to 576 ids in ``input_ids``, CLIP-normalised ``pixel_values``
of one image per sample, labels that ignore image tokens and padding).

The batch fills an 80 GB H100 by vlmfast's own estimator (:func:`fill_batch_size`: model states plus measured
activations at the longest sample, bf16, SDPA) and the starting point, fp32 with eager attention, accumulates
micro-batches the estimator fits in the same 80 GB. Work is counted with the model's analytic FLOPs (6N per token
of each tower, attention over each sample's own length, the vision tower per image): see
:mod:`vlmfast.bench.workload`.

``scale="toy"`` builds the same classes with tiny dimensions, for CI (``vlmfast bench --size gpu-1b --dry-run``).

Usage::

    workload = build_hf_workload("gpu-1b", steps=30, warmup=3)          # the 1.4B model; "toy" for CI
    model = workload.build_model("sdpa")
    loss = model(**workload.collate([workload.dataset[i] for i in range(4)])).loss
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from vlmfast.bench.multi_image import MultiImageShapesDataset
from vlmfast.bench.workload import Workload
from vlmfast.data.packing import IMAGE_PLACEHOLDER_ID
from vlmfast.models.shapes import VLMCollator, right_padded

__all__ = ["HF_MODELS", "HFVLMWorkload", "ProcessorCollator", "build_hf_workload", "build_llava", "fill_batch_size",
           "llava_config"]

_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# Config dicts of LLaVA-shaped models (transformers' LlavaConfig fields), by scale.
HF_MODELS: dict[str, dict[str, Any]] = {
    "gpu-1b": {
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096,
                          "num_hidden_layers": 24, "num_attention_heads": 16, "image_size": 336, "patch_size": 14},
        "text_config": {"model_type": "llama", "hidden_size": 2048, "intermediate_size": 5632,
                        "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4,
                        "vocab_size": 32064, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5},
        "image_token_index": 32000, "image_seq_length": 576,
    },
    # The same classes at a size a CPU trains in milliseconds: 28 px images of 2x2 patches (4 image tokens).
    "toy": {
        "vision_config": {"model_type": "clip_vision_model", "hidden_size": 32, "intermediate_size": 64,
                          "num_hidden_layers": 2, "num_attention_heads": 2, "image_size": 28, "patch_size": 14},
        "text_config": {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
                        "max_position_embeddings": 512, "rms_norm_eps": 1e-5},
        "image_token_index": 511, "image_seq_length": 4,
    },
}


def llava_config(scale: str) -> Any:
    """transformers' ``LlavaConfig`` for a scale in :data:`HF_MODELS` (``gpu-1b`` or ``toy``).

    Usage: ``llava_config("toy").text_config.hidden_size``
    """
    from transformers import LlavaConfig

    if scale not in HF_MODELS:
        raise ValueError(f"unknown model scale '{scale}': choose from {sorted(HF_MODELS)}")
    data = copy.deepcopy(HF_MODELS[scale])
    return LlavaConfig(vision_feature_select_strategy="default", vision_feature_layer=-2, **data)


def build_llava(config: Any, seed: int = 0) -> nn.Module:
    """``LlavaForConditionalGeneration`` with random weights from ``config`` (fp32, on the CPU), seeded.

    Usage: ``model = build_llava(llava_config("toy"))``
    """
    from transformers import LlavaForConditionalGeneration

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return LlavaForConditionalGeneration(copy.deepcopy(config))


def fill_batch_size(config: Any, seq_len: int, *, gpu_memory_gb: float = 80.0, precision: str = "bf16",
                    attention: str = "sdpa", limit: int = 256) -> tuple[int, float]:
    """The most samples of ``seq_len`` tokens per micro-batch that vlmfast's estimator fits in ``gpu_memory_gb``
    (its 10 % headroom kept), with this precision and attention; and the estimate in GiB at that size.

    Usage: ``fill_batch_size(llava_config("gpu-1b"), seq_len=2024)`` -> ``(n, gib)``
    """
    from vlmfast.memory.known_models import estimate_from_hf_config

    estimate = estimate_from_hf_config(config, attention=attention, precision=precision, micro_batch_size=1,
                                       seq_len=seq_len, gpu_memory_gb=gpu_memory_gb)
    if not estimate.fits(gpu_memory_gb):
        return 1, estimate.gpu_bytes / 2**30  # not even one: the run's OOM handling has the last word
    low, high = 1, limit  # the estimate grows with the micro-batch: bisect for the largest that fits
    while low < high:
        middle = (low + high + 1) // 2
        if estimate.reestimate(micro_batch_size=middle).fits(gpu_memory_gb):
            low = middle
        else:
            high = middle - 1
    return low, estimate.reestimate(micro_batch_size=low).gpu_bytes / 2**30


@dataclass
class ProcessorCollator:
    """Samples -> the batch a Hugging Face LLaVA processor produces: right-padded ``input_ids`` with each image's
    placeholders as ``image_token_index`` ids, ``attention_mask``, ``labels`` (-100 on padding and image tokens) and
    ``pixel_values`` [images, 3, S, S] normalised with CLIP's mean and std. A plain dataclass: it pickles into workers.

    Usage: ``ProcessorCollator(image_size=336, image_token_index=32000)([dataset[i] for i in range(4)])``
    """

    image_size: int
    image_token_index: int
    pad_id: int = 0
    ignore_index: int = -100
    _resize: VLMCollator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._resize = VLMCollator(image_size=self.image_size)

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        if not samples:
            raise ValueError("cannot collate an empty batch")
        input_ids, attention_mask = right_padded([s["input_ids"] for s in samples], self.pad_id)
        image = input_ids == IMAGE_PLACEHOLDER_ID
        input_ids = input_ids.masked_fill(image, self.image_token_index)
        labels = input_ids.masked_fill(image | (attention_mask == 0), self.ignore_index)
        images = [picture for s in samples for picture in s["images"]]
        if not images:
            raise ValueError("ProcessorCollator: a batch without images; LLaVA's forward needs pixel_values here")
        pixels = torch.cat([self._resize._resize(picture) for picture in images])
        mean = torch.tensor(_CLIP_MEAN).view(1, 3, 1, 1)
        std = torch.tensor(_CLIP_STD).view(1, 3, 1, 1)
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
                "pixel_values": (pixels - mean) / std}


# Text lengths (log-normal, clipped) per scale: with the one image's tokens, 1,000-2,024 tokens a sample at gpu-1b.
_TEXT = {"gpu-1b": {"min_text": 424, "median_text": 700.0, "max_text": 1448, "sigma": 0.4},
         "toy": {"min_text": 8, "median_text": 16.0, "max_text": 40, "sigma": 0.5}}
_TOY_BATCH = 2
_GPU_MEMORY_GB = 80.0  # an H100 80 GB: the card users train 1B-class VLMs on (an H200's 141 GB takes more)


@dataclass
class HFVLMWorkload(Workload):
    """A :class:`~vlmfast.bench.workload.Workload` whose model is a Hugging Face LLaVA (``template``: the shared
    initial weights, copied for every run; the counting rules stay the workload's)."""

    template: nn.Module | None = None
    model_name = "LLaVA-shaped Hugging Face VLM (transformers' LlavaForConditionalGeneration), random weights"

    @property
    def image_tokens(self) -> int:
        return int(self.config.image_seq_length)

    @property
    def prepended_tokens(self) -> int:
        return 0  # the processor put every image token into input_ids

    def build_model(self, attention: str = "eager") -> nn.Module:
        """A fresh copy of the template (its non-persistent buffers too) with this attention implementation."""
        from vlmfast.attention import set_attention_backend

        model = copy.deepcopy(self.template)
        set_attention_backend(model, attention)
        return model


def _one_sample(config: Any) -> Any:
    """``sample_batch(text_tokens)`` for the FLOPs fit: one image's tokens, then the text, as the processor lays
    them out."""
    size = config.vision_config.image_size

    def sample(text_tokens: int) -> dict[str, Tensor]:
        ids = torch.cat([torch.full((1, config.image_seq_length), config.image_token_index),
                         torch.ones(1, text_tokens, dtype=torch.long)], dim=1)
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "pixel_values": torch.zeros(1, 3, size, size)}

    return sample


def build_hf_workload(size: str, *, steps: int | None = None, warmup: int | None = None, seed: int = 0,
                      batch_size: int | None = None, toy: bool = False) -> HFVLMWorkload:
    """The gpu-1b workload (see the module docstring); ``toy``: the same classes at CI scale, batch 2.

    Usage: ``build_hf_workload("gpu-1b", toy=True)``
    """
    from vlmfast.bench.workload import SIZES, BenchDataset, _flops_coefficients

    bench = SIZES[size]
    scale = "toy" if toy else bench.model
    config = llava_config(scale)
    steps = bench.steps if steps is None else steps
    warmup = bench.warmup if warmup is None else warmup
    longest = config.image_seq_length + _TEXT[scale]["max_text"]
    memory: dict[str, Any] = {"seq_len": longest}
    fp32_micro = None
    if batch_size is None and toy:
        batch_size = _TOY_BATCH
    elif batch_size is None:
        batch_size, gib = fill_batch_size(config, longest, gpu_memory_gb=_GPU_MEMORY_GB)
        fp32_micro, fp32_gib = fill_batch_size(config, longest, gpu_memory_gb=_GPU_MEMORY_GB, precision="fp32",
                                               attention="eager")
        fp32_micro = fp32_micro if fp32_micro < batch_size else None
        memory.update(gpu_memory_gb=_GPU_MEMORY_GB, bf16_sdpa_estimate_gib=gib, fp32_eager_estimate_gib=fp32_gib,
                      rule="the most samples of the longest length vlmfast's estimator fits with 10 % headroom")
    train_samples = (warmup + steps) * batch_size
    base = MultiImageShapesDataset(train_samples + bench.eval_samples, seed=seed, min_images=1, max_images=1,
                                   image_tokens=config.image_seq_length, **_TEXT[scale])
    collate = ProcessorCollator(image_size=config.vision_config.image_size,
                                image_token_index=config.image_token_index, pad_id=base.tokenizer.pad_id)
    order = torch.randperm(train_samples, generator=torch.Generator().manual_seed(seed)).tolist()
    held_out = sorted(range(train_samples, train_samples + bench.eval_samples), key=lambda i: len(base.caption_ids(i)))
    eval_batches = [collate([base[i] for i in held_out[k:k + batch_size]])
                    for k in range(0, len(held_out), batch_size)]
    template = build_llava(config, seed=seed)
    return HFVLMWorkload(size=size, config=config, batch_size=batch_size, steps=steps, warmup=warmup, lr=bench.lr,
                         dataset=BenchDataset(base, order), collate=collate, eval_batches=eval_batches,
                         init_state=template.state_dict(), template=template,
                         flops_coefficients=_flops_coefficients(template, config.image_seq_length,
                                                                _one_sample(config)),
                         fp32_micro_batch_size=fp32_micro, memory=memory)
