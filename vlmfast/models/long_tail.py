"""Long-tailed VLM samples for the tiny VLM: a few long ones, many short ones, 0 to 8 images each.

Usage::

    samples = long_tailed_samples(64, max_text=512, seed=0)        # dicts: input_ids, labels, images [n, 3, S, S]
    batch = collate_per_row_images(samples)                        # padded rows, images laid out per row
    loss = TinyVLM(TinyVLMConfig(max_text_len=600))(**batch).loss

Real VLM fine-tuning data spans 10 to 8K tokens and 0 to 8 images per sample, with most samples short (a log-normal
length distribution). This generator draws text lengths log-normally, clipped to ``[min_text, max_text]`` (the
default ``max_text=512`` is 8K scaled down by 16), and images uniformly from 0 to ``max_images``. Each image becomes
``image_tokens`` placeholder tokens (``IMAGE_PLACEHOLDER_ID``) at the start of the sample, which is the layout the
tiny VLM reads from ``position_ids`` (one document per row) and ``images_per_row``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from vlmfast.data.packing import IMAGE_PLACEHOLDER_ID

__all__ = ["collate_per_row_images", "long_tailed_samples"]


def long_tailed_samples(n: int, *, min_text: int = 8, max_text: int = 512, max_images: int = 8, image_tokens: int = 9,
                        image_size: int = 48, vocab: int = 64, seed: int = 0) -> list[dict[str, Tensor]]:
    """``n`` samples: text lengths log-normal in ``[min_text, max_text]`` (median ~ max_text / 12), 0..max_images
    images, ``image_tokens`` placeholders per image before the text; labels are the text (images carry no loss)."""
    g = torch.Generator().manual_seed(seed)
    median = max(min_text, max_text / 12)
    lengths = torch.exp(math.log(median) + 1.0 * torch.randn(n, generator=g)).round().clamp(min_text, max_text).long()
    images = torch.randint(0, max_images + 1, (n,), generator=g)
    samples = []
    for length, count in zip(lengths.tolist(), images.tolist(), strict=True):
        text = torch.randint(3, vocab, (length,), generator=g)
        holders = torch.full((count * image_tokens,), IMAGE_PLACEHOLDER_ID)
        samples.append({
            "input_ids": torch.cat([holders, text]),
            "labels": torch.cat([torch.full_like(holders, -100), text]),
            "images": torch.randn(count, 3, image_size, image_size, generator=g),
        })
    return samples


def collate_per_row_images(samples: Sequence[dict[str, Any]]) -> dict[str, Tensor]:
    """Right-padded rows with ``attention_mask``, ``position_ids`` 0..T-1 per row, and the images laid out per row:
    ``pixel_values`` [rows, most images, 3, S, S] plus ``images_per_row`` (the tiny VLM's packed-row layout)."""
    longest = max(len(s["input_ids"]) for s in samples)
    rows = len(samples)
    ids = torch.zeros(rows, longest, dtype=torch.long)
    labels = torch.full((rows, longest), -100, dtype=torch.long)
    mask = torch.zeros(rows, longest, dtype=torch.long)
    counts = torch.tensor([s["images"].shape[0] for s in samples])
    image_shape = samples[0]["images"].shape[1:]
    pixels = torch.zeros(rows, max(int(counts.max()), 1), *image_shape)
    for r, sample in enumerate(samples):
        n = len(sample["input_ids"])
        ids[r, :n], labels[r, :n], mask[r, :n] = sample["input_ids"], sample["labels"], 1
        pixels[r, : counts[r]] = sample["images"]
    return {"input_ids": ids, "labels": labels, "attention_mask": mask, "pixel_values": pixels,
            "images_per_row": counts, "position_ids": torch.arange(longest).repeat(rows, 1)}
