"""The zoo's cases: tiny models, their processors around word-level tokenizers, and per-sample items.

Every model has dropout 0 (micro-batches must give the full-batch gradient exactly) and a few thousand to ~60k
parameters, so one forward/backward of 8 samples takes milliseconds on a CPU.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

N_SAMPLES = 8
IMAGES_PER_SAMPLE = (1, 0, 2, 1, 2, 0, 1, 1)  # 8 samples: text-only ones, and two images with text between them
WORDS = tuple(f"w{i}" for i in range(40))


@dataclass
class ZooCase:
    """A model, its per-sample items and the collate_fn that makes a batch of them (the real processor)."""

    name: str
    model: nn.Module
    samples: list[Any]
    collate_fn: Callable[[list[Any]], Any]
    loss_fn: Callable[[nn.Module, Any], Any] | None = None
    image_token_ids: tuple[int, ...] = ()
    checkpoint_blocks: list[str] = field(default_factory=list)  # activation_checkpointing.blocks, when not found
    notes: list[str] = field(default_factory=list)


# ---- tokenizers and processors ----------------------------------------------------------------------------------

def word_tokenizer(special: list[str], **roles: str) -> Any:
    """A word-level tokenizer over ``WORDS`` whose ``special`` tokens (image tokens...) are never split."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate([*special, *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token=roles.get("unk_token", special[1])))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.add_special_tokens(special)
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, **roles)


def images_only(processor_class: type) -> type:
    """The real processor class, built without its video processor (which needs torchvision, absent here)."""

    class ImagesOnly(processor_class):  # type: ignore[misc, valid-type]
        def check_argument_for_proper_class(self, argument_name: str, argument: Any) -> Any:
            if argument is None and "video" in argument_name:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    ImagesOnly.__name__ = ImagesOnly.__qualname__ = processor_class.__name__
    return ImagesOnly


def _rng_images(seed: int, sizes: list[tuple[int, int]]) -> list[np.ndarray]:
    g = np.random.default_rng(seed)
    return [g.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in sizes]


def _items(seed: int, sizes: list[tuple[int, int]], images: bool = True) -> list[dict[str, Any]]:
    """8 samples: 3 to 12 words each, and IMAGES_PER_SAMPLE images of the given sizes (cycled)."""
    r = random.Random(seed)
    pool = _rng_images(seed, sizes)
    out = []
    for i in range(N_SAMPLES):
        text = " ".join(r.choice(WORDS) for _ in range(r.randint(3, 12)))
        count = IMAGES_PER_SAMPLE[i] if images else 0
        out.append({"text": text, "images": [pool[(i + k) % len(pool)] for k in range(count)]})
    return out


@dataclass
class ProcessorCollate:
    """collate_fn: each image's placeholder followed by a word, then the text; labels = input_ids but for the
    ``ignore_ids`` (padding, image and other special tokens), which get -100."""

    processor: Any
    placeholder: str
    ignore_ids: tuple[int, ...]
    extra: dict[str, Any] = field(default_factory=dict)

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        texts = [" ".join([f"{self.placeholder} {WORDS[k]}" for k in range(len(s["images"]))] + [s["text"]])
                 for s in samples]
        images = [list(s["images"]) for s in samples]
        kwargs: dict[str, Any] = {"text": texts, "padding": True, "return_tensors": "pt", **self.extra}
        if any(images):
            kwargs["images"] = images
        batch = dict(self.processor(**kwargs))
        batch["labels"] = _labels(batch["input_ids"], self.ignore_ids)
        # Each row's first real token is no target (real templates start with BOS or a system turn): under left
        # padding (InternVL) it would be predicted from a pad, and the loss would depend on the row's padding.
        first = batch["attention_mask"].long().argmax(dim=1)
        batch["labels"][torch.arange(len(first)), first] = -100
        return batch


def _labels(input_ids: torch.Tensor, ignore_ids: tuple[int, ...]) -> torch.Tensor:
    return input_ids.masked_fill(torch.isin(input_ids, torch.tensor(ignore_ids)), -100)


def _text_config(vocab: int, **extra: Any) -> dict[str, Any]:
    return dict(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=512, **extra)


# ---- the cases ------------------------------------------------------------------------------------------------

def _qwen2_vl(seed: int, version: str = "2") -> ZooCase:
    import transformers as T

    special = ["<pad>", "<unk>", "<s>", "</s>", "<|image_pad|>", "<|vision_start|>", "<|vision_end|>",
               "<|video_pad|>"]
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in special}
    image_processor = T.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 84, patch_size=14,
                                                 merge_size=2, temporal_patch_size=2)
    processor_class = T.Qwen2VLProcessor if version == "2" else T.Qwen2_5_VLProcessor
    processor = images_only(processor_class)(image_processor=image_processor, tokenizer=tokenizer,
                                             video_processor=None)
    text = _text_config(len(tokenizer), bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=0,
                        rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e4})
    vision = dict(depth=1, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    token_ids = dict(image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
                     vision_start_token_id=ids["<|vision_start|>"], vision_end_token_id=ids["<|vision_end|>"])
    torch.manual_seed(seed)
    if version == "2":
        config = T.Qwen2VLConfig(text_config=text, vision_config=dict(vision, embed_dim=16, hidden_size=32),
                                 **token_ids)
        model = T.Qwen2VLForConditionalGeneration(config)
    else:
        config = T.Qwen2_5_VLConfig(text_config=text, vision_config=dict(
            vision, hidden_size=16, out_hidden_size=32, intermediate_size=32, window_size=56,
            fullatt_block_indexes=[0]), **token_ids)
        model = T.Qwen2_5_VLForConditionalGeneration(config)
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    collate = ProcessorCollate(processor, placeholder, tuple(ids.values()))
    samples = _items(seed, [(56, 56), (56, 84), (84, 56)])
    return ZooCase(f"qwen2{'_5' if version != '2' else ''}_vl", model, samples, collate,
                   image_token_ids=(ids["<|image_pad|>"],))

def _qwen2_5_omni(seed: int) -> ZooCase:
    """Qwen2.5-Omni's thinker (text out): Qwen2.5-VL's windowed vision tower and mRoPE, plus a (tiny, unused here)
    Whisper-like audio tower; the real Qwen2_5OmniProcessor (left padding), its video processor left out."""
    import transformers as T

    special = ["<pad>", "<unk>", "<s>", "</s>", "<|IMAGE|>", "<|AUDIO|>", "<|VIDEO|>", "<|vision_bos|>",
               "<|vision_eos|>", "<|audio_bos|>", "<|audio_eos|>", "<|im_start|>"]
    roles = dict(zip(["image_token", "audio_token", "video_token", "vision_bos_token", "vision_eos_token",
                      "audio_bos_token", "audio_eos_token"], special[4:11], strict=True))
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                               extra_special_tokens=roles)
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in special}
    image_processor = T.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=56 * 84, patch_size=14,
                                                 merge_size=2, temporal_patch_size=2)
    processor = images_only(T.Qwen2_5OmniProcessor)(image_processor=image_processor, video_processor=None,
                                                    feature_extractor=T.WhisperFeatureExtractor(feature_size=8),
                                                    tokenizer=tokenizer)
    text = _text_config(len(tokenizer), bos_token_id=ids["<s>"], eos_token_id=ids["</s>"], pad_token_id=0,
                        rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e4})
    vision = dict(depth=1, num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2, hidden_size=16,
                  out_hidden_size=32, intermediate_size=32, window_size=56, fullatt_block_indexes=[0])
    audio = dict(num_mel_bins=8, encoder_layers=1, encoder_attention_heads=2, encoder_ffn_dim=32, d_model=16,
                 output_dim=32, max_source_positions=32, n_window=8)
    torch.manual_seed(seed)
    config = T.Qwen2_5OmniThinkerConfig(
        text_config=text, vision_config=vision, audio_config=audio, image_token_index=ids["<|IMAGE|>"],
        video_token_index=ids["<|VIDEO|>"], audio_token_index=ids["<|AUDIO|>"],
        audio_start_token_id=ids["<|audio_bos|>"], audio_end_token_id=ids["<|audio_eos|>"],
        vision_start_token_id=ids["<|vision_bos|>"], user_token_id=ids["<|im_start|>"])
    model = T.Qwen2_5OmniThinkerForConditionalGeneration(config)
    collate = ProcessorCollate(processor, "<|vision_bos|><|IMAGE|><|vision_eos|>", tuple(ids.values()))
    return ZooCase("qwen2_5_omni", model, _items(seed, [(56, 56), (56, 84), (84, 56)]), collate,
                   image_token_ids=(ids["<|IMAGE|>"],))


