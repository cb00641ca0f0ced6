"""A hand-written training loop for the tiny VLM, before and after adding vlmfast hooks (bf16 autocast, exact
token-weighted gradient accumulation, OOM fallback): the two files differ only by those hooks.

Usage: python examples/hand_written_loop_before.py [--steps 50]   (or hand_written_loop_after.py)
       diff examples/hand_written_loop_before.py examples/hand_written_loop_after.py
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from torch.utils.data import DataLoader

from vlmfast.hooks import MixedPrecision, OOMFallback, accumulate_gradients
from vlmfast.models import build_tiny_vlm_task
from vlmfast.spec import OOMSpec


def main(steps: int = 50, batch_size: int = 16) -> float:
    """Train for `steps` optimizer steps of `batch_size` samples; returns the last loss."""
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model, dataset, collate = build_tiny_vlm_task(seed=0)
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, collate_fn=collate, drop_last=True)
    precision = MixedPrecision("bf16", device)  # autocast; "fp16" adds a GradScaler (CUDA)
    fallback = OOMFallback(OOMSpec(enabled=True), micro_batch_size=batch_size // 4)  # halves on OOM, same gradient
    loss = torch.tensor(float("nan"))
    for step, batch in enumerate(loader, start=1):
        forward_backward = partial(accumulate_gradients, model, batch, device=device,  # token-weighted micro-batches
                                   forward_context=precision.forward_context, backward=precision.backward)
        loss = fallback.run(forward_backward, cleanup=partial(optimizer.zero_grad, set_to_none=True))
        precision.unscale_gradients(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        precision.optimizer_step(optimizer)
        optimizer.zero_grad(set_to_none=True)
        if step == steps:
            break
    return loss.item()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    print(f"final loss {main(parser.parse_args().steps):.4f}")
