"""Generated image-caption data for the tiny VLM: coloured shapes on a 3x3 grid.

Every sample is a pure function of ``(seed, index)``. Captions describe every shape in the image, so a
model that looks at the image can predict them almost perfectly, while a model that ignores the image
can do no better than the caption entropy, which we know exactly (``text_nll`` per sample). That gap is
the learning signal the tests and benchmarks check.

Usage::

    model, dataset, collator = build_tiny_vlm_task(seed=0)
    batch = collator([dataset[i] for i in range(16)])
    loss = model(**batch).loss
"""

from __future__ import annotations

import functools
import math
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.data import Dataset

__all__ = [
    "COLORS",
    "SHAPES",
    "Scene",
    "ShapeSpec",
    "ShapesCaptionDataset",
    "ShapesTokenizer",
    "VLMCollator",
    "render_scene",
    "sample_scene",
    "text_only_baseline_loss",
]

SPECIAL_TOKENS: tuple[str, ...] = ("<pad>", "<bos>", "<eos>")
SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "cross")
# Bright, well-separated colours so they stay distinguishable after bilinear resizing on a dark background.
COLORS: dict[str, tuple[int, int, int]] = {
    "red": (230, 40, 40),
    "green": (40, 200, 60),
    "blue": (60, 100, 250),
    "yellow": (235, 220, 40),
    "cyan": (40, 220, 230),
    "magenta": (220, 50, 220),
    "white": (245, 245, 245),
    "gray": (140, 140, 140),
}
ROWS: tuple[str, ...] = ("top", "middle", "bottom")
COLS: tuple[str, ...] = ("left", "center", "right")
# None = no adjective in the caption (medium size); the size is always visible in the image.
SIZE_CHOICES: tuple[str | None, ...] = (None, "small", "big")
SIZE_SCALE: dict[str | None, float] = {None: 0.7, "small": 0.45, "big": 0.95}
NUM_CELLS = len(ROWS) * len(COLS)