def _phi4_image_processor(crop: int) -> Any:
    """Phi-4-multimodal's image processor, whose only implementation needs torchvision (absent here), redone on
    torch for images that are whole crops: per image a global crop (the image resized to ``crop``) then its
    ``crop`` x ``crop`` tiles, normalised to [-1, 1]; masks of one entry per 1-pixel patch; images padded to the
    batch's most crops (zero crops, mask ones); ``num_img_tokens`` by the real processor's formula (global features
    plus a newline per row, a separator, the tiles' features plus a newline per row), whose 16 (a real 448-pixel
    crop's 32x32 patches pooled 2x2) is here ``crop // 2`` (1-pixel patches)."""
    from transformers import BatchFeature
    from transformers.image_processing_utils import BaseImageProcessor

    base = crop // 2

    class Phi4MultimodalImageProcessor(BaseImageProcessor):
        model_input_names: ClassVar[list[str]] = ["image_pixel_values", "image_sizes", "image_attention_mask"]

        def __call__(self, images: Any, **kwargs: Any) -> Any:
            from transformers.image_utils import make_flat_list_of_images

            crops, masks, tokens, sizes = [], [], [], []
            for image in make_flat_list_of_images(images):
                pixels = torch.from_numpy(np.asarray(image)).permute(2, 0, 1).float() / 127.5 - 1
                h, w = pixels.shape[1] // crop, pixels.shape[2] // crop
                assert pixels.shape[1:] == (h * crop, w * crop), "the zoo's Phi-4 images are whole crops"
                tiles = pixels.reshape(3, h, crop, w, crop).permute(1, 3, 0, 2, 4).reshape(h * w, 3, crop, crop)
                whole = F.interpolate(pixels[None], size=(crop, crop), mode="bicubic", align_corners=False)
                crops.append(torch.cat([whole, tiles]))
                masks.append(torch.ones(1 + h * w, crop, crop))
                tokens.append(base * base + base + 1 + base * h * (base * w + 1))
                sizes.append([h * crop, w * crop])
            most = max(len(c) for c in crops)
            data = {"image_pixel_values": torch.stack([F.pad(c, (0, 0, 0, 0, 0, 0, 0, most - len(c))) for c in crops]),
                    "image_sizes": torch.tensor(sizes),
                    "image_attention_mask": torch.stack([F.pad(m, (0, 0, 0, 0, 0, most - len(m)), value=1)
                                                         for m in masks]),
                    "num_img_tokens": tokens}
            return BatchFeature(data)

    return Phi4MultimodalImageProcessor()


def _phi4_multimodal(seed: int) -> ZooCase:
    """Phi-4-multimodal: a SigLIP-like tower (1-pixel patches of 8x8 crops, features pooled 2x2 to 4x4), HD
    crops + a global view with newline
    extensors, a tiny (unused) conformer audio tower; the real Phi4MultimodalProcessor around a stand-in image
    processor (torchvision is absent)."""
    import transformers as T

    special = ["<pad>", "<unk>", "<s>", "</s>", "<|endoftext10|>", "<|endoftext11|>"]
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                               extra_special_tokens={"image_token": "<|endoftext10|>",
                                                     "audio_token": "<|endoftext11|>"})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in special}
    processor = T.Phi4MultimodalProcessor(image_processor=_phi4_image_processor(8), tokenizer=tokenizer,
                                          audio_processor=T.Phi4MultimodalFeatureExtractor(feature_size=8))
    torch.manual_seed(seed)
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2, image_size=8,
                  patch_size=1, crop_size=8, image_token_id=ids["<|endoftext10|>"])
    audio = dict(hidden_size=16, intermediate_size=32, num_blocks=1, num_attention_heads=2, ext_pw_out_channel=16,
                 depthwise_separable_out_channel=16, nemo_conv_channels=16, input_size=8,
                 audio_token_id=ids["<|endoftext11|>"])
    config = T.Phi4MultimodalConfig(**_text_config(len(tokenizer), pad_token_id=0, bos_token_id=ids["<s>"],
                                                   eos_token_id=ids["</s>"]), vision_config=vision,
                                    audio_config=audio)
    model = T.Phi4MultimodalForCausalLM(config)
    collate = ProcessorCollate(processor, "<|endoftext10|>", tuple(ids.values()))
    return ZooCase("phi4_multimodal", model, _items(seed, [(8, 8), (8, 16), (16, 8)]), collate,
                   image_token_ids=(ids["<|endoftext10|>"],),
                   notes=["a stand-in image processor: the real one needs torchvision"])


