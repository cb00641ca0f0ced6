"""An Accelerate training loop with vlmfast hooks: exact token-weighted accumulation, the OOM fallback, a comm hook.

Accelerate's own ``accumulate()`` divides each micro-batch's mean loss by the number of micro-batches, which is wrong
for token losses of variable length (transformers#24725); ``accumulate_gradients`` weights each micro-batch by its
share of the batch's loss tokens (counted across ranks), uses ``accelerator.no_sync`` on all but the last micro-batch
and returns the loss of the whole global batch. Keep ``Accelerator(gradient_accumulation_steps=1)``: the hook does
the accumulation (it refuses an Accelerator that accumulates too). ``OOMFallback(..., model=model, loop=accelerator)``
halves the micro-batch on out-of-memory and retries the batch; under DDP it holds the gradient all-reduce until every
rank has finished, so one rank's OOM never strands the others. ``--comm-hook fp16`` compresses the all-reduce instead
(a comm hook does not run on the fallback's own averaging, so the two are alternatives here).

Usage:
    python examples/accelerate_loop.py [--steps 50]
    accelerate launch --multi_gpu --num_processes 2 examples/accelerate_loop.py --steps 50   # GPUs or CPU
"""

from __future__ import annotations

import argparse

import torch
from accelerate import Accelerator
from torch.utils.data import DataLoader

from vlmfast.engines.foreign_loops import warn_if_launched_alone
from vlmfast.hooks import OOMFallback, accumulate_gradients, register_comm_hook
from vlmfast.models import build_tiny_vlm_task
from vlmfast.spec import OOMSpec


def main(steps: int = 50, batch_size: int = 16, micro_batch_size: int = 4, precision: str = "bf16",
         comm_hook: str = "none") -> float:
    """Train for `steps` optimizer steps; returns the last loss (of the global batch, the same on every rank)."""
    # cpu=True without a GPU: otherwise an Accelerator under a multi-process launch runs alone in every process.
    accelerator = Accelerator(mixed_precision="no" if precision == "fp32" else precision,
                              cpu=not torch.cuda.is_available())
    warn_if_launched_alone(accelerator)  # a launcher asked for several processes but this one runs alone
    model, dataset, collate = build_tiny_vlm_task(seed=0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, collate_fn=collate, drop_last=True)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    fallback = None
    if comm_hook != "none" and accelerator.num_processes > 1:
        register_comm_hook(model, comm_hook)  # vlmfast hook: the prepared model is accepted as it is
    else:
        fallback = OOMFallback(OOMSpec(enabled=True), micro_batch_size, model=model, loop=accelerator)
    loss = torch.tensor(float("nan"))
    for step, batch in enumerate(loader, start=1):
        def attempt(size: int, batch=batch) -> torch.Tensor:
            return accumulate_gradients(model, batch, size, loop=accelerator)  # the vlmfast hook

        loss = attempt(micro_batch_size) if fallback is None else fallback.run(
            attempt, cleanup=lambda: optimizer.zero_grad(set_to_none=True))
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
    parser.add_argument("--comm-hook", default="none", choices=["none", "fp16", "powersgd"],
                        help="compress the gradient all-reduce (several processes; replaces the OOM fallback)")
    args = parser.parse_args()
    print(f"final loss {main(args.steps, precision=args.precision, comm_hook=args.comm_hook):.4f}")
