"""An Accelerate training loop with one vlmfast hook: exact, token-weighted gradient accumulation.

Accelerate's own ``accumulate()`` divides each micro-batch's mean loss by the number of micro-batches, which is wrong
for token losses of variable length (transformers#24725); ``accumulate_gradients`` weights each micro-batch by its
share of the batch's loss tokens (counted across ranks under DDP) and skips the all-reduce on all but the last.

Usage:
    python examples/accelerate_loop.py [--steps 50]
    accelerate launch --num_processes 2 examples/accelerate_loop.py --steps 50
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from vlmfast.hooks import accumulate_gradients
from vlmfast.models import build_tiny_vlm_task


def main(steps: int = 50, batch_size: int = 16, micro_batch_size: int = 4, precision: str = "bf16") -> float:
    """Train for `steps` optimizer steps; returns the last loss."""
    accelerator = Accelerator(mixed_precision="no" if precision == "fp32" else precision)
    model, dataset, collate = build_tiny_vlm_task(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, collate_fn=collate, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    loss = torch.tensor(float("nan"))
    for step, batch in enumerate(loader, start=1):
        loss = accumulate_gradients(model, batch, micro_batch_size,  # the vlmfast hook
                                    forward_context=accelerator.autocast, backward=accelerator.backward)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)  # unscales fp16 gradients first, then clips
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 10 == 0:
            accelerator.print(f"step {step} loss {loss.item():.4f}")
        if step == steps:
            break
    return loss.item()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--precision", default="bf16", choices=["fp32", "bf16", "fp16"])
    args = parser.parse_args()
    print(f"final loss {main(args.steps, precision=args.precision):.4f}")