def _glm4v(seed: int) -> ZooCase:
    """GLM-4.1V: Qwen2-VL-style flattened patches merged 2x2 (plus interpolated learned position embeddings and a
    conv downsample), 3D rotary positions from ``get_rope_index``; the real Glm4vProcessor, video processor left out."""
    import transformers as T

    special = ["<pad>", "<unk>", "<s>", "</s>", "<|image|>", "<|begin_of_image|>", "<|end_of_image|>", "<|video|>",
               "<|begin_of_video|>", "<|end_of_video|>"]
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in special}
    pixels = {"shortest_edge": 2 * 56 * 56, "longest_edge": 2 * 56 * 84}  # counted over its 2 temporal frames
    image_processor = T.Glm4vImageProcessorPil(size=pixels, patch_size=14, merge_size=2, temporal_patch_size=2)
    processor = images_only(T.Glm4vProcessor)(image_processor=image_processor, tokenizer=tokenizer,
                                              video_processor=None)
    text = _text_config(len(tokenizer), pad_token_id=0, rope_parameters={
        "rope_type": "default", "mrope_section": [2, 1, 1], "rope_theta": 1e4, "partial_rotary_factor": 1.0})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, image_size=56, patch_size=14,
                  spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=32)
    torch.manual_seed(seed)
    config = T.Glm4vConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image|>"],
                           video_token_id=ids["<|video|>"], image_start_token_id=ids["<|begin_of_image|>"],
                           image_end_token_id=ids["<|end_of_image|>"], video_start_token_id=ids["<|begin_of_video|>"],
                           video_end_token_id=ids["<|end_of_video|>"])
    model = T.Glm4vForConditionalGeneration(config)
    collate = ProcessorCollate(processor, "<|begin_of_image|><|image|><|end_of_image|>", tuple(ids.values()))
    return ZooCase("glm4v", model, _items(seed, [(56, 56), (56, 84), (84, 56)]), collate,
                   image_token_ids=(ids["<|image|>"],))


def _idefics2(seed: int) -> ZooCase:
    """Idefics2: a SigLIP-like tower on images padded to the batch's largest (``pixel_attention_mask``), a perceiver
    resampler of 4 latents per image between ``<fake_token_around_image>`` markers (the real Idefics2Processor)."""
    import PIL.Image
    import transformers as T

    special = ["<pad>", "<unk>", "<s>", "</s>", "<fake_token_around_image>", "<image>", "<end_of_utterance>"]
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in special}
    image_processor = T.Idefics2ImageProcessorPil(size={"shortest_edge": 16, "longest_edge": 32})
    processor = T.Idefics2Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4)
    torch.manual_seed(seed)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                  patch_size=8)
    perceiver = dict(hidden_size=32, resampler_n_latents=4, resampler_depth=1, resampler_n_heads=2,
                     resampler_head_dim=8, num_key_value_heads=1)
    config = T.Idefics2Config(vision_config=vision, perceiver_config=perceiver, image_token_id=ids["<image>"],
                              text_config=T.MistralConfig(**_text_config(len(tokenizer), pad_token_id=0)))
    model = T.Idefics2ForConditionalGeneration(config)
    collate = ProcessorCollate(processor, "<image>", tuple(ids.values()))
    samples = _items(seed, [(32, 32), (16, 32), (32, 24)])
    for sample in samples:  # its processor loads each image with load_image, which takes PIL images (or paths)
        sample["images"] = [PIL.Image.fromarray(image) for image in sample["images"]]
    return ZooCase("idefics2", model, samples, collate, image_token_ids=(ids["<image>"],))


@dataclass
class FuyuCollate:
    """FuyuProcessor puts each sample's (one) image first itself, as rows of ``|SPEAKER|`` patch tokens each ended by
    ``|NEWLINE|``, then ``<s>``, the text and ``<0x04>`` (beginning of answer); with images it pads on the left.
    Labels: input_ids but for the ``ignore_ids`` and each row's first real token."""

    processor: Any
    ignore_ids: tuple[int, ...]

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        kwargs: dict[str, Any] = {"text": [s["text"] for s in samples], "return_tensors": "pt"}
        if any(s["images"] for s in samples):
            kwargs.update(images=[list(s["images"]) for s in samples], return_legacy_image_output=False)
        else:
            kwargs["padding"] = True
        batch = dict(self.processor(**kwargs))
        batch["labels"] = _labels(batch["input_ids"], self.ignore_ids)
        first = batch["attention_mask"].long().argmax(dim=1)
        batch["labels"][torch.arange(len(first)), first] = -100
        return batch

def _leading_space(tokenizer: Any) -> Any:
    """The tokenizer, starting every text with a "\u2581" token as a SentencePiece one does (FuyuProcessor tokenises
    the image tokens' text on its own and strips that first token off it)."""

    class SentencePieceLike(type(tokenizer)):  # type: ignore[misc]
        def __call__(self, text: Any = None, *args: Any, **kwargs: Any) -> Any:
            if isinstance(text, str):
                text = "\u2581 " + text
            elif isinstance(text, list) and all(isinstance(t, str) for t in text):
                text = ["\u2581 " + t for t in text]
            return super().__call__(text, *args, **kwargs)

    tokenizer.__class__ = SentencePieceLike
    return tokenizer



def _fuyu(seed: int) -> ZooCase:
    """Fuyu: no vision tower, each 8x8 patch linearly embedded (``vision_embed_tokens``) into its ``|SPEAKER|``
    token; a Persimmon decoder; the real FuyuProcessor (at most one image per sample: it takes one)."""
    import transformers as T

    special = ["<pad>", "<unk>", "<s>", "</s>", "<0x04>", "|SPEAKER|", "|NEWLINE|", "\u2581"]
    tokenizer = _leading_space(word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<s>",
                                              eos_token="</s>"))
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in special}
    class FuyuImageProcessorPil(T.FuyuImageProcessorPil):
        """Its patchify_image is numpy code, and FuyuProcessor hands it torch tensors (its images_kwargs force
        return_tensors "pt"): the tensor goes in as an array, the patches come back as a tensor."""

        def patchify_image(self, image: Any, patch_size: Any = None) -> torch.Tensor:
            return torch.from_numpy(np.asarray(super().patchify_image(np.asarray(image), patch_size)))

    image_processor = FuyuImageProcessorPil(size={"height": 16, "width": 16}, patch_size={"height": 8, "width": 8})
    processor = T.FuyuProcessor(image_processor=image_processor, tokenizer=tokenizer)
    torch.manual_seed(seed)
    text = T.PersimmonConfig(**{**_text_config(len(tokenizer), pad_token_id=0, bos_token_id=ids["<s>"],
                                               eos_token_id=ids["</s>"]), "num_key_value_heads": 4})
    config = T.FuyuConfig(text_config=text, image_size=16, patch_size=8, image_token_id=ids["|SPEAKER|"])
    model = T.FuyuForCausalLM(config)
    samples = _items(seed, [(16, 16), (8, 16), (16, 8)])
    for sample in samples:  # one image at most
        sample["images"] = sample["images"][:1]
    return ZooCase("fuyu", model, samples, FuyuCollate(processor, tuple(ids.values())),
                   image_token_ids=(ids["|SPEAKER|"],), notes=["0 or 1 image per sample: its processor takes one"])


