"""Way in #3: keep your own loop and import single hooks.

The "before" loop is commented inline; the "after" adds three hooks: exact gradient accumulation, bf16 autocast,
and the fused optimizer with param groups.

Usage: python examples/hand_written_loop.py [--steps 50]
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader

from vlmfast.hooks import MixedPrecision, accumulate_gradients, build_optimizer
from vlmfast.models import build_tiny_vlm_task
from vlmfast.spec import OptimizerSpec


def main(steps: int = 50) -> float:
    torch.manual_seed(0)
    device = torch.device("cpu")
    model, dataset, collate = build_tiny_vlm_task(seed=0)
    loader = DataLoader(dataset, batch_size=16, shuffle=True, collate_fn=collate, drop_last=True)
    # before: optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    optimizer = build_optimizer(model, OptimizerSpec(lr=2e-3, weight_decay=0.01), device)
    precision = MixedPrecision("bf16", device)
    loss = torch.tensor(float("nan"))
    for step, batch in enumerate(loader):
        if step == steps:
            break
        # before: loss = model(**batch).loss; loss.backward()
        loss = accumulate_gradients(model, batch, micro_batch_size=4, device=device,
                                    forward_context=precision.forward_context, backward=precision.backward)
        precision.optimizer_step(optimizer)  # before: optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return float(loss)


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    print(f"final loss {main(parser.parse_args().steps):.4f}")
