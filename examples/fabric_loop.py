"""A Lightning Fabric training loop with two vlmfast hooks: activation checkpointing and exact gradient accumulation.

Fabric keeps its precision plugin and strategy; ``apply_activation_checkpointing`` wraps the repeated blocks in place
before ``fabric.setup``, and ``accumulate_gradients`` splits each batch into token-weighted micro-batches with
``fabric.autocast`` / ``fabric.backward``.

Usage: python examples/fabric_loop.py [--steps 50]
"""

from __future__ import annotations

import argparse

import torch
from lightning_fabric import Fabric
from torch.utils.data import DataLoader

from vlmfast.hooks import accumulate_gradients, apply_activation_checkpointing
from vlmfast.models import build_tiny_vlm_task


def main(steps: int = 50, batch_size: int = 16, micro_batch_size: int = 4, precision: str = "bf16-mixed") -> float:
    """Train for `steps` optimizer steps; returns the last loss."""
    fabric = Fabric(accelerator="auto", devices=1, precision=precision)
    fabric.seed_everything(0)
    model, dataset, collate = build_tiny_vlm_task(seed=0)
    apply_activation_checkpointing(model, scope="language_model")  # vlmfast hook 1: in place, before setup
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=batch_size, shuffle=True, collate_fn=collate,
                                                 drop_last=True))
    loss = torch.tensor(float("nan"))
    for step, batch in enumerate(loader, start=1):
        loss = accumulate_gradients(model, batch, micro_batch_size,  # vlmfast hook 2
                                    forward_context=fabric.autocast, backward=fabric.backward)
        fabric.clip_gradients(model, optimizer, max_norm=1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0:
            fabric.print(f"step {step} loss {loss.item():.4f}")
        if step == steps:
            break
    return loss.item()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--precision", default="bf16-mixed", help="Fabric precision: 32-true, bf16-mixed, 16-mixed")
    args = parser.parse_args()
    print(f"final loss {main(args.steps, precision=args.precision):.4f}")