@dataclass
class Florence2Collate:
    """Florence-2 is an encoder-decoder: the processor writes image tokens + ``<s>`` + the prompt + ``</s>`` for the
    encoder (one image per text); the answer, tokenised apart, is the labels (padding -100), which the model shifts
    right into the decoder's inputs."""

    processor: Any

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        words = [s["text"].split() for s in samples]
        prompts = [" ".join(w[: max(1, len(w) // 3)]) for w in words]
        answers = [" ".join(w[max(1, len(w) // 3):]) + " </s>" for w in words]
        batch = dict(self.processor(text=prompts, images=[s["images"][0] for s in samples], padding=True,
                                    return_tensors="pt"))
        target = self.processor.tokenizer(answers, padding=True, return_tensors="pt", add_special_tokens=False)
        batch["labels"] = target["input_ids"].masked_fill(target["attention_mask"] == 0, -100)
        return batch


def _florence2(seed: int) -> ZooCase:
    """Florence-2: a DaViT tower (2 stages of stride 4, 2: a 16x16 image gives 2x2 features + a pooled one, 5 image
    tokens), a projector with learned position embeddings, a BART encoder-decoder; one image per sample."""
    import transformers as T

    special = ["<s>", "<pad>", "</s>", "<unk>", "<image>"]
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                               extra_special_tokens={"image_token": "<image>"})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in special}
    image_processor = T.CLIPImageProcessorPil(size={"height": 16, "width": 16}, do_center_crop=False)
    image_processor.image_seq_length = 5
    processor = T.Florence2Processor(image_processor=image_processor, tokenizer=tokenizer)
    torch.manual_seed(seed)
    vision = dict(depths=[1, 1], patch_size=[7, 3], patch_stride=[4, 2], patch_padding=[3, 1],
                  patch_prenorm=[False, True], embed_dim=[16, 32], num_heads=[2, 4], num_groups=[2, 4], window_size=2,
                  drop_path_rate=0.0, projection_dim=32, max_position_embeddings=8, max_temporal_embeddings=4)
    text = T.BartConfig(vocab_size=len(tokenizer), d_model=32, encoder_layers=1, decoder_layers=1,
                        encoder_ffn_dim=64, decoder_ffn_dim=64, encoder_attention_heads=4, decoder_attention_heads=4,
                        max_position_embeddings=64, dropout=0.0, pad_token_id=ids["<pad>"], bos_token_id=ids["<s>"],
                        eos_token_id=ids["</s>"], decoder_start_token_id=ids["</s>"],
                        forced_eos_token_id=ids["</s>"])
    config = T.Florence2Config(vision_config=vision, text_config=text, image_token_id=ids["<image>"])
    model = T.Florence2ForConditionalGeneration(config)
    samples = _items(seed, [(16, 16), (24, 16)])
    for i, sample in enumerate(samples):  # exactly one image per sample
        sample["images"] = sample["images"][:1] or _rng_images(seed + i, [(16, 16)])
    return ZooCase("florence2", model, samples, Florence2Collate(processor), image_token_ids=(ids["<image>"],),
                   notes=["one image per sample; an encoder-decoder: labels are the answer, not the input"])



def _llava(seed: int) -> ZooCase:
    import transformers as T

    special = ["<pad>", "<unk>", "<s>", "</s>", "<image>"]
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    image_processor = T.CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    processor = T.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                                 vision_feature_select_strategy="default", num_additional_image_tokens=1)
    torch.manual_seed(seed)
    vision = T.CLIPVisionConfig(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=4)
    config = T.LlavaConfig(vision_config=vision, text_config=T.LlamaConfig(**_text_config(len(tokenizer))),
                           image_token_id=image_id, vision_feature_select_strategy="default")
    model = T.LlavaForConditionalGeneration(config)
    collate = ProcessorCollate(processor, "<image>", (0, 1, 2, 3, image_id))
    return ZooCase("llava", model, _items(seed, [(20, 24), (16, 16)]), collate, image_token_ids=(image_id,))


def _llava_next(seed: int) -> ZooCase:
    import transformers as T

    special = ["<pad>", "<unk>", "<s>", "</s>", "<image>"]
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    image_processor = T.LlavaNextImageProcessorPil(
        size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16},
        image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]])
    processor = T.LlavaNextProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=8,
                                     vision_feature_select_strategy="default", num_additional_image_tokens=1)
    torch.manual_seed(seed)
    vision = T.CLIPVisionConfig(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64,
                                num_hidden_layers=2, num_attention_heads=4)
    config = T.LlavaNextConfig(vision_config=vision, text_config=T.LlamaConfig(**_text_config(len(tokenizer))),
                               image_token_id=image_id, vision_feature_select_strategy="default",
                               image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]])
    model = T.LlavaNextForConditionalGeneration(config)
    collate = ProcessorCollate(processor, "<image>", (0, 1, 2, 3, image_id))
    return ZooCase("llava_next", model, _items(seed, [(16, 32), (32, 32), (32, 16)]), collate,
                   image_token_ids=(image_id,))


def _idefics3(seed: int) -> ZooCase:
    """Idefics3, whose model and processor SmolVLM shares (SmolVLM's processor needs num2words, not installed)."""
    import transformers as T

    rows = [f"<row_{i + 1}_col_{j + 1}>" for i in range(6) for j in range(6)]
    special = ["<pad>", "<unk>", "<s>", "</s>", "<fake_token_around_image>", "<image>", "<end_of_utterance>",
               "<global-img>", *rows]
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  image_size=32, patch_size=8)
    image_processor = T.Idefics3ImageProcessorPil(size={"longest_edge": 64}, max_image_size={"longest_edge": 32})
    processor = T.Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_len=4)
    torch.manual_seed(seed)
    config = T.Idefics3Config(vision_config=vision, text_config=_text_config(len(tokenizer), pad_token_id=0),
                              image_token_id=image_id, scale_factor=2)
    model = T.Idefics3ForConditionalGeneration(config)
    ignore = tuple(tokenizer.convert_tokens_to_ids(t) for t in special)
    collate = ProcessorCollate(processor, "<image>", ignore)
    return ZooCase("idefics3", model, _items(seed, [(32, 32), (32, 48), (48, 32)]), collate,
                   image_token_ids=(image_id,))


