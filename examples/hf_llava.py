"""Fine-tune a Hugging Face LLaVA with OptimizedTrainer: a tiny one built from a config (no download), or your weights.

Both paths share the data code: generated shape images and their captions go through a LlavaProcessor (the model's
own with --model-path, else one built from a word-level tokenizer and a CLIP image processor), so the prompt format,
the expansion of <image> into the image tokens and the label masking are those the real model trains with. The
vision tower is frozen (LLaVA stage 2) and the attention backend is chosen per tower.

Settings, later ones winning: the example's own (lr 2e-5 for real weights, 2e-3 for the tiny model; the vision tower
frozen), then a --config YAML merged into them field by field (a YAML that sets only optimizer.weight_decay keeps the
example's lr and freeze), then the flags you pass (--steps, --lr, --precision, ...). The example configs set
optimizer.lr for the tiny model (zero2_bf16.yaml: 0.002), so with real weights pass --lr as below. A warm-up as long
as the run (e.g. the config's 20 steps with --steps 20) is cut to a tenth of the run.

Usage:
    python examples/hf_llava.py --steps 20                                      # tiny LLaVA from a config, CPU
    python examples/hf_llava.py --model-path llava-hf/llava-1.5-7b-hf --precision bf16 --steps 1000 \\
        --config examples/configs/zero2_bf16.yaml --lr 2e-5                     # your weights (local or cached)
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image
from transformers import (
    AutoProcessor,
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    LlavaProcessor,
    PreTrainedTokenizerFast,
)

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.attention import hf_attention_implementations
from vlmfast.models import ShapesCaptionDataset

PROMPT = "USER: <image>\nDescribe the image. ASSISTANT:"


def tiny_llava(seed: int = 0) -> tuple[LlavaForConditionalGeneration, LlavaProcessor]:
    """A LLaVA (CLIP vision tower, MLP projector, Llama) small enough for CPU, and a processor to match."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    try:  # transformers 5 names the PIL-based processor (no torchvision needed) apart
        from transformers import CLIPImageProcessorPil as image_processor_class
    except ImportError:
        from transformers import CLIPImageProcessor as image_processor_class

    shape_words = ShapesCaptionDataset(num_samples=1).tokenizer.id_to_token[3:]  # after <pad> <bos> <eos>
    words = ["<pad>", "<s>", "</s>", "<unk>", "<image>", *PROMPT.replace("<image>", "").split(), *shape_words]
    backend = Tokenizer(models.WordLevel({word: i for i, word in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                        eos_token="</s>", unk_token="<unk>",
                                        extra_special_tokens={"image_token": "<image>"})
    images = image_processor_class(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32})
    # 32 px / patch 8 = 16 patches (+ CLS, dropped by the "default" feature strategy): 16 image tokens per image.
    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=8,
                               vision_feature_select_strategy="default", num_additional_image_tokens=1)
    vision = CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=64, intermediate_size=128,
                              num_hidden_layers=2, num_attention_heads=4)
    text = LlamaConfig(vocab_size=len(words), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                       pad_token_id=0, bos_token_id=1, eos_token_id=2)
    config = LlavaConfig(vision_config=vision, text_config=text, image_token_index=tokenizer.image_token_id,
                         vision_feature_select_strategy="default")
    torch.manual_seed(seed)
    return LlavaForConditionalGeneration(config), processor


def load_llava(path: str) -> tuple[LlavaForConditionalGeneration, Any]:
    """Real weights and their processor, from a local folder or the Hugging Face cache (e.g. llava-1.5-7b-hf).

    Loaded in fp32: vlmfast keeps fp32 weights and runs bf16/fp16 through autocast (`--precision`), or hands them to
    DeepSpeed / FSDP2, which keep fp32 masters (`--config`).
    """
    model = LlavaForConditionalGeneration.from_pretrained(path, dtype=torch.float32)
    return model, AutoProcessor.from_pretrained(path)


@dataclass
class CaptionCollator:
    """Samples of ShapesCaptionDataset -> LLaVA inputs: prompt + caption + eos, loss on the caption tokens only."""

    processor: Any
    caption_of: Any  # ids -> text

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        tokenizer = self.processor.tokenizer
        images = [Image.fromarray(s["image"].permute(1, 2, 0).numpy()) for s in samples]
        texts = [f"{PROMPT} {self.caption_of(s['input_ids'])}{tokenizer.eos_token}" for s in samples]
        tokenizer.padding_side = "right"
        batch = self.processor(text=texts, images=images, padding=True, return_tensors="pt")
        prompt_len = len(self.processor(text=[PROMPT], images=images[:1], return_tensors="pt")["input_ids"][0])
        labels = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        labels[:, :prompt_len] = -100  # no loss on the prompt and image tokens
        return {**batch, "labels": labels}


def merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`base` with `override`'s fields put in, section by section (a section in `override` does not replace
    `base`'s whole section, only the fields it sets)."""
    merged = dict(base)
    for key, value in override.items():
        both_sections = isinstance(value, dict) and isinstance(merged.get(key), dict)
        merged[key] = merge(merged[key], value) if both_sections else value
    return merged


def build_spec(steps: int | None = None, model_path: str | None = None, precision: str | None = None,
               attention: str | None = None, vision_attention: str | None = None, config: str | None = None,
               lr: float | None = None) -> TrainSpec:
    """The example's settings, merged with the fields a `config` YAML sets, then with the arguments given (not None)."""
    settings: dict[str, Any] = {
        "max_steps": 20,
        "batch_size": 8,
        "micro_batch_size": 4,
        "precision": "fp32",
        "grad_clip": 1.0,
        "optimizer": {"lr": 2e-5 if model_path else 2e-3, "freeze": ["vision_tower"]},
        "attention": {"backend": "auto", "vision_backend": "sdpa"},
        "log": {"progress": "auto"},  # the run report is printed at the end
    }
    if config:  # only the fields the YAML sets (e.g. deepspeed, activation_checkpointing, optimizer.weight_decay)
        from_yaml = TrainSpec.from_file(config).model_dump(exclude_unset=True)
        if model_path and lr is None and "lr" in from_yaml.get("optimizer", {}):
            print(f"note: {config} sets optimizer.lr {from_yaml['optimizer']['lr']:g} for these weights "
                  "(the example's default for real weights is 2e-5); pass --lr to choose")
        settings = merge(settings, from_yaml)
    given = {"max_steps": steps, "precision": precision, "optimizer": {"lr": lr},
             "attention": {"backend": attention, "vision_backend": vision_attention}}
    settings = merge(settings, _without_none(given))
    scheduler = settings.get("scheduler", {})
    warmup, max_steps = scheduler.get("warmup_steps", 0), settings["max_steps"]
    if warmup >= max_steps:  # a config's warm-up would fill a short run (and the spec refuses it)
        settings["scheduler"] = {**scheduler, "warmup_steps": max_steps // 10}
        print(f"note: scheduler.warmup_steps {warmup} >= {max_steps} steps; using {max_steps // 10}")
    return TrainSpec(**settings)


def _without_none(data: dict[str, Any]) -> dict[str, Any]:
    out = {key: _without_none(value) if isinstance(value, dict) else value for key, value in data.items()}
    return {key: value for key, value in out.items() if value is not None and value != {}}


def main(steps: int | None = None, model_path: str | None = None, precision: str | None = None,
         attention: str | None = None, vision_attention: str | None = None, config: str | None = None,
         lr: float | None = None) -> float:
    """Train for `steps` optimizer steps (default: the config's max_steps, else 20); returns the last loss."""
    spec = build_spec(steps, model_path, precision, attention, vision_attention, config, lr)
    model, processor = load_llava(model_path) if model_path else tiny_llava()
    dataset = ShapesCaptionDataset(num_samples=4096, seed=0)
    collate = CaptionCollator(processor, dataset.tokenizer.decode)
    result = OptimizedTrainer(model, dataset, spec, collate_fn=collate).fit()
    print("attention per sub-model:", hf_attention_implementations(model))
    return result.history[-1]["loss"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, help="optimizer steps (default: the config's max_steps, else 20)")
    parser.add_argument("--model-path", help="LLaVA weights (folder or hub id already in the cache); default: tiny")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], help="default: the config's, else fp32")
    parser.add_argument("--lr", type=float, help="default: the config's, else 2e-5 with --model-path, 2e-3 tiny")
    parser.add_argument("--attention", help="language model's backend (auto, sdpa, eager, ...); default: auto")
    parser.add_argument("--vision-attention", help="vision tower's backend; default: sdpa")
    parser.add_argument("--config", help="a spec YAML merged into the example's settings (the fields it sets win)")
    args = parser.parse_args()
    loss = main(args.steps, args.model_path, args.precision, args.attention, args.vision_attention, args.config,
                args.lr)
    print(f"final loss {loss:.4f}")
