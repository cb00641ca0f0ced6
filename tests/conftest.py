"""Shared fixtures: tiny models and variable-length token batches, all generated (no downloads)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torch.nn import functional as F


@pytest.fixture(autouse=True)
def _restore_environment():
    """Each test starts from the same environment variables: an engine run in-process sets launcher variables
    (DeepSpeed reads LOCAL_RANK for as long as its engine lives), which would turn a later Accelerator or HF Trainer
    in this process into a multi-process launch."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


class TinyCausalLM(nn.Module):
    """A plain causal LM returning a mean token loss over labels[1:] (Hugging Face convention)."""

    loss_shifts_labels = True

    def __init__(self, vocab: int = 50, dim: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        self.dropout = nn.Dropout(dropout)
        self.embed = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids, labels=None, attention_mask=None):
        h = self.dropout(self.embed(input_ids))
        h = h + torch.tanh(self.mix(torch.cumsum(h, dim=1) / torch.arange(1, h.shape[1] + 1, device=h.device)[:, None]))
        logits = self.head(self.norm(h))
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1))
        return {"loss": loss, "logits": logits}


def token_batch(batch_size: int = 8, max_len: int = 24, vocab: int = 50, seed: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded token batch with very different lengths per row (so naive averaging would be wrong)."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(3, max_len + 1, (batch_size,), generator=g)
    lengths[0], lengths[-1] = 3, max_len
    # Learnable rows: arithmetic sequences (random start and stride), so the next token follows from the last two.
    start = torch.randint(0, vocab - 3, (batch_size, 1), generator=g)
    stride = torch.randint(1, 5, (batch_size, 1), generator=g)
    ids = (start + stride * torch.arange(max_len)) % (vocab - 3) + 3
    mask = torch.arange(max_len)[None, :] < lengths[:, None]
    labels = ids.masked_fill(~mask, -100)
    return {"input_ids": ids.masked_fill(~mask, 0), "attention_mask": mask.long(), "labels": labels}


class TokenDataset(torch.utils.data.Dataset):
    """Samples of a fixed token batch, padded per sample to the same length (collate = default stacking)."""

    def __init__(self, n: int = 64, max_len: int = 24, vocab: int = 50, seed: int = 0) -> None:
        self.batch = token_batch(n, max_len, vocab, seed)

    def __len__(self) -> int:
        return self.batch["input_ids"].shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {k: v[i] for k, v in self.batch.items()}


def tiny_llama(seed: int = 0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaForCausalLM(config)


IMAGE_TOKEN = 63


def tiny_llava(seed: int = 0, text_hidden: int = 32, text_layers: int = 2, vision_layers: int = 2):
    """A Hugging Face LLaVA (CLIP vision tower + projector + Llama) from a tiny config: 4 image tokens."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    vision = transformers.CLIPVisionConfig(image_size=16, patch_size=8, hidden_size=32, intermediate_size=64,
                                           num_hidden_layers=vision_layers, num_attention_heads=4)
    text = transformers.LlamaConfig(vocab_size=64, hidden_size=text_hidden, intermediate_size=2 * text_hidden,
                                    num_hidden_layers=text_layers, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=64)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    return transformers.LlavaForConditionalGeneration(config)


class LlavaDataset(torch.utils.data.Dataset):
    """4 image tokens then a caption whose first token is the image's mean colour bucket (so images matter)."""

    def __init__(self, n: int = 64, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.pixels = torch.rand(n, 3, 16, 16, generator=g)
        text = token_batch(n, max_len=12, vocab=60, seed=seed)
        colour = (self.pixels.mean(dim=(1, 2, 3)) * 20).long().clamp(0, 9) + 3
        text["input_ids"][:, 0] = colour
        text["labels"][:, 0] = colour
        image = torch.full((n, 4), IMAGE_TOKEN)
        self.ids = torch.cat([image, text["input_ids"]], dim=1)
        self.mask = torch.cat([torch.ones(n, 4, dtype=torch.long), text["attention_mask"]], dim=1)
        self.labels = torch.cat([torch.full((n, 4), -100), text["labels"]], dim=1)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i],
                "pixel_values": self.pixels[i]}


def assert_gradients_close(actual, expected, rtol: float = 1e-5, names=None) -> None:
    """Gradients agree to `rtol` on the scale of the whole gradient (dicts name -> tensor, or equal-length sequences).

    The error vector's norm is at most `rtol` times the gradient's norm, and every tensor's largest error at most
    `rtol` times the gradient's largest entry. Never per-tensor relative: a tensor whose true gradient is analytically
    zero (an attention key bias: softmax is shift-invariant) holds only float noise, which differs between CPUs.
    Compared in float64.
    """
    if isinstance(expected, dict):
        assert sorted(actual) == sorted(expected)
        names = list(expected)
        actual, expected = [actual[n] for n in names], [expected[n] for n in names]
    names = names or [str(i) for i in range(len(expected))]
    assert len(actual) == len(expected)
    actual = [a.detach().double() for a in actual]
    expected = [e.detach().double() for e in expected]
    norm = torch.sqrt(sum((e**2).sum() for e in expected))
    diff = torch.sqrt(sum(((a - e) ** 2).sum() for a, e in zip(actual, expected, strict=True)))
    assert diff <= rtol * norm, f"gradient error {float(diff / norm):.2e} of its norm > {rtol}"
    scale = max(float(e.abs().max()) for e in expected if e.numel())
    for name, a, e in zip(names, actual, expected, strict=True):
        worst = float((a - e).abs().max()) if e.numel() else 0.0
        assert worst <= rtol * scale, f"{name}: largest error {worst:.2e} > {rtol} x the gradient's largest entry"


class Float64:
    """The collate_fn of a float64 model: floating tensors (pixels) as float64."""

    def __init__(self, collate) -> None:
        self.collate = collate

    def __call__(self, samples: list) -> dict:
        return {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in self.collate(samples).items()}


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP spin-waits cost 50x:
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def tiny_lm():
    torch.manual_seed(0)
    return TinyCausalLM()


def spawn_two_ranks(worker, tmp_path, name: str, *args) -> list:
    """Run `worker(*args)` on 2 gloo ranks (the environment torchrun sets); returns each rank's return value."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = str(tmp_path / name)
    torch.multiprocessing.spawn(_rank_main, args=(worker, port, out, args), nprocs=2)
    return [torch.load(f"{out}.{rank}", weights_only=False) for rank in range(2)]


def _rank_main(rank: int, worker, port: int, out: str, args: tuple) -> None:
    import os
    import sys

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    try:
        torch.save(worker(*args), f"{out}.{rank}")
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    # The result is on disk: leave without interpreter finalization, where gloo's worker threads can still hold
    # work with tensors of a failed step (a DDP reduction left unfinished) and abort the process (SIGABRT, "terminate
    # called without an active exception"; pytorch/pytorch#179291). A worker's exception above still reaches spawn.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