class ShapesTokenizer:
    """Word-level tokenizer over every word a shapes caption can use.

    Usage: ``tok = ShapesTokenizer(); ids = tok.encode("a red circle top left"); tok.decode(ids)``
    """

    pad_id = 0
    bos_id = 1
    eos_id = 2

    def __init__(self) -> None:
        words = ["a", "and", *(s for s in SIZE_CHOICES if s), *COLORS, *SHAPES, *ROWS, *COLS]
        self.id_to_token: list[str] = [*SPECIAL_TOKENS, *words]
        self.token_to_id: dict[str, int] = {tok: i for i, tok in enumerate(self.id_to_token)}

    @property
    def vocab_size(self) -> int:
        """Number of token ids, specials included."""
        return len(self.id_to_token)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Map a caption to ids, wrapped in bos/eos unless ``add_special_tokens=False``."""
        try:
            ids = [self.token_to_id[word] for word in text.split()]
        except KeyError as err:
            raise ValueError(f"word {err.args[0]!r} is not in the shapes vocabulary") from err
        return [self.bos_id, *ids, self.eos_id] if add_special_tokens else ids

    def decode(self, ids: Sequence[int] | Tensor, skip_special_tokens: bool = True) -> str:
        """Map ids back to a caption; special tokens are dropped unless ``skip_special_tokens=False``."""
        id_list = ids.tolist() if isinstance(ids, Tensor) else list(ids)
        skip = len(SPECIAL_TOKENS) if skip_special_tokens else 0
        return " ".join(self.id_to_token[i] for i in id_list if i >= skip)


@dataclass(frozen=True)
class ShapeSpec:
    """One object in a scene: what it is, where it is and how big (usage: internal to the dataset)."""

    shape: str
    color: str
    size: str | None
    cell: int  # 0..8, row-major over the 3x3 grid (top left = 0)
    jitter_y: float  # offset from the cell centre as a fraction of the free room, in [-1, 1]
    jitter_x: float

    def caption(self) -> str:
        """E.g. ``"a big red circle top left"``."""
        words = ["a", self.size, self.color, self.shape, ROWS[self.cell // 3], COLS[self.cell % 3]]
        return " ".join(w for w in words if w)


@dataclass(frozen=True)
class Scene:
    """All random decisions behind one sample (usage: ``scene = dataset.scene(i)``)."""

    height: int
    width: int
    background: tuple[int, int, int]
    objects: tuple[ShapeSpec, ...]
    text_nll: float  # -log p(caption) under the true caption distribution, in nats

    def caption(self) -> str:
        """Objects in ``COLORS`` order, joined by ``and``."""
        return " and ".join(obj.caption() for obj in self.objects)


def sample_scene(rng: random.Random, min_image_size: int, max_image_size: int, max_objects: int) -> Scene:
    """Draw one scene; ``text_nll`` sums -log p over exactly the choices the caption reveals.

    Usage: ``scene = sample_scene(random.Random(0), 24, 48, 3)``
    """
    height = rng.randint(min_image_size, max_image_size)
    width = rng.randint(min_image_size, max_image_size)
    background = (rng.randint(0, 40), rng.randint(0, 40), rng.randint(0, 40))
    num = rng.randint(1, max_objects)
    # Objects are listed in the fixed COLORS order, so caption <-> decisions is one-to-one and
    # -log p(caption) is just the sum of the decisions' -log p below. Colour order (rather than
    # position order) lets a model find "the next object" from the bag of colours in the image and
    # then look its patch up by colour; with position order a small model learned the layout from
    # the image but hardly ever the colours, shapes and sizes.
    chosen = set(rng.sample(list(COLORS), num))
    colors = [c for c in COLORS if c in chosen]
    cells = rng.sample(range(NUM_CELLS), num)  # ordered, distinct
    objects = tuple(
        ShapeSpec(
            shape=rng.choice(SHAPES),
            color=color,
            size=rng.choice(SIZE_CHOICES),
            cell=cell,
            jitter_y=rng.uniform(-1.0, 1.0),
            jitter_x=rng.uniform(-1.0, 1.0),
        )
        for cell, color in zip(cells, colors, strict=True)
    )
    nll = math.log(max_objects) + math.log(math.comb(len(COLORS), num))  # count, colour set
    nll += sum(math.log(NUM_CELLS - k) for k in range(num))  # cells, in caption order
    nll += num * (math.log(len(SHAPES)) + math.log(len(SIZE_CHOICES)))  # shape, size per object
    return Scene(height, width, background, objects, nll)


def _shape_mask(shape: str, dy: np.ndarray, dx: np.ndarray, radius: float) -> np.ndarray:
    """Boolean [H, W] mask of ``shape`` centred at the origin of (dy, dx) with half-extent ``radius``."""
    ady, adx = np.abs(dy), np.abs(dx)
    if shape == "circle":
        return dy * dy + dx * dx <= radius * radius
    if shape == "square":
        # Shrunk so a square and a circle of the same size cover a similar area.
        return np.maximum(ady, adx) <= 0.85 * radius
    if shape == "triangle":
        # Apex up: half-width grows linearly from 0 at the top (dy = -r) to r at the base (dy = r).
        return (dy <= radius) & (adx <= (dy + radius) / 2)
    if shape == "cross":
        arm = radius / 3
        return ((adx <= arm) & (ady <= radius)) | ((ady <= arm) & (adx <= radius))
    raise ValueError(f"unknown shape {shape!r}")


def render_scene(scene: Scene) -> Tensor:
    """Rasterise a scene into a uint8 [3, H, W] image (vectorised: one mask per object).

    In numpy: an image is a few dozen tiny array operations, and torch's per-operator dispatch made rendering ~35x
    slower (about 10 % of the demo's step time spent waiting for data). The float32 arithmetic is the same as the
    earlier torch version's, bit for bit (tests/test_adoption.py compares them).

    Usage: ``image = render_scene(dataset.scene(0))``
    """
    h, w = scene.height, scene.width
    ys = (np.arange(h, dtype=np.float32) + np.float32(0.5)).reshape(h, 1)
    xs = (np.arange(w, dtype=np.float32) + np.float32(0.5)).reshape(1, w)
    image = np.empty((3, h, w), dtype=np.uint8)
    image[:] = np.asarray(scene.background, dtype=np.uint8).reshape(3, 1, 1)
    cell_h, cell_w = h / len(ROWS), w / len(COLS)
    for obj in scene.objects:
        # Size relative to the shorter cell side keeps shapes undistorted in non-square images.
        radius = SIZE_SCALE[obj.size] * min(cell_h, cell_w) / 2
        cy = (obj.cell // 3 + 0.5) * cell_h + obj.jitter_y * 0.5 * max(0.0, cell_h / 2 - radius)
        cx = (obj.cell % 3 + 0.5) * cell_w + obj.jitter_x * 0.5 * max(0.0, cell_w / 2 - radius)
        # The centre rounded to float32 first, as torch did for `tensor - python_float`.
        mask = _shape_mask(obj.shape, ys - np.float32(cy), xs - np.float32(cx), radius)
        image[:, mask] = np.asarray(COLORS[obj.color], dtype=np.uint8).reshape(3, 1)
    return torch.from_numpy(image)


class ShapesCaptionDataset(Dataset[dict[str, Any]]):
    """Map-style dataset of rendered shape scenes and their captions.

    ``dataset[i]`` is a pure function of ``(seed, i)`` and returns ``{"image": uint8 [3, H, W],
    "input_ids": LongTensor [T] (bos ... eos), "text_nll": float}``.

    Usage: ``ds = ShapesCaptionDataset(num_samples=1024, seed=0); sample = ds[3]``
    """

    def __init__(
        self,
        num_samples: int = 4096,
        seed: int = 0,
        min_image_size: int = 24,
        max_image_size: int = 48,
        max_objects: int = 3,
    ) -> None:
        if not 1 <= min_image_size <= max_image_size:
            raise ValueError(f"bad image size range [{min_image_size}, {max_image_size}]")
        if not 1 <= max_objects <= min(NUM_CELLS, len(COLORS)):
            raise ValueError(f"max_objects must be in [1, {min(NUM_CELLS, len(COLORS))}], got {max_objects}")
        self.num_samples = num_samples
        self.seed = seed
        self.min_image_size = min_image_size
        self.max_image_size = max_image_size
        self.max_objects = max_objects
        self.tokenizer = ShapesTokenizer()

    def __len__(self) -> int:
        return self.num_samples

    @functools.cached_property
    def lengths(self) -> list[int]:
        """Caption tokens per sample (no rendering), for `data.group_by_length` and packing plans."""
        return [len(self.caption_ids(i)) for i in range(self.num_samples)]

    def scene(self, index: int) -> Scene:
        """The random decisions behind sample ``index`` (cheap: nothing is rendered)."""
        if not 0 <= index < self.num_samples:
            raise IndexError(f"index {index} out of range for {self.num_samples} samples")
        # A local RNG keyed on (seed, index) keeps samples independent of worker order and global state.
        rng = random.Random(self.seed * 1_000_003 + index)
        return sample_scene(rng, self.min_image_size, self.max_image_size, self.max_objects)

    def caption_ids(self, index: int) -> list[int]:
        """Token ids (bos ... eos) of sample ``index``'s caption, without rendering the image."""
        return self.tokenizer.encode(self.scene(index).caption())

    def __getitem__(self, index: int) -> dict[str, Any]:
        scene = self.scene(index)
        return {
            "image": render_scene(scene),
            "input_ids": torch.tensor(self.tokenizer.encode(scene.caption()), dtype=torch.long),
            "text_nll": scene.text_nll,
        }


def right_padded(sequences: Sequence[Any], pad_id: int) -> tuple[Tensor, Tensor]:
    """Token sequences as one right-padded ``input_ids`` [rows, longest] and its ``attention_mask`` (1 on tokens).
    Usage: ``input_ids, attention_mask = right_padded([s["input_ids"] for s in samples], pad_id=0)``"""
    ids = [torch.as_tensor(seq, dtype=torch.long) for seq in sequences]
    input_ids = torch.full((len(ids), max(len(x) for x in ids)), pad_id, dtype=torch.long)
    attention_mask = torch.zeros_like(input_ids)
    for row, seq in enumerate(ids):
        input_ids[row, : len(seq)] = seq
        attention_mask[row, : len(seq)] = 1
    return input_ids, attention_mask


@dataclass
class VLMCollator:
    """Batch samples into model inputs: resized, normalised images and right-padded captions.

    Returns ``pixel_values`` float32 [B, 3, S, S] in [-1, 1], ``input_ids`` / ``attention_mask`` /
    ``labels`` [B, T]; labels equal input_ids with pads set to ``ignore_index`` (the model shifts them).
    A plain dataclass so it pickles into DataLoader workers.

    Usage: ``batch = VLMCollator(image_size=32)([dataset[i] for i in range(8)])``
    """

    image_size: int = 48  # TinyVLMConfig().image_size
    pad_id: int = 0
    ignore_index: int = -100

    def __call__(self, samples: Sequence[Mapping[str, Any]]) -> dict[str, Tensor]:
        if not samples:
            raise ValueError("cannot collate an empty batch")
        pixel_values = torch.cat([self._resize(s["image"]) for s in samples])
        input_ids, attention_mask = right_padded([s["input_ids"] for s in samples], self.pad_id)
        labels = input_ids.masked_fill(attention_mask == 0, self.ignore_index)
        return {
            "pixel_values": pixel_values,
            "input_ids": input_ids,
            "attention_mask": attention_mask,
            "labels": labels,
        }

    def _resize(self, image: Tensor) -> Tensor:
        """uint8 [3, H, W] -> float32 [1, 3, S, S], normalised with mean = std = 0.5."""
        x = image.unsqueeze(0).float().div_(255.0)
        size = (self.image_size, self.image_size)
        # Antialiasing matters when downscaling: without it small shapes alias away.
        x = F.interpolate(x, size=size, mode="bilinear", antialias=True, align_corners=False)
        return x.sub_(0.5).div_(0.5)


def text_only_baseline_loss(dataset: ShapesCaptionDataset, num_samples: int | None = None) -> float:
    """Best per-token loss (nats) any model that ignores the image can reach on ``dataset``.

    A text-only model can at best predict the true caption distribution, so its loss on a caption is
    ``-log p(caption)``, which is the sample's ``text_nll`` (the sum of -log p of the caption's random
    choices). We count it exactly like ``TinyVLM``'s loss: the total over the first ``num_samples``
    samples (all by default) divided by the number of shifted label tokens, i.e. every caption token
    after bos, eos included. A model whose training loss falls clearly below this uses the image.

    Usage: ``baseline = text_only_baseline_loss(ShapesCaptionDataset(seed=0), num_samples=2048)``
    """
    count = len(dataset) if num_samples is None else min(num_samples, len(dataset))
    if count <= 0:
        raise ValueError("need at least one sample")
    total_nll, total_tokens = 0.0, 0
    for i in range(count):
        scene = dataset.scene(i)  # no rendering: only the caption matters here
        total_nll += scene.text_nll
        total_tokens += len(dataset.tokenizer.encode(scene.caption())) - 1
    return total_nll / total_tokens