@dataclass
class PaliGemmaCollate:
    """PaliGemma's processor writes the image tokens and the prefix itself; the suffix becomes the labels."""

    processor: Any

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        words = [s["text"].split() for s in samples]
        prefixes = [" ".join(w[: max(1, len(w) // 3)]) for w in words]
        suffixes = [" ".join(w[max(1, len(w) // 3):]) for w in words]
        images = [list(s["images"]) for s in samples]
        batch = self.processor(text=prefixes, suffix=suffixes, images=images, padding="longest",
                               return_tensors="pt")
        return dict(batch)


def _paligemma(seed: int) -> ZooCase:
    import transformers as T

    special = ["<pad>", "<eos>", "<bos>", "<unk>", "<image>"]
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>")
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    image_processor = T.SiglipImageProcessorPil(size={"height": 16, "width": 16})
    image_processor.image_seq_length = 4
    processor = T.PaliGemmaProcessor(image_processor=image_processor, tokenizer=tokenizer)
    torch.manual_seed(seed)
    vision = T.SiglipVisionConfig(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2)
    text = T.GemmaConfig(**_text_config(len(tokenizer), head_dim=8, pad_token_id=0))
    config = T.PaliGemmaConfig(vision_config=vision, text_config=text, image_token_id=image_id,
                               projection_dim=32)
    model = T.PaliGemmaForConditionalGeneration(config)
    samples = _items(seed, [(16, 16), (24, 16)])
    for sample in samples:  # PaliGemma takes at least one image per sample
        sample["images"] = sample["images"] or _rng_images(seed + 1, [(16, 16)])
    return ZooCase("paligemma", model, samples, PaliGemmaCollate(processor), image_token_ids=(image_id,),
                   notes=["every sample has 1 or 2 images: the PaliGemma processor takes no text-only sample"])


def _mllama(seed: int) -> ZooCase:
    import transformers as T

    special = ["<pad>", "<unk>", "<|begin_of_text|>", "<|end_of_text|>", "<|image|>", "<|python_tag|>"]
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<|begin_of_text|>",
                               eos_token="<|end_of_text|>")
    image_id = tokenizer.convert_tokens_to_ids("<|image|>")
    image_processor = T.MllamaImageProcessorPil(size={"height": 16, "width": 16}, max_image_tiles=2)
    processor = T.MllamaProcessor(image_processor=image_processor, tokenizer=tokenizer)
    torch.manual_seed(seed)
    vision = T.MllamaVisionConfig(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_global_layers=1, attention_heads=2,
                                  max_num_tiles=2, vision_output_dim=64, intermediate_layers_indices=[0],
                                  supported_aspect_ratios=[[1, 1], [1, 2], [2, 1]])
    text = T.MllamaTextConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                              num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                              cross_attention_layers=[1], pad_token_id=0)
    config = T.MllamaConfig(vision_config=vision, text_config=text, image_token_index=image_id)
    model = T.MllamaForConditionalGeneration(config)
    collate = MllamaCollate(ProcessorCollate(processor, "<|image|>", (0, 1, 2, 3, image_id)))
    return ZooCase("mllama", model, _items(seed, [(16, 16), (16, 32), (32, 16)]), collate,
                   image_token_ids=(image_id,), notes=[MllamaCollate.__doc__ or ""])


@dataclass
class MllamaCollate:
    """The processor's batch, padded to 2 image slots x 2 tiles for every batch (text-only ones too).

    Mllama lets a text row with no image attend to *all* image slots of its sample, padding included (Hugging Face's
    ``_prepare_cross_attention_mask`` unmasks fully masked rows, and only the MLP output is zeroed for them): its
    gradient depends on how many slots the collated batch pads to. With a fixed number of slots a sample sees the
    same thing in any micro-batch, as the exact full-batch gradient needs.
    """

    inner: ProcessorCollate
    images: int = 2
    tiles: int = 2

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = self.inner(samples)
        b, length = batch["input_ids"].shape
        if "pixel_values" not in batch:  # text-only: empty slots, as the processor pads them
            batch["pixel_values"] = torch.zeros(b, 0, self.tiles, 3, 16, 16)
            batch["aspect_ratio_ids"] = torch.zeros(b, 0, dtype=torch.long)
            batch["aspect_ratio_mask"] = torch.zeros(b, 0, self.tiles, dtype=torch.long)
            batch["cross_attention_mask"] = torch.zeros(b, length, 0, self.tiles, dtype=torch.long)
        pad_images = self.images - batch["pixel_values"].shape[1]
        pad_tiles = self.tiles - batch["pixel_values"].shape[2]
        batch["pixel_values"] = F.pad(batch["pixel_values"], (0, 0, 0, 0, 0, 0, 0, pad_tiles, 0, pad_images))
        batch["aspect_ratio_ids"] = F.pad(batch["aspect_ratio_ids"], (0, pad_images))
        mask = F.pad(batch["aspect_ratio_mask"], (0, pad_tiles, 0, pad_images))
        mask[:, :, 0] = 1  # a padding image has its first tile marked, as the processor marks it
        batch["aspect_ratio_mask"] = mask
        batch["cross_attention_mask"] = F.pad(batch["cross_attention_mask"], (0, pad_tiles, 0, pad_images))
        return batch


def _qwen3_vl(seed: int) -> ZooCase:
    """Qwen3-VL: patches of 16 merged 2x2, a DeepStack merger feeding a vision layer's features into the LM."""
    import transformers as T

    special = ["<pad>", "<unk>", "<s>", "</s>", "<|image_pad|>", "<|vision_start|>", "<|vision_end|>",
               "<|video_pad|>"]
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in special}
    image_processor = T.Qwen2VLImageProcessorPil(min_pixels=64 * 64, max_pixels=64 * 96, patch_size=16,
                                                 merge_size=2, temporal_patch_size=2)
    processor = images_only(T.Qwen3VLProcessor)(image_processor=image_processor, tokenizer=tokenizer,
                                                video_processor=None)
    text = _text_config(len(tokenizer), head_dim=8, bos_token_id=ids["<s>"], eos_token_id=ids["</s>"],
                        pad_token_id=0, rope_parameters={"rope_type": "default", "mrope_section": [2, 1, 1],
                                                         "mrope_interleaved": True, "rope_theta": 1e4})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=16, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=32, num_position_embeddings=16,
                  deepstack_visual_indexes=[0])
    torch.manual_seed(seed)
    config = T.Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                             video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                             vision_end_token_id=ids["<|vision_end|>"])
    model = T.Qwen3VLForConditionalGeneration(config)
    placeholder = "<|vision_start|><|image_pad|><|vision_end|>"
    collate = ProcessorCollate(processor, placeholder, tuple(ids.values()))
    samples = _items(seed, [(64, 64), (64, 96), (96, 64)])
    return ZooCase("qwen3_vl", model, samples, collate, image_token_ids=(ids["<|image_pad|>"],))


def _gemma3(seed: int) -> ZooCase:
    """Gemma 3: the processor expands ``<start_of_image>`` into boi + mm_tokens_per_image soft tokens + eoi; a
    SigLIP tower of 4x4 patches average-pooled to 2x2 = 4 tokens; token_type_ids mark the image tokens."""
    import transformers as T

    special = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_image>", "<end_of_image>", "<image_soft_token>"]
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<bos>", eos_token="<eos>",
                               extra_special_tokens={"image_token": "<image_soft_token>",
                                                     "boi_token": "<start_of_image>", "eoi_token": "<end_of_image>"})
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in special}
    image_processor = T.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = T.Gemma3Processor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4)
    torch.manual_seed(seed)
    vision = T.SiglipVisionConfig(image_size=32, patch_size=8, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2)
    text = T.Gemma3TextConfig(**_text_config(len(tokenizer), head_dim=8, pad_token_id=0, bos_token_id=ids["<bos>"],
                                             eos_token_id=ids["<eos>"], query_pre_attn_scalar=8, sliding_window=8,
                                             layer_types=["sliding_attention", "full_attention"]))
    config = T.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                            boi_token_index=ids["<start_of_image>"], eoi_token_index=ids["<end_of_image>"],
                            image_token_index=ids["<image_soft_token>"])
    model = T.Gemma3ForConditionalGeneration(config)
    collate = ProcessorCollate(processor, "<start_of_image>", tuple(ids.values()))
    return ZooCase("gemma3", model, _items(seed, [(32, 32), (32, 48), (48, 32)]), collate,
                   image_token_ids=(ids["<image_soft_token>"],))


