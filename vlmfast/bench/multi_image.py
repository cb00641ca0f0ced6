"""Generated multi-image samples for the ``cpu-vlm`` benchmark size: 0 to 4 shapes images and a long-tailed text each.

Real VLM fine-tuning data mixes text-only samples with multi-image ones and short answers with long documents; the
one-image, 7-57-token captions of the ``cpu`` size have neither. Sample ``i`` (a pure function of ``(seed, i)``) holds
``n`` images (uniform in ``min_images..max_images``) and a text of ``L`` tokens, ``L`` log-normal (median
``median_text``, sigma ``sigma``) clipped to ``[min_text, max_text]``: bos, the captions of its ``n`` scenes, then
captions of further scenes that have no image (learnable only as language) joined by "and", cut to ``L - 1`` tokens,
eos. Each image is ``image_tokens`` placeholder ids (``IMAGE_PLACEHOLDER_ID``) before the text, in the sample's
``input_ids``: the layout the tiny VLM reads from ``position_ids`` and ``images_per_row`` (see
:class:`MultiImageCollator`).

Usage::

    data = MultiImageShapesDataset(256, seed=0)
    batch = MultiImageCollator(image_size=48)([data[i] for i in range(8)])
    loss = TinyVLM(TinyVLMConfig(max_text_len=1060))(**batch).loss
"""

from __future__ import annotations

import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import Dataset

from vlmfast.data.packing import IMAGE_PLACEHOLDER_ID
from vlmfast.models.shapes import Scene, ShapesTokenizer, VLMCollator, render_scene, right_padded, sample_scene

__all__ = ["MultiImageCollator", "MultiImageShapesDataset"]


class MultiImageShapesDataset(Dataset[dict[str, Any]]):
    """``dataset[i]``: ``{"images": [uint8 [3, H, W], ...] (0..max_images), "input_ids": LongTensor [9n + L]}``.

    Usage: ``MultiImageShapesDataset(256, seed=0, max_images=4)[3]`` (see the module docstring)
    """

    def __init__(self, num_samples: int, seed: int = 0, *, max_images: int = 4, min_images: int = 0, min_text: int = 16,
                 max_text: int = 1024, median_text: float = 64.0, sigma: float = 1.1, max_objects: int = 8,
                 image_tokens: int = 9) -> None:
        if not 2 <= min_text <= median_text <= max_text:
            raise ValueError(f"need 2 <= min_text <= median_text <= max_text, got {min_text}, {median_text}, "
                             f"{max_text}")
        self.num_samples = num_samples
        self.seed = seed
        self.max_images = max_images
        self.min_images = min_images
        self.min_text, self.max_text, self.median_text, self.sigma = min_text, max_text, median_text, sigma
        self.max_objects = max_objects
        self.image_tokens = image_tokens
        self.tokenizer = ShapesTokenizer()

    def __len__(self) -> int:
        return self.num_samples

    def _plan(self, index: int) -> tuple[list[Scene], int, list[int]]:
        """(the scenes shown as images, their count, the text ids): cheap, nothing is rendered."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        rng = random.Random(self.seed * 1_000_003 + index)
        images = rng.randint(self.min_images, self.max_images)
        length = round(rng.lognormvariate(math.log(self.median_text), self.sigma))
        length = min(self.max_text, max(self.min_text, length))
        scenes: list[Scene] = []
        text: list[int] = []
        while len(scenes) < images or len(text) < length - 2:
            scene = sample_scene(rng, 24, 48, self.max_objects)
            words = ([self.tokenizer.token_to_id["and"]] if scenes else []) + self.tokenizer.encode(
                scene.caption(), add_special_tokens=False)
            scenes.append(scene)
            text += words
        ids = [self.tokenizer.bos_id, *text[: length - 2], self.tokenizer.eos_id]
        return scenes[:images], images, ids

    def num_images(self, index: int) -> int:
        """Images of sample ``index`` (nothing rendered)."""
        return self._plan(index)[1]

    def caption_ids(self, index: int) -> list[int]:
        """Sample ``index``'s ``input_ids`` (image placeholders, then bos ... eos), without rendering."""
        _, images, ids = self._plan(index)
        return [IMAGE_PLACEHOLDER_ID] * (images * self.image_tokens) + ids

    def __getitem__(self, index: int) -> dict[str, Any]:
        scenes, images, ids = self._plan(index)
        placeholders = [IMAGE_PLACEHOLDER_ID] * (images * self.image_tokens)
        return {"images": [render_scene(scene) for scene in scenes],
                "input_ids": torch.tensor(placeholders + ids, dtype=torch.long)}


@dataclass
class MultiImageCollator:
    """Right-padded rows with the images laid out per row, the tiny VLM's per-row layout.

    Returns ``input_ids`` / ``attention_mask`` / ``labels`` / ``position_ids`` (0..T-1: one sample per row) [B, T],
    ``pixel_values`` float32 [B, K, 3, S, S] (K: the batch's most images, at least 1; empty slots are zeros) and
    ``images_per_row`` [B]. Labels ignore pads and image placeholders. A plain dataclass: it pickles into workers.

    Usage: ``MultiImageCollator(image_size=48)([dataset[i] for i in range(8)])``
    """

    image_size: int = 48
    pad_id: int = 0
    ignore_index: int = -100
    _resize: VLMCollator = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self._resize = VLMCollator(image_size=self.image_size)

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        if not samples:
            raise ValueError("cannot collate an empty batch")
        input_ids, attention_mask = right_padded([s["input_ids"] for s in samples], self.pad_id)
        rows, longest = input_ids.shape
        labels = input_ids.masked_fill((attention_mask == 0) | (input_ids == IMAGE_PLACEHOLDER_ID), self.ignore_index)
        counts = [len(s["images"]) for s in samples]
        size = self.image_size
        pixel_values = torch.zeros(rows, max(1, *counts), 3, size, size)
        for row, sample in enumerate(samples):
            for slot, image in enumerate(sample["images"]):
                pixel_values[row, slot] = self._resize._resize(image)[0]
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels,
                "position_ids": torch.arange(longest).repeat(rows, 1), "pixel_values": pixel_values,
                "images_per_row": torch.tensor(counts)}
