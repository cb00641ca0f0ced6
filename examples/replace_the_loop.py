"""Way in #1: hand the whole loop to OptimizedTrainer.

Usage: python examples/replace_the_loop.py [--steps 50]
"""

from __future__ import annotations

import argparse

from vlmfast import OptimizedTrainer, TrainSpec
from vlmfast.models import build_tiny_vlm_task


def main(steps: int = 50) -> float:
    model, dataset, collate = build_tiny_vlm_task(seed=0)
    spec = TrainSpec(
        max_steps=steps,
        batch_size=16,
        micro_batch_size=4,  # 4 micro-batches per optimizer step; the gradient is the full-batch one
        precision="bf16",  # autocast on CPU and GPU
        optimizer={"lr": 2e-3, "param_groups": [{"modules": ["vision_tower"], "lr": 1e-3}]},
        scheduler={"name": "cosine", "warmup_steps": steps // 10},
        grad_clip=1.0,
        log={"progress": "off"},
    )
    result = OptimizedTrainer(model, dataset, spec, collate_fn=collate).fit()
    return result.history[-1]["loss"]


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=50)
    print(f"final loss {main(parser.parse_args().steps):.4f}")