def _internvl(seed: int) -> ZooCase:
    """InternVL: images cropped into tiles (+ a thumbnail) of 16x16, 16 patches each pixel-shuffled to 4 tokens
    between ``<img>``/``</img>``; the tokenizer pads on the left, as the real checkpoints' does."""
    import transformers as T

    special = ["<pad>", "<unk>", "<s>", "</s>", "<img>", "</img>", "<IMG_CONTEXT>", "<video>"]
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                               extra_special_tokens={"start_image_token": "<img>", "end_image_token": "</img>",
                                                     "context_image_token": "<IMG_CONTEXT>",
                                                     "video_token": "<video>"})
    tokenizer.padding_side = "left"
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in special}
    image_processor = T.GotOcr2ImageProcessorPil(size={"height": 16, "width": 16}, crop_to_patches=True,
                                                 min_patches=1, max_patches=2)
    processor = images_only(T.InternVLProcessor)(image_processor=image_processor, tokenizer=tokenizer,
                                                 video_processor=None, image_seq_length=4)
    torch.manual_seed(seed)
    vision = T.InternVLVisionConfig(image_size=16, patch_size=4, hidden_size=16, intermediate_size=32,
                                    num_hidden_layers=1, num_attention_heads=2)
    text = T.Qwen2Config(**_text_config(len(tokenizer), pad_token_id=0, bos_token_id=ids["<s>"],
                                        eos_token_id=ids["</s>"]))
    config = T.InternVLConfig(vision_config=vision, text_config=text, image_token_id=ids["<IMG_CONTEXT>"],
                              image_seq_length=4, downsample_ratio=0.5)
    model = T.InternVLForConditionalGeneration(config)
    collate = ProcessorCollate(processor, "<IMG_CONTEXT>", tuple(ids.values()))
    return ZooCase("internvl", model, _items(seed, [(16, 16), (16, 32), (32, 16)]), collate,
                   image_token_ids=(ids["<IMG_CONTEXT>"],))


def _llava_onevision(seed: int) -> ZooCase:
    """LLaVA-OneVision: a single image is anyres-tiled (base + tiles, unpadded, with newline tokens); each image of a
    multi-image sample is its base features + one newline; ``batch_num_images`` tells the model which."""
    import transformers as T

    special = ["<pad>", "<unk>", "<s>", "</s>", "<image>", "<video>"]
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in special}
    pinpoints = [[16, 16], [16, 32], [32, 16], [32, 32]]
    image_processor = T.LlavaOnevisionImageProcessorPil(size={"height": 16, "width": 16},
                                                        image_grid_pinpoints=pinpoints)
    processor = images_only(T.LlavaOnevisionProcessor)(image_processor=image_processor, tokenizer=tokenizer,
                                                       video_processor=None, num_image_tokens=4,
                                                       vision_feature_select_strategy="full")
    torch.manual_seed(seed)
    vision = T.SiglipVisionConfig(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2)
    text = T.Qwen2Config(**_text_config(len(tokenizer), pad_token_id=0))
    config = T.LlavaOnevisionConfig(vision_config=vision, text_config=text, image_token_index=ids["<image>"],
                                    video_token_index=ids["<video>"], vision_feature_select_strategy="full",
                                    image_grid_pinpoints=pinpoints)
    model = T.LlavaOnevisionForConditionalGeneration(config)
    collate = ProcessorCollate(processor, "<image>", tuple(ids.values()))
    return ZooCase("llava_onevision", model, _items(seed, [(16, 32), (32, 32), (32, 16)]), collate,
                   image_token_ids=(ids["<image>"],))


def _aya_vision(seed: int) -> ZooCase:
    """Aya Vision: SigLIP tiles (+ a global one) pixel-shuffled 2x2 into 4 ``<|IMG_PATCH|>`` tokens each; its text
    config is Cohere 2's, whose ``logit_scale`` (0.0625) Aya Vision's own head never applies."""
    import transformers as T

    special = ["<pad>", "<unk>", "<s>", "</s>", "<image>", "<|START_OF_IMG|>", "<|END_OF_IMG|>", "<|IMG_PATCH|>",
               "<|IMG_LINE_BREAK|>", "TILE_GLOBAL", "TILE_1", "TILE_2"]
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in special}
    image_processor = T.GotOcr2ImageProcessorPil(size={"height": 16, "width": 16}, crop_to_patches=True,
                                                 min_patches=1, max_patches=2)
    processor = T.AyaVisionProcessor(image_processor=image_processor, tokenizer=tokenizer, patch_size=4,
                                     img_size=16, downsample_factor=2)
    torch.manual_seed(seed)
    vision = T.SiglipVisionConfig(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=1, num_attention_heads=2, vision_use_head=False)
    text = T.Cohere2Config(**_text_config(len(tokenizer), head_dim=8, pad_token_id=0, bos_token_id=ids["<s>"],
                                          eos_token_id=ids["</s>"], sliding_window=8,
                                          layer_types=["sliding_attention", "full_attention"]))
    config = T.AyaVisionConfig(vision_config=vision, text_config=text, downsample_factor=2,
                               image_token_index=ids["<|IMG_PATCH|>"])
    model = T.AyaVisionForConditionalGeneration(config)
    collate = ProcessorCollate(processor, "<image>", tuple(ids.values()))
    return ZooCase("aya_vision", model, _items(seed, [(16, 16), (16, 32), (32, 16)]), collate,
                   image_token_ids=(ids["<|IMG_PATCH|>"],))


def _chameleon(seed: int) -> ZooCase:
    """Chameleon: each image a VQ-VAE's 4 discrete codes, written into the ``<image>`` placeholders as the BPE ids of
    its ``IMGIMG*`` vocabulary entries; the forward masks those entries' logits (``finfo.min``)."""
    import transformers as T

    codes = [f"IMGIMG{chr(ord('A') + i)}Z" for i in range(8)]  # code i's BPE token (digits written A..J)
    special = ["<pad>", "<unk>", "<s>", "</s>", "<image>", "<racm3:break>", "<eoss>", *codes]
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in special}
    image_processor = T.ChameleonImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    processor = T.ChameleonProcessor(image_processor=image_processor, tokenizer=tokenizer, image_seq_length=4)
    torch.manual_seed(seed)
    vq = dict(embed_dim=8, num_embeddings=len(codes), latent_channels=8, resolution=16, base_channels=32,
              channel_multiplier=[1, 1, 1, 1], num_res_blocks=1)
    config = T.ChameleonConfig(**_text_config(len(tokenizer), pad_token_id=0, bos_token_id=ids["<s>"],
                                              eos_token_id=ids["</s>"]), vq_config=vq,
                               vocabulary_map=tokenizer.get_vocab())
    model = T.ChameleonForConditionalGeneration(config)
    collate = ProcessorCollate(processor, "<image>", tuple(ids.values()), extra={"return_for_text_completion": True})
    return ZooCase("chameleon", model, _items(seed, [(16, 16), (24, 16)]), collate, image_token_ids=(ids["<image>"],))


