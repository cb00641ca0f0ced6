"""A Lightning Fabric training loop with vlmfast hooks: activation checkpointing, exact accumulation, the OOM fallback
and a comm hook.

Fabric keeps its precision plugin and strategy. ``apply_activation_checkpointing`` wraps the repeated blocks in place
before ``fabric.setup``; ``accumulate_gradients(..., loop=fabric)`` splits each batch into token-weighted
micro-batches with ``fabric.autocast`` / ``fabric.backward`` and ``fabric.no_backward_sync`` on all but the last (the
Fabric model hides DDP's ``no_sync``), and returns the loss of the whole global batch. ``OOMFallback(...,
model=model, loop=fabric)`` halves the micro-batch on out-of-memory and retries; under DDP it holds the gradient
all-reduce until every rank has finished. Fabric has no comm-hook API: ``register_comm_hook`` takes the Fabric model
(``--comm-hook fp16``; then without the fallback, whose own averaging no hook compresses).

Usage:
    python examples/fabric_loop.py [--steps 50]
    python examples/fabric_loop.py --devices 2 --steps 50      # Fabric starts 2 processes (CPU: gloo)
"""

from __future__ import annotations

import argparse

import torch
from lightning_fabric import Fabric
from torch.utils.data import DataLoader

from vlmfast.hooks import OOMFallback, accumulate_gradients, apply_activation_checkpointing, register_comm_hook
from vlmfast.models import build_tiny_vlm_task
from vlmfast.spec import OOMSpec


def main(steps: int = 50, batch_size: int = 16, micro_batch_size: int = 4, precision: str = "bf16-mixed",
         devices: int = 1, comm_hook: str = "none") -> float:
    """Train for `steps` optimizer steps; returns the last loss (of the global batch, the same on every rank)."""
    strategy = "ddp" if devices > 1 else "auto"
    fabric = Fabric(accelerator="auto", devices=devices, strategy=strategy, precision=precision)
    fabric.launch()
    fabric.seed_everything(0)
    model, dataset, collate = build_tiny_vlm_task(seed=0)
    apply_activation_checkpointing(model, scope="language_model")  # vlmfast hook: in place, before setup
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    loader = fabric.setup_dataloaders(DataLoader(dataset, batch_size=batch_size, shuffle=True, collate_fn=collate,
                                                 drop_last=True))
    fallback = None
    if comm_hook != "none" and fabric.world_size > 1:
        register_comm_hook(model, comm_hook)  # the Fabric model is accepted: its DDP module is found inside
    else:
        fallback = OOMFallback(OOMSpec(enabled=True), micro_batch_size, model=model, loop=fabric)
    loss = torch.tensor(float("nan"))
    for step, batch in enumerate(loader, start=1):
        def attempt(size: int, batch=batch) -> torch.Tensor:
            return accumulate_gradients(model, batch, size, loop=fabric)  # vlmfast hook

        loss = attempt(micro_batch_size) if fallback is None else fallback.run(
            attempt, cleanup=lambda: optimizer.zero_grad(set_to_none=True))
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
    parser.add_argument("--devices", type=int, default=1, help="processes (GPUs, or CPU processes without GPUs)")
    parser.add_argument("--comm-hook", default="none", choices=["none", "fp16", "powersgd"],
                        help="compress the gradient all-reduce (several devices; replaces the OOM fallback)")
    args = parser.parse_args()
    final = main(args.steps, precision=args.precision, devices=args.devices, comm_hook=args.comm_hook)
    print(f"final loss {final:.4f}")
