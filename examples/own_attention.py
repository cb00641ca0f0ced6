"""A plain PyTorch model whose attention layers call vlmfast.attention, so the backend is chosen outside the model.

The model holds a ``vlmfast.attention.ScaledDotProductAttention`` in each layer (a thin module over
``vlmfast.attention(q, k, v, ...)``), which ``set_attention_backend`` and the spec's ``attention`` section switch.
The script checks that eager and SDPA agree, that packed rows (per-document ``position_ids``) never attend across
documents, then trains with ``OptimizedTrainer`` on the chosen backend.

Usage: python examples/own_attention.py [--steps 50] [--backend sdpa]
"""

from __future__ import annotations

import argparse

import torch
from torch import nn
from torch.nn import functional as F

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.attention import ScaledDotProductAttention, record_attention_calls, set_attention_backend


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention through vlmfast, then an MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.attend = ScaledDotProductAttention()  # instead of F.scaled_dot_product_attention
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor | None = None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.norm1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        # position_ids restarting at 0 mark packed documents: attention stays inside each one.
        y = self.attend(q, k, v, causal=True, position_ids=position_ids)
        x = x + self.out(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.norm2(x))


class TinyLM(nn.Module):
    """A causal language model returning its mean token loss (labels[t + 1] predicted at t)."""

    loss_shifts_labels = True

    def __init__(self, vocab: int = 64, dim: int = 64, heads: int = 4, layers: int = 2, max_len: int = 64) -> None:
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Embedding(max_len, dim)
        self.layers = nn.ModuleList(Block(dim, heads) for _ in range(layers))
        self.head = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
        if position_ids is None:  # on the input's device: a CPU arange would not index a CUDA embedding
            positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        else:
            positions = position_ids
        x = self.embed(input_ids) + self.pos(positions)
        for layer in self.layers:
            x = layer(x, position_ids)
        logits = self.head(x)
        if labels is None:
            return {"logits": logits}
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
        return {"loss": loss, "logits": logits}


class Sequences(torch.utils.data.Dataset):
    """Arithmetic token sequences (start + stride * i, mod 60): learnable from the previous two tokens."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        start, stride = torch.randint(0, 60, (1,), generator=g), torch.randint(1, 5, (1,), generator=g)
        ids = (start + stride * torch.arange(32)) % 60 + 3
        return {"input_ids": ids, "labels": ids.clone()}


def check_backends_and_documents(model: TinyLM) -> None:
    """Eager and SDPA give the same logits; in a packed row, changing one document leaves the other unchanged."""
    ids = torch.randint(3, 63, (2, 24))
    set_attention_backend(model, "eager")
    eager = model(ids)["logits"]
    set_attention_backend(model, "sdpa")
    with record_attention_calls() as calls:
        sdpa = model(ids)["logits"]
    assert {call.backend for call in calls} == {"sdpa"}, calls
    assert torch.allclose(eager, sdpa, atol=1e-5), (eager - sdpa).abs().max()

    positions = torch.cat([torch.arange(10), torch.arange(14)])[None]  # two documents: 10 + 14 tokens in one row
    row = ids[:1]
    changed = row.clone()
    changed[0, :10] = (changed[0, :10] + 1) % 60 + 3  # a different first document
    second = model(row, position_ids=positions)["logits"][0, 10:]
    assert torch.allclose(second, model(changed, position_ids=positions)["logits"][0, 10:], atol=1e-5)


def main(steps: int = 50, backend: str = "sdpa") -> float:
    """Check the attention backends, then train for `steps` optimizer steps on `backend`; returns the last loss."""
    torch.manual_seed(0)
    model = TinyLM()
    check_backends_and_documents(model)
    spec = TrainSpec(max_steps=steps, batch_size=16, optimizer={"lr": 3e-3}, attention={"backend": backend},
                     log={"progress": "off"})
    result = OptimizedTrainer(model, Sequences(), spec).fit()
    return result.history[-1]["loss"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--backend", default="sdpa", help="eager, sdpa, auto, flash_attn (CUDA), flex (CUDA)")
    args = parser.parse_args()
    print(f"final loss {main(args.steps, args.backend):.4f}")