def _pixtral_processor_class() -> type:
    """The real PixtralProcessor. Its module imports ``get_resize_output_image_size`` from the torchvision image
    processor's module (torchvision is absent here), only to count tokens for vLLM-style callers: it is imported with
    that module standing in as the PIL image processor's module, which defines the same function."""
    import importlib
    import sys

    name = "transformers.models.pixtral.processing_pixtral"
    if name in sys.modules:
        return sys.modules[name].PixtralProcessor
    torchvision_module = "transformers.models.pixtral.image_processing_pixtral"
    missing = torchvision_module not in sys.modules
    if missing:
        sys.modules[torchvision_module] = importlib.import_module(
            "transformers.models.pixtral.image_processing_pil_pixtral")
    try:
        return importlib.import_module(name).PixtralProcessor
    finally:
        if missing:
            del sys.modules[torchvision_module]


def _mistral3(seed: int) -> ZooCase:
    """Mistral 3 (Pixtral vision tower + 2x2 patch merger): PixtralProcessor expands ``[IMG]`` into rows of image
    tokens, each row ended by ``[IMG_BREAK]`` and the last by ``[IMG_END]``; images of different sizes are padded to
    the batch's largest, their true sizes in ``image_sizes``."""
    import transformers as T

    special = ["<pad>", "<unk>", "<s>", "</s>", "[IMG]", "[IMG_BREAK]", "[IMG_END]"]
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    ids = {t: tokenizer.convert_tokens_to_ids(t) for t in special}
    image_processor = T.PixtralImageProcessorPil(size={"longest_edge": 32}, patch_size=8)
    processor = _pixtral_processor_class()(image_processor=image_processor, tokenizer=tokenizer, patch_size=4,
                                           spatial_merge_size=2)
    torch.manual_seed(seed)
    vision = T.PixtralVisionConfig(image_size=32, patch_size=4, hidden_size=16, intermediate_size=32,
                                   num_hidden_layers=1, num_attention_heads=2, head_dim=8)
    text = T.MistralConfig(**_text_config(len(tokenizer), head_dim=8, pad_token_id=0, bos_token_id=ids["<s>"],
                                          eos_token_id=ids["</s>"], sliding_window=None))
    config = T.Mistral3Config(vision_config=vision, text_config=text, image_token_index=ids["[IMG]"],
                              spatial_merge_size=2)
    model = T.Mistral3ForConditionalGeneration(config)
    collate = ProcessorCollate(processor, "[IMG]", tuple(ids.values()))
    return ZooCase("mistral3", model, _items(seed, [(16, 16), (16, 32), (32, 24)]), collate,
                   image_token_ids=(ids["[IMG]"],))


def _llava_lora(seed: int) -> ZooCase:
    """LLaVA wrapped by the user with PEFT: ``get_peft_model(model, LoraConfig(r=8, ...))`` on the language model's
    q/v projections; the base frozen, the adapters trained (initialised non-zero: both A and B get gradients)."""
    import peft

    case = _llava(seed)
    torch.manual_seed(seed)
    config = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, init_lora_weights=False,
                             target_modules=r".*language_model.*\.(q_proj|v_proj)")
    case.model, case.name = peft.get_peft_model(case.model, config), "llava_lora"
    case.notes.append("a PeftModel: only the LoRA adapters train")
    return case


@dataclass
class OneImageCollate:
    """A processor that takes exactly one image with each text (InstructBLIP, Kosmos-2): labels = input_ids but for
    the ``ignore_ids`` and the image's own positions (``image_embeds_position_mask`` where the processor gives it)."""

    processor: Any
    ignore_ids: tuple[int, ...]
    extra: dict[str, Any] = field(default_factory=dict)

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = dict(self.processor(text=[s["text"] for s in samples], images=[s["images"][0] for s in samples],
                                    padding=True, return_tensors="pt", **self.extra))
        batch["labels"] = _labels(batch["input_ids"], self.ignore_ids)
        if "image_embeds_position_mask" in batch:
            batch["labels"] = batch["labels"].masked_fill(batch["image_embeds_position_mask"].bool(), -100)
        return batch


def _instructblip(seed: int) -> ZooCase:
    """InstructBLIP: a ViT, a Q-Former reading the image and the instruction (``qformer_input_ids``), a projection to
    the language model's width; the processor puts 4 query tokens before each text."""
    import transformers as T

    special = ["<pad>", "<unk>", "<s>", "</s>", "<image>"]
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    qformer_tokenizer = word_tokenizer(["[PAD]", "[UNK]"], pad_token="[PAD]", unk_token="[UNK]")
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    processor = T.InstructBlipProcessor(image_processor=T.BlipImageProcessorPil(size={"height": 16, "width": 16}),
                                        tokenizer=tokenizer, qformer_tokenizer=qformer_tokenizer, num_query_tokens=4)
    torch.manual_seed(seed)
    vision = T.InstructBlipVisionConfig(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4)
    qformer = T.InstructBlipQFormerConfig(vocab_size=len(qformer_tokenizer), hidden_size=32, num_hidden_layers=2,
                                          num_attention_heads=4, intermediate_size=64, encoder_hidden_size=32,
                                          pad_token_id=0, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    config = T.InstructBlipConfig(vision_config=vision, qformer_config=qformer, num_query_tokens=4,
                                  text_config=T.LlamaConfig(**_text_config(len(tokenizer), pad_token_id=0)),
                                  image_token_index=image_id)
    model = T.InstructBlipForConditionalGeneration(config)
    samples = _items(seed, [(16, 16), (24, 16)])
    for i, sample in enumerate(samples):  # exactly one image per sample
        sample["images"] = sample["images"][:1] or _rng_images(seed + i, [(16, 16)])
    return ZooCase("instructblip", model, samples, OneImageCollate(processor, (0, 1, 2, 3, image_id)),
                   image_token_ids=(image_id,), notes=["one image per sample: the model takes pixel_values always"])


def _blip2(seed: int) -> ZooCase:
    """BLIP-2 with a decoder-only LM (OPT): a ViT, a Q-Former of 4 learned queries (no text input), a projection to
    the LM's width; the processor puts 4 ``<image>`` tokens before each text (BOS included), one image per sample."""
    import transformers as T

    tokenizer = word_tokenizer(["<pad>", "<unk>", "<s>", "</s>"], pad_token="<pad>", unk_token="<unk>",
                               bos_token="<s>", eos_token="</s>")
    processor = T.Blip2Processor(image_processor=T.BlipImageProcessorPil(size={"height": 16, "width": 16}),
                                 tokenizer=tokenizer, num_query_tokens=4)  # adds its own <image> token
    image_id = tokenizer.convert_tokens_to_ids("<image>")
    torch.manual_seed(seed)
    vision = T.Blip2VisionConfig(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4)
    qformer = T.Blip2QFormerConfig(vocab_size=8, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=64, encoder_hidden_size=32, hidden_dropout_prob=0.0,
                                   attention_probs_dropout_prob=0.0)
    text = T.OPTConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, ffn_dim=64,
                       num_attention_heads=4, max_position_embeddings=128, dropout=0.0, pad_token_id=0,
                       bos_token_id=2, eos_token_id=3)
    config = T.Blip2Config(vision_config=vision, qformer_config=qformer, text_config=text, num_query_tokens=4,
                           image_token_index=image_id)
    model = T.Blip2ForConditionalGeneration(config)
    samples = _items(seed, [(16, 16), (24, 16)])
    for i, sample in enumerate(samples):  # exactly one image per sample
        sample["images"] = sample["images"][:1] or _rng_images(seed + i, [(16, 16)])
    return ZooCase("blip2", model, samples, OneImageCollate(processor, (0, 1, 2, 3, image_id)),
                   image_token_ids=(image_id,), notes=["one image per sample: the model takes pixel_values always"])



