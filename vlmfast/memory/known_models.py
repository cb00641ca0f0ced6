"""Known models and Hugging Face configs, built on the meta device: estimates with nothing downloaded or allocated.

Usage: ``estimate_from_hf_config("llava-1.5-7b", micro_batch_size=4, gpu_memory_gb=24).to_table()``
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from vlmfast.memory.activations import _register_probe_attention
from vlmfast.memory.estimator import MemoryEstimate, estimate_memory

__all__ = ["KNOWN_CONFIGS", "TINY_VLM", "build_estimate_model", "estimate_from_hf_config"]

_CLIP_VIT_L_336 = {
    "model_type": "clip_vision_model", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 24,
    "num_attention_heads": 16, "image_size": 336, "patch_size": 14, "projection_dim": 768,
}


def _llava_config(hidden: int, layers: int, intermediate: int, heads: int) -> dict[str, Any]:
    # llava-hf/llava-1.5-*-hf: Vicuna-1.5 (Llama-2 shapes) with 32000 tokens + <image> + padding = 32064.
    text = {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
            "intermediate_size": intermediate, "num_attention_heads": heads, "num_key_value_heads": heads,
            "vocab_size": 32064, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
    return {"model_type": "llava", "vision_config": dict(_CLIP_VIT_L_336), "text_config": text,
            "image_token_index": 32000, "projector_hidden_act": "gelu", "vision_feature_layer": -2,
            "vision_feature_select_strategy": "default"}


# The reference guide's worked example and exercise: CLIP ViT-L/14-336 (304M) + 2-layer MLP projector + Vicuna.
KNOWN_CONFIGS: dict[str, dict[str, Any]] = {
    "llava-1.5-7b": _llava_config(hidden=4096, layers=32, intermediate=11008, heads=32),
    "llava-1.5-13b": _llava_config(hidden=5120, layers=40, intermediate=13824, heads=40),
}
TINY_VLM = "tiny-vlm"


def _hf_config(config: Any) -> Any:
    from transformers import AutoConfig

    if isinstance(config, (str, Path)):
        name = str(config)
        if name in KNOWN_CONFIGS:
            config = KNOWN_CONFIGS[name]
        else:
            path = Path(name)
            path = path / "config.json" if path.is_dir() else path
            if not path.is_file():
                raise ValueError(f"{name!r} is neither a known model {[*KNOWN_CONFIGS, TINY_VLM]} nor a config file")
            config = json.loads(path.read_text())
    if isinstance(config, Mapping):
        data = dict(config)
        if "model_type" not in data:
            raise ValueError("a Hugging Face config dict needs 'model_type' (e.g. 'llama', 'llava')")
        return AutoConfig.for_model(data.pop("model_type"), **data)
    return config


def build_estimate_model(config: Any, *, attention: str = "sdpa") -> nn.Module:
    """A model to estimate, without weights: a Hugging Face model on the meta device, or vlmfast's tiny VLM.

    Usage: ``build_estimate_model("llava-1.5-7b")``; also a config object, a config dict or a config.json path.
    ``attention``: 'sdpa' (what fused kernels keep: no L x L scores) or 'eager' (the scores, per layer).
    """
    if isinstance(config, str) and config == TINY_VLM:
        from vlmfast.models.tiny_vlm import TinyVLM

        with torch.random.fork_rng(devices=[]):  # its weight init must not move the caller's random stream
            return TinyVLM()
    if attention not in ("sdpa", "eager"):
        raise ValueError(f"attention must be 'sdpa' or 'eager', got {attention!r}")
    try:
        from transformers import AutoModelForCausalLM, AutoModelForImageTextToText
    except ImportError as exc:
        raise ImportError("estimating a Hugging Face config needs transformers: pip install 'vlmfast[hf]'") from exc
    cfg = copy.deepcopy(_hf_config(config))  # building sets its attention implementation: leave the caller's alone
    impl = _register_probe_attention() if attention == "sdpa" else "eager"
    auto = AutoModelForImageTextToText if hasattr(cfg, "vision_config") else AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(cfg, attn_implementation=impl)


def estimate_from_hf_config(config: Any, *, attention: str = "sdpa", lora_r: int | None = None,
                            lora_towers: tuple[str, ...] = ("language",), **kwargs: Any) -> MemoryEstimate:
    """``estimate_memory`` for a model built from a config on the meta device (nothing downloaded or allocated).

    Usage: ``estimate_from_hf_config("llava-1.5-7b", micro_batch_size=4, gpu_memory_gb=24).to_table()``

    ``config``: a name in ``KNOWN_CONFIGS``, 'tiny-vlm', a Hugging Face config object or dict, or a config.json
    path; ``lora_r``: LoRA adapters of this rank on ``lora_towers`` (the ``lora`` section's all-linear: only the
    adapters get gradients and optimizer states); ``kwargs`` go to :func:`estimate_memory`.
    """
    model = build_estimate_model(config, attention=attention)
    if lora_r is not None:
        from vlmfast.strategies.lora import LoRASpec, apply_lora

        model = apply_lora(model, LoRASpec(enabled=True, r=lora_r, towers=list(lora_towers)))
    return estimate_memory(model, **kwargs)

