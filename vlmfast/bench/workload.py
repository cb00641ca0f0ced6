"""What every contender trains: one model init, one generated data set in one order, one way to count work.

A :class:`Workload` holds the built-in tiny VLM at a named size (``cpu``: the default config, a step of tens of
ms on a laptop core; ``cpu-vlm``: a 21.7M-parameter VLM on multi-image samples with long-tailed text, a step of
seconds on a CPU, see :mod:`vlmfast.bench.multi_image`; ``gpu``: a ViT-B/16 tower + a 12-layer 768-d decoder, ~150M
parameters), the initial weights
(every run starts from the same ones), a data set of exactly ``(warmup + steps) x batch_size`` samples in a fixed
shuffled order (every contender sees every sample once), and held-out batches for an evaluation loss that is
computed the same way for everyone after training.

Work is counted from the batch each contender actually feeds its model, so padding and packing cannot inflate it:
real tokens (caption + image tokens, never pads), token slots (what the model computed on, pads included) and model
FLOPs of the real tokens (vlmfast.profiling's analytic formula: 6N per token + attention over each sample's own
length, vision tower included).

Usage::

    workload = build_workload("cpu", steps=40, warmup=5)
    model = workload.build_model(attention="eager")     # same init every call
    stats = workload.batch_stats(batch)                 # lazy tensors: no device sync
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset

from vlmfast.attention import set_attention_backend
from vlmfast.attention.documents import PackedDocuments
from vlmfast.bench.multi_image import MultiImageCollator, MultiImageShapesDataset
from vlmfast.models import ShapesCaptionDataset, TinyVLM, TinyVLMConfig, VLMCollator
from vlmfast.profiling import analytic_flops, transformer_flops
from vlmfast.profiling.flops import describe_towers

__all__ = ["MODEL_SIZES", "SIZES", "BenchDataset", "BenchSize", "Workload", "build_shapes_workload", "evaluate_loss"]

# Model configurations (TinyVLMConfig fields); "base" is benchmarks/mfu.py's ~150M-parameter VLM-like model.
MODEL_SIZES: dict[str, dict[str, Any]] = {
    "tiny": {},
    "base": {"image_size": 224, "patch_size": 16, "vision_dim": 768, "vision_layers": 12, "vision_heads": 12,
             "text_dim": 768, "text_layers": 12, "text_heads": 12, "max_text_len": 64},
    # 21.7M parameters (18.9M in the 6 decoder layers): compute-bound on a CPU. Positions for 4 images of 9 tokens
    # and 1024 text tokens (the model adds one image's 9 to max_text_len).
    "vlm20m": {"vision_dim": 256, "vision_layers": 2, "vision_heads": 4, "text_dim": 512, "text_layers": 6,
               "text_heads": 8, "max_text_len": 1024 + 3 * 9},
}


@dataclass(frozen=True)
class BenchSize:
    """A benchmark size: model config, samples per optimizer step, learning rate, the data, default run length."""

    model: str
    batch_size: int
    lr: float
    # Up to 8 objects per scene: captions of 7-57 tokens, so a random batch of 16 is ~40% padding (image tokens
    # included) and padding, grouping and packing strategies have real waste to remove.
    max_objects: int = 8
    eval_samples: int = 64
    # "captions": one image and its caption per sample (ShapesCaptionDataset, VLMCollator); "multi-image": 0-4
    # images and 16-1024 text tokens, long-tailed (vlmfast.bench.multi_image), image placeholders in input_ids;
    # "processor": a Hugging Face model (vlmfast.bench.hf_vlm), one image and a long text per sample, collated as
    # its processor would (ProcessorCollator); batch_size 0: the batch that fills an 80 GB GPU by the estimator.
    data: str = "captions"
    steps: int = 40  # `vlmfast bench` defaults for --steps / --warmup
    warmup: int = 5
    pack_tokens: int | None = None  # packing's row budget; None: the device type's (configs.PACK_TOKENS)
    configs: tuple[str, ...] | None = None  # the rows `vlmfast bench` runs by default (None: all)


SIZES: dict[str, BenchSize] = {
    "cpu": BenchSize(model="tiny", batch_size=16, lr=1e-3),
    # A model big enough to be compute-bound on a CPU (the tiny one's step is Python-bound), on data where padding
    # is most of a padded batch: 4 samples per step (a padded batch of 4 is ~50 % padding), 2 + 20 steps, ~0.3-4 s
    # each on 2 idle cores (a batch holding a 1,000-token sample is 10x its neighbours: 8 timed steps left the
    # ratios at the mercy of where those fell). lr 3e-4: 1e-3 made the first steps' loss jump at this size.
    "cpu-vlm": BenchSize(model="vlm20m", batch_size=4, lr=3e-4, eval_samples=32, data="multi-image", steps=20,
                         warmup=2, pack_tokens=1024 + 4 * 9),
    "gpu": BenchSize(model="base", batch_size=32, lr=3e-4),
    # 1.4B-parameter LLaVA (CLIP ViT-L/14-336 + TinyLlama-1.1B shapes), 1,000-2,024 tokens per sample, bf16 on a GPU.
    # Rows: the starting point and each tool's best (an equal-settings row at fp32 would not fit the batch).
    "gpu-1b": BenchSize(model="gpu-1b", batch_size=0, lr=1e-4, eval_samples=16, data="processor", steps=30,
                        warmup=3, pack_tokens=2048,
                        configs=("start", "vlmfast-best", "accelerate-best", "hf-best", "fabric-best")),
}


class BenchDataset(Dataset):
    """Generated samples in a fixed order, with ``lengths`` (the ``input_ids`` of each sample: captions; with
    multi-image data, image placeholders included) for length grouping.

    Usage: ``BenchDataset(ShapesCaptionDataset(...), order=[5, 2, ...])[0]`` is the base data set's sample 5.
    """

    def __init__(self, base: ShapesCaptionDataset | MultiImageShapesDataset, order: Sequence[int]) -> None:
        self.base = base
        self.order = list(order)
        # Cheap: caption ids come from the scene's random decisions, nothing is rendered.
        self.lengths = [len(base.caption_ids(i)) for i in self.order]

    def __len__(self) -> int:
        return len(self.order)

    def __getitem__(self, index: int) -> dict[str, Any]:
        sample = self.base[self.order[index]]
        # Only what the collator reads: the HF Trainer's default collation path never sees unknown keys.
        return {k: sample[k] for k in ("image", "images", "input_ids") if k in sample}

    def images_per_sample(self) -> list[int]:
        """Images of each sample (nothing rendered): 1 each for caption data."""
        count = getattr(self.base, "num_images", None)
        return [count(i) if count is not None else 1 for i in self.order]


@dataclass
class Workload:
    """Model init + data + counting rules shared by every contender (see the module docstring)."""

    size: str
    config: TinyVLMConfig
    batch_size: int
    steps: int
    warmup: int
    lr: float
    dataset: BenchDataset
    collate: VLMCollator | MultiImageCollator
    eval_batches: list[dict[str, Tensor]]
    init_state: dict[str, Tensor]
    # (a, b, c, v): FLOPs of a sample of n real tokens and m images = c + v*m + a*n + b*n^2
    flops_coefficients: tuple[float, float, float, float] = field(default=(0.0, 0.0, 0.0, 0.0))
    # the largest micro-batch the starting point (fp32, eager) fits where the batch does not (gpu-1b): its loop
    # accumulates; None: the whole batch fits
    fp32_micro_batch_size: int | None = None
    memory: dict[str, Any] = field(default_factory=dict)  # how the batch was sized (gpu-1b: the estimator's figures)

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    model_name = "built-in tiny VLM"

    @property
    def image_tokens(self) -> int:
        return self.config.num_image_tokens

    @property
    def prepended_tokens(self) -> int:
        """Tokens a sample has beyond its ``lengths`` entry: caption data's image tokens (the model prepends them);
        none for multi-image data (its placeholders are in ``input_ids``)."""
        return 0 if isinstance(self.collate, MultiImageCollator) else self.image_tokens

    @property
    def num_parameters(self) -> int:
        return sum(t.numel() for t in self.init_state.values())

    def build_model(self, attention: str = "eager") -> TinyVLM:
        """A fresh model with the shared initial weights and the given attention backend (eager, sdpa, ...)."""
        with torch.device("meta"):
            model = TinyVLM(self.config)
        model = model.to_empty(device="cpu")
        model.load_state_dict(self.init_state)
        set_attention_backend(model, attention)
        return model

    def batch_stats(self, batch: Mapping[str, Any]) -> dict[str, Tensor]:
        """Samples, real tokens, token slots and model FLOPs of a padded or packed batch, as lazy tensors."""
        n = _document_lengths(batch, self.prepended_tokens).double()  # zeros for empty slots: they add nothing
        a, b, c, v = self.flops_coefficients
        samples = (n > 0).sum()
        # Per-row image layouts count their images; otherwise one image per sample (the padded caption batch).
        images = batch["images_per_row"].sum() if "images_per_row" in batch else samples
        slots = batch["input_ids"].numel() + (0 if "position_ids" in batch else self.prepended_tokens * n.numel())
        return {"samples": samples, "tokens": n.sum(), "slots": torch.tensor(slots),
                "flops": c * samples + v * images + a * n.sum() + b * (n * n).sum()}

    def describe(self) -> dict[str, Any]:
        lengths = torch.tensor(self.dataset.lengths, dtype=torch.float64) + self.prepended_tokens
        images = torch.tensor(self.dataset.images_per_sample(), dtype=torch.float64)
        return {
            "size": self.size, "model": self.model_name, "parameters": self.num_parameters,
            "config": self.config.to_dict() if hasattr(self.config, "to_dict") else vars(self.config),
            "fp32_micro_batch_size": self.fp32_micro_batch_size, "memory": self.memory,
            "data": SIZES[self.size].data if self.size in SIZES else None,
            "batch_size": self.batch_size, "steps": self.steps, "warmup_steps": self.warmup, "lr": self.lr,
            "samples_per_run": len(self.dataset), "real_tokens_per_run": int(lengths.sum()),
            "sample_tokens": {"min": int(lengths.min()), "mean": float(lengths.mean()),
                              "median": float(lengths.median()), "max": int(lengths.max())},
            "images_per_sample": {"min": int(images.min()), "mean": float(images.mean()), "max": int(images.max())},
            "eval_samples": sum(int(b["input_ids"].shape[0]) for b in self.eval_batches),
        }


def _document_lengths(batch: Mapping[str, Any], image_tokens: int) -> Tensor:
    """Real tokens (image tokens included) of every sample of a padded batch, or of every (row, document) slot of
    a packed one, where slots without a real token read 0 (no boolean indexing: it would wait for the device)."""
    if "position_ids" not in batch:  # right-padded: the mask marks the caption, images are prepended
        return batch["attention_mask"].sum(-1) + image_tokens
    # Packed rows: documents restart their positions; pads (id 0) are not real tokens (placeholders are).
    ids = PackedDocuments.from_position_ids(batch["position_ids"]).ids
    rows, width = ids.shape
    flat = (ids + torch.arange(rows, device=ids.device)[:, None] * (width + 1)).reshape(-1)
    real = (batch["input_ids"] != 0).reshape(-1).to(torch.float64)
    return torch.bincount(flat, weights=real, minlength=rows * (width + 1))


def _flops_coefficients(model: nn.Module, image_tokens: int,
                        sample_batch: Callable[[int], dict[str, Tensor]] | None = None
                        ) -> tuple[float, float, float, float]:
    """(a, b, c, v) with FLOPs of one sample of n tokens and m images = c + v*m + a*n + b*n^2, fitted exactly to the
    analytic formula (v: the vision tower and projector on one image). ``sample_batch(text_tokens)``: a one-sample
    batch with one image and that many text tokens (default: the tiny VLM's, its image tokens prepended)."""
    def tiny_vlm_batch(text_tokens: int) -> dict[str, Tensor]:
        ids = torch.ones(1, text_tokens, dtype=torch.long)
        size = model.config.image_size
        return {"input_ids": ids, "attention_mask": ids, "pixel_values": torch.zeros(1, 3, size, size)}

    sample_batch = sample_batch or tiny_vlm_batch

    xs = [image_tokens + t for t in (4, 8, 16)]
    ys = [analytic_flops(model, sample_batch(x - image_tokens)) for x in xs]
    basis = torch.tensor([[1.0, x, x * x] for x in xs], dtype=torch.float64)
    c, a, b = torch.linalg.solve(basis, torch.tensor(ys, dtype=torch.float64)).tolist()
    v = sum(transformer_flops(tower) for tower in describe_towers(model, sample_batch(4))[:-1])  # all but the LM
    return a, b, c - v, v


def build_shapes_workload(size: str = "cpu", steps: int | None = None, warmup: int | None = None, seed: int = 0,
                          batch_size: int | None = None) -> Workload:
    """The shared model init, data order and held-out batches of a size whose model is the built-in tiny VLM
    (captions or multi-image data); steps and warm-up steps: the size's defaults unless given. Every size goes
    through :func:`vlmfast.bench.workload_builder.build_workload`.

    Usage: ``workload = build_shapes_workload("cpu", steps=40, warmup=5)``
    """
    bench = SIZES[size]
    steps = bench.steps if steps is None else steps
    warmup = bench.warmup if warmup is None else warmup
    batch = batch_size or bench.batch_size
    config = TinyVLMConfig(**MODEL_SIZES[bench.model])
    train_samples = (warmup + steps) * batch
    base: ShapesCaptionDataset | MultiImageShapesDataset
    collate: VLMCollator | MultiImageCollator
    if bench.data == "multi-image":
        base = MultiImageShapesDataset(train_samples + bench.eval_samples, seed=seed, max_objects=bench.max_objects,
                                       image_tokens=config.num_image_tokens)
        collate = MultiImageCollator(image_size=config.image_size, pad_id=base.tokenizer.pad_id)
    else:
        base = ShapesCaptionDataset(num_samples=train_samples + bench.eval_samples, seed=seed,
                                    max_objects=bench.max_objects)
        collate = VLMCollator(image_size=config.image_size, pad_id=base.tokenizer.pad_id)
    # One fixed shuffled order: runs that do not reorder (padding, packing) see identical batches.
    order = torch.randperm(train_samples, generator=torch.Generator().manual_seed(seed)).tolist()
    held_out = list(range(train_samples, train_samples + bench.eval_samples))
    if bench.data == "multi-image":  # long-tailed lengths: held-out batches of similar length, little padding
        held_out.sort(key=lambda i: len(base.caption_ids(i)))
    eval_batches = [collate([base[i] for i in held_out[k:k + batch]]) for k in range(0, len(held_out), batch)]
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = TinyVLM(config)
    return Workload(size=size, config=config, batch_size=batch, steps=steps, warmup=warmup, lr=bench.lr,
                    dataset=BenchDataset(base, order), collate=collate, eval_batches=eval_batches,
                    init_state=copy.deepcopy(model.state_dict()),
                    flops_coefficients=_flops_coefficients(model, config.num_image_tokens))


@torch.no_grad()
def evaluate_loss(trained: nn.Module, workload: Workload, device: torch.device) -> float:
    """Token-weighted loss on the held-out batches, fp32, of a fresh model holding `trained`'s weights.

    A fresh copy: the trained module may be compiled, checkpointed or wrapped, and evaluation must be the same
    computation for every contender.
    """
    model = workload.build_model("sdpa")
    model.load_state_dict({k: v.detach().cpu() for k, v in trained.state_dict().items()})
    model.to(device).eval()
    total, count = 0.0, 0
    for batch in workload.eval_batches:
        batch = {k: v.to(device) for k, v in batch.items()}
        items = int((batch["labels"][:, 1:] != -100).sum())
        total += float(model(**batch).loss) * items
        count += items
    return total / count