def _kosmos2(seed: int) -> ZooCase:
    """Kosmos-2: a CLIP-like ViT, a resampler of 4 latent queries, their embeddings written where
    ``image_embeds_position_mask`` says (after ``<image>``); one image per sample, as its processor takes."""
    import transformers as T

    special = ["<pad>", "<unk>", "<s>", "</s>"]
    tokenizer = word_tokenizer(special, pad_token="<pad>", unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    image_processor = T.CLIPImageProcessorPil(size={"shortest_edge": 16}, crop_size={"height": 16, "width": 16})
    processor = T.Kosmos2Processor(image_processor=image_processor, tokenizer=tokenizer, num_patch_index_tokens=4)
    torch.manual_seed(seed)
    vision = dict(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                  num_attention_heads=2)
    text = dict(vocab_size=len(tokenizer), embed_dim=32, layers=2, ffn_dim=64, attention_heads=4,
                max_position_embeddings=128, dropout=0.0, attention_dropout=0.0, activation_dropout=0.0,
                layerdrop=0.0, pad_token_id=0, bos_token_id=2, eos_token_id=3)
    config = T.Kosmos2Config(vision_config=vision, text_config=text, latent_query_num=4)
    model = T.Kosmos2ForConditionalGeneration(config)
    ignore = tuple(tokenizer.convert_tokens_to_ids(t) for t in [*special, *processor.tag_tokens])
    samples = _items(seed, [(16, 16), (24, 16)])
    for i, sample in enumerate(samples):  # exactly one image per sample
        sample["images"] = sample["images"][:1] or _rng_images(seed + i, [(16, 16)])
    return ZooCase("kosmos2", model, samples, OneImageCollate(processor, ignore, {"num_image_tokens": 4}),
                   notes=["one image per sample: its processor takes one image with each text"])

@dataclass
class TextCollate:
    """Tokenise and pad; labels = input_ids but padding."""

    tokenizer: Any

    def __call__(self, samples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        batch = dict(self.tokenizer([s["text"] for s in samples], padding=True, return_tensors="pt"))
        batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
        return batch


def _llama(seed: int) -> ZooCase:
    import transformers as T

    tokenizer = word_tokenizer(["<pad>", "<unk>", "<s>", "</s>"], pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(seed)
    model = T.LlamaForCausalLM(T.LlamaConfig(**_text_config(len(tokenizer), pad_token_id=0)))
    return ZooCase("llama", model, _items(seed, [], images=False), TextCollate(tokenizer))


def _gpt2(seed: int, double_heads: bool = False) -> ZooCase:
    import transformers as T

    tokenizer = word_tokenizer(["<pad>", "<unk>", "<|endoftext|>"], pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(seed)
    config = T.GPT2Config(vocab_size=len(tokenizer), n_embd=32, n_layer=2, n_head=4, n_positions=64,
                          resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0)
    model = (T.GPT2DoubleHeadsModel if double_heads else T.GPT2LMHeadModel)(config)
    name = "gpt2_double_heads" if double_heads else "gpt2"
    return ZooCase(name, model, _items(seed, [], images=False), TextCollate(tokenizer))


class TinyCNN(nn.Module):
    """A plain CNN classifier; its loss is the user's loss_fn (mean over samples)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.head = nn.Linear(8, 5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(F.relu(self.conv(x)).mean(dim=(2, 3)))


def cnn_loss(model: nn.Module, batch: Any) -> torch.Tensor:
    """The mean cross-entropy of a (images, classes) batch."""
    images, classes = batch
    return F.cross_entropy(model(images), classes)


def _cnn(seed: int) -> ZooCase:
    g = torch.Generator().manual_seed(seed)
    samples = [(torch.rand(3, 8, 8, generator=g), int(torch.randint(0, 5, (), generator=g)))
               for _ in range(N_SAMPLES)]
    torch.manual_seed(seed)
    from torch.utils.data import default_collate

    return ZooCase("cnn", TinyCNN(), samples, default_collate, loss_fn=cnn_loss, checkpoint_blocks=["conv"])


BUILDERS: dict[str, Callable[[int], ZooCase]] = {
    "qwen2_vl": _qwen2_vl,
    "qwen2_5_vl": lambda seed: _qwen2_vl(seed, version="2.5"),
    "llava": _llava,
    "llava_next": _llava_next,
    "idefics3": _idefics3,
    "paligemma": _paligemma,
    "mllama": _mllama,
    "qwen3_vl": _qwen3_vl,
    "gemma3": _gemma3,
    "internvl": _internvl,
    "llava_onevision": _llava_onevision,
    "mistral3": _mistral3,
    "llava_lora": _llava_lora,
    "instructblip": _instructblip,
    "aya_vision": _aya_vision,
    "chameleon": _chameleon,
    "kosmos2": _kosmos2,
    "blip2": _blip2,
    "qwen2_5_omni": _qwen2_5_omni,
    "phi4_multimodal": _phi4_multimodal,
    "glm4v": _glm4v,
    "idefics2": _idefics2,
    "fuyu": _fuyu,
    "florence2": _florence2,
    "llama": _llama,
    "gpt2": _gpt2,
    "gpt2_double_heads": lambda seed: _gpt2(seed, double_heads=True),
    "cnn": _cnn,
}
ZOO = tuple(BUILDERS)
VLM_CASES = ("qwen2_vl", "qwen2_5_vl", "llava", "llava_next", "idefics3", "paligemma", "mllama", "qwen3_vl",
             "gemma3", "internvl", "llava_onevision", "mistral3", "llava_lora", "instructblip", "aya_vision",
             "chameleon", "kosmos2", "blip2", "qwen2_5_omni", "phi4_multimodal", "glm4v", "idefics2", "fuyu",
             "florence2")


def build_case(name: str, seed: int = 0) -> ZooCase:
    """A fresh case (new model, seeded weights). Usage: ``build_case("llava_next")``"""
    return BUILDERS[name](seed)
