"""Simulated straggler cost of the positional deal vs data.rank_balance (tokens / cost), at 8 to 1,024 ranks.

    .venv/bin/python benchmarks/rank_balance_sim.py [--out benchmarks/results/cpu/rank_balance_sim.json]

Two synthetic distributions of VLM samples (metadata only: text tokens, images):
- ``llava-mix``: 30 % text-only, 1-8 images otherwise (most have 1), text long-tailed (Pareto, 16-4,096 tokens);
- ``doc-heavy``: every sample 1-4 high-resolution images, text 64-8,192 tokens, log-uniform.
Costs come from a 7B-like cost model (:class:`vlmfast.data.rank_balance.CostModel`: 6 FLOPs per parameter per token,
attention 12 x layers x hidden per token pair, a 300M-parameter tower on 576 patches per image). Per global batch of
``batch_size x ranks`` samples: the imbalance (max / mean - 1 of per-rank cost) of each deal, and the straggler share
of the step, ``1 - mean / max`` (the fraction of the step the average rank waits), medians over 200 batches.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
from pathlib import Path

from vlmfast.data.rank_balance import CostModel, deal, imbalance, positional_shares

COST = CostModel(per_token=6 * 7e9, per_token_pair=12 * 32 * 4096, per_image=6 * 3e8 * 576)
TOKENS_ONLY = CostModel(per_token=1.0)


def llava_mix(rng: random.Random) -> tuple[int, int]:
    images = 0 if rng.random() < 0.3 else min(8, int(rng.paretovariate(2.0)))
    return min(4096, int(16 * rng.paretovariate(1.1))), images


def doc_heavy(rng: random.Random) -> tuple[int, int]:
    return int(64 * 2 ** (rng.random() * 7)), rng.randint(1, 4)


DISTRIBUTIONS = {"llava-mix": llava_mix, "doc-heavy": doc_heavy}


def simulate(draw, ranks: int, batch_size: int = 4, batches: int = 200, seed: int = 0) -> dict[str, dict[str, float]]:
    rng = random.Random(seed)
    figures: dict[str, dict[str, list[float]]] = {m: {"imbalance": [], "straggler": []}
                                                  for m in ("off", "tokens", "cost")}
    for _ in range(batches):
        samples = [draw(rng) for _ in range(batch_size * ranks)]
        tokens, images = [s[0] for s in samples], [s[1] for s in samples]
        costs = COST.costs(tokens, images)
        deals = {"off": positional_shares(len(costs), ranks), "tokens": deal(TOKENS_ONLY.costs(tokens, images), ranks),
                 "cost": deal(costs, ranks)}
        for mode, shares in deals.items():
            gap = imbalance(costs, shares)
            figures[mode]["imbalance"].append(gap)
            figures[mode]["straggler"].append(gap / (1 + gap))  # 1 - mean / max
    return {m: {k: statistics.median(v) for k, v in f.items()} for m, f in figures.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/rank_balance_sim.json"))
    args = parser.parse_args()
    results = {name: {ranks: simulate(draw, ranks) for ranks in (8, 64, 1024)} for name, draw in DISTRIBUTIONS.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    print("| distribution | ranks | straggler share off | tokens | cost | imbalance off | tokens | cost |")
    print("|---|---|---|---|---|---|---|---|")
    for name, by_ranks in results.items():
        for ranks, f in by_ranks.items():
            s = [f"{f[m]['straggler']:.1%}" for m in ("off", "tokens", "cost")]
            i = [f"{f[m]['imbalance']:.2f}" for m in ("off", "tokens", "cost")]
            print(f"| {name} | {ranks} | {' | '.join(s)} | {' | '.join(i)} |")


if __name__ == "__main__":
    main()
