"""Simulated straggler cost of the positional deal vs data.rank_balance (tokens / cost), at 8 to 1,024 ranks.

    .venv/bin/python benchmarks/rank_balance_sim.py [--out benchmarks/results/cpu/rank_balance_sim.json]
                                                    [--plot benchmarks/results/cpu/rank_balance_sim.png]

Two synthetic distributions of VLM samples (metadata only: text tokens, images):
- ``llava-mix``: 30 % text-only, 1-8 images otherwise (most have 1), text long-tailed (Pareto, 16-4,096 tokens);
- ``doc-heavy``: every sample 1-4 high-resolution images, text 64-8,192 tokens, log-uniform.
Costs come from a 7B-like cost model (:class:`vlmfast.data.rank_balance.CostModel`: 6 FLOPs per parameter per token,
attention 12 x layers x hidden per token pair, a 300M-parameter tower on 576 patches per image). Per global batch of
``batch_size x ranks`` samples: the imbalance (max / mean - 1 of per-rank cost) of each deal, and the straggler share
of the step, ``1 - mean / max`` (the fraction of the step the average rank waits), medians over 200 batches, at
every power of 2 from 8 to 1,024 ranks. The plot (``--plot``, matplotlib's Agg renderer, no display needed) draws both
figures against the rank count, one column per distribution, one line per deal.
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
RANKS = (8, 16, 32, 64, 128, 256, 512, 1024)
MODES = ("off", "tokens", "cost")


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


def plot(results: dict[str, dict[int, dict[str, dict[str, float]]]], path: Path) -> None:
    """Straggler share (top) and imbalance (bottom, log scale) against the rank count: a column per distribution."""
    from matplotlib.figure import Figure  # the Agg renderer, no pyplot: no display, no global backend switch
    from matplotlib.ticker import FormatStrFormatter, LogLocator

    fig = Figure(figsize=(10, 6.5), dpi=100, layout="constrained")
    axes = fig.subplots(2, len(results), sharex=True, squeeze=False)
    styles = {"off": ("tab:red", "o", "off (positional)"), "tokens": ("tab:blue", "s", "tokens"),
              "cost": ("tab:green", "^", "cost")}
    for column, (name, by_ranks) in enumerate(results.items()):
        ranks = sorted(by_ranks)
        for row, metric in enumerate(("straggler", "imbalance")):
            ax = axes[row][column]
            for mode in ("off", "cost", "tokens"):  # tokens dashed on top: visible where it coincides with cost
                colour, marker, label = styles[mode]
                values = [by_ranks[r][mode][metric] * (100 if metric == "straggler" else 1) for r in ranks]
                ax.plot(ranks, values, color=colour, marker=marker, label=label,
                        linestyle="--" if mode == "tokens" else "-")
            ax.set_xscale("log", base=2)
            ax.set_xticks(ranks, [str(r) for r in ranks])
            ax.grid(alpha=0.3)
            if metric == "straggler":
                ax.set(title=name, ylabel="straggler share of the step (%)", ylim=(0, 100))
            else:
                ax.set(xlabel="ranks (4 samples each)", ylabel="imbalance (max / mean - 1)", yscale="log")
                ax.yaxis.set_major_formatter(FormatStrFormatter("%g"))
                ax.yaxis.set_minor_locator(LogLocator(subs=(2, 5)))  # 0.2, 0.5, 2, 5...: readable, uncrowded
                ax.yaxis.set_minor_formatter(FormatStrFormatter("%g"))
    handles, labels = axes[0][0].get_legend_handles_labels()
    order = [labels.index(styles[mode][2]) for mode in MODES]
    axes[0][0].legend([handles[i] for i in order], [labels[i] for i in order], title="data.rank_balance",
                      loc="lower right")
    fig.suptitle("Simulated rank imbalance, 7B-like cost model (medians of 200 global batches)")
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/rank_balance_sim.json"))
    parser.add_argument("--plot", type=Path, default=Path("benchmarks/results/cpu/rank_balance_sim.png"),
                        help="the PNG of both figures against the rank count")
    args = parser.parse_args()
    results = {name: {ranks: simulate(draw, ranks) for ranks in RANKS} for name, draw in DISTRIBUTIONS.items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")
    plot(results, args.plot)
    print(f"wrote {args.out} and {args.plot}")
    print("| distribution | ranks | straggler share off | tokens | cost | imbalance off | tokens | cost |")
    print("|---|---|---|---|---|---|---|---|")
    for name, by_ranks in results.items():
        for ranks, f in by_ranks.items():
            s = [f"{f[m]['straggler']:.1%}" for m in MODES]
            i = [f"{f[m]['imbalance']:.2f}" for m in MODES]
            print(f"| {name} | {ranks} | {' | '.join(s)} | {' | '.join(i)} |")


if __name__ == "__main__":
    main()
