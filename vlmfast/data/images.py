"""Batched image preprocessing on the device: resize + normalise a whole batch, one op per distinct image size.

Per-image resizing in DataLoader workers costs CPU time per image; on a GPU the same bilinear (antialiased) resize
of a stack of same-size images is one kernel. Images of a batch are grouped by (H, W), each group is stacked,
resized and normalised at once, and the results are put back in the batch's order.

Usage::

    pixel_values = preprocess_images(images, size=224, device="cuda")          # list of uint8 [3, H, W] tensors
    collate = DeviceImageCollator(image_size=48)        # tiny VLM collator that leaves images raw (batch["images"])
    batch = BatchImagePreprocessor(size=48)(move_to_device(collate(samples), device))   # -> batch["pixel_values"]
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from vlmfast.attention.documents import host_to_device
from vlmfast.models.shapes import VLMCollator


def group_by_size(images: Sequence[Tensor]) -> dict[tuple[int, int], list[int]]:
    """Indices of the images of each (H, W), in the order of first appearance."""
    groups: dict[tuple[int, int], list[int]] = defaultdict(list)
    for index, image in enumerate(images):
        if image.dim() != 3:
            raise ValueError(f"image {index} has shape {tuple(image.shape)}: expected [channels, height, width]")
        groups[(image.shape[-2], image.shape[-1])].append(index)
    return groups


def preprocess_images(
    images: Sequence[Tensor],
    size: int | tuple[int, int],
    mean: Sequence[float] = (0.5, 0.5, 0.5),
    std: Sequence[float] = (0.5, 0.5, 0.5),
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
) -> Tensor:
    """uint8 (0-255) or float (0-1) images [C, H, W] of any sizes -> normalised [B, C, size, size] on `device`."""
    if not images:
        raise ValueError("preprocess_images got no images")
    target = (size, size) if isinstance(size, int) else tuple(size)
    device = torch.device(device) if device is not None else images[0].device
    # Python values reach the device through pinned memory and non-blocking copies: torch.tensor(..., device=cuda)
    # copies from pageable memory, which makes the host wait (CUDA's "API synchronization behavior" for
    # cudaMemcpyAsync from pageable memory).
    mean_t = host_to_device(list(mean), device, dtype).view(1, -1, 1, 1)
    std_t = host_to_device(list(std), device, dtype).view(1, -1, 1, 1)
    groups = group_by_size(images)
    out = None if len(groups) == 1 else torch.empty((len(images), images[0].shape[0], *target), dtype=dtype,
                                                    device=device)
    for (height, width), indices in groups.items():
        stack = _to_device(torch.stack([images[i] for i in indices]), device)
        scale = 255.0 if stack.dtype == torch.uint8 else 1.0
        stack = stack.to(dtype).div_(scale)
        if (height, width) != target:
            # Antialiasing matters when downscaling: without it small details alias away (as VLMCollator does).
            stack = F.interpolate(stack, size=target, mode="bilinear", antialias=True, align_corners=False)
        stack = stack.sub_(mean_t).div_(std_t)
        if out is None:  # one size: the batch is already in order, no scatter
            return stack
        out.index_copy_(0, host_to_device(indices, device), stack)
    return out


def _to_device(stack: Tensor, device: torch.device) -> Tensor:
    """A host stack on `device`; on CUDA copied from pinned memory so the copy is asynchronous (torch.stack's result
    is pageable even when the images were pinned)."""
    if device.type == "cuda" and stack.device.type == "cpu" and not stack.is_pinned():
        stack = stack.pin_memory()
    return stack.to(device, non_blocking=True)


@dataclass
class BatchImagePreprocessor:
    """Replace a batch's list of raw images (`image_key`) by normalised `pixel_values`, on the batch's device."""

    size: int
    mean: tuple[float, ...] = (0.5, 0.5, 0.5)
    std: tuple[float, ...] = (0.5, 0.5, 0.5)
    image_key: str = "images"
    output_key: str = "pixel_values"

    def __call__(self, batch: Mapping[str, Any]) -> dict[str, Any]:
        if self.image_key not in batch:
            raise KeyError(f"data.device_image_size is set but the batch has no '{self.image_key}' key (keys: "
                           f"{', '.join(batch)}): collate raw images into a list under data.image_key")
        out = dict(batch)
        images = out.pop(self.image_key)
        out[self.output_key] = preprocess_images(images, self.size, self.mean, self.std)
        return out


@dataclass
class DeviceImageCollator(VLMCollator):
    """The tiny VLM's collator without the per-image resize: `images` is the list of raw uint8 [3, H, W] images.

    Pair it with ``data.device_image_size`` (or :class:`BatchImagePreprocessor`) to resize on the device.
    """

    images_key: str = "images"

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
        batch: dict[str, Any] = dict(super().__call__(samples))
        batch.pop("pixel_values")
        batch[self.images_key] = [torch.as_tensor(s["image"]) for s in samples]
        return batch

    def _resize(self, image: Tensor) -> Tensor:
        return image.new_empty((1, 0))  # no per-image work in the workers: the device resizes the whole batch
