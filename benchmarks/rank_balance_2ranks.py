"""2 gloo ranks on skewed data: straggler time and step time with data.rank_balance off vs cost, interleaved.

    .venv/bin/python benchmarks/rank_balance_2ranks.py [--rounds 3] [--steps 12] [--out FILE]

Run it on an otherwise idle 2-core machine (one core per rank: a busy core hides the gain). Per round both modes run
(order alternating), each a fresh trainer of `--steps` steps on a 4-layer Llama (width 256) over long-tailed samples
of 8 to 512 tokens (a few long ones dominate a rank's cost); figures are medians over the steps after the first two,
then medians over rounds: step time, and the straggler time (max - min of the ranks' compute up to their last
gradient, data.rank_balance / log.straggler).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import tempfile
from pathlib import Path

import torch

SAMPLES = 256


class LongTail(torch.utils.data.Dataset):
    def __init__(self, n: int = SAMPLES, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.lengths = [int(8 + 504 * float(u) ** 6) for u in torch.rand(n, generator=g)]
        self.ids = [torch.randint(1, 512, (k,), generator=g) for k in self.lengths]

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def pad(samples: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    width = max(len(s["input_ids"]) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    labels = torch.full((len(samples), width), -100)
    mask = torch.zeros(len(samples), width, dtype=torch.long)
    for r, s in enumerate(samples):
        n = len(s["input_ids"])
        ids[r, :n], labels[r, :n], mask[r, :n] = s["input_ids"], s["labels"], 1
    return {"input_ids": ids, "labels": labels, "attention_mask": mask}


def _model() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=512)
    return transformers.LlamaForCausalLM(config)


def _run(mode: str, steps: int) -> dict[str, float]:
    from vlmfast import OptimizedTrainer, TrainSpec

    spec = TrainSpec(max_steps=steps, batch_size=4, micro_batch_size=4, device="cpu", seed=0,
                     log={"progress": "off", "straggler": True}, memory={"leak_check": False},
                     data={"rank_balance": mode, "rank_balance_cost": {"per_token": 1.0, "per_token_pair": 0.02}})
    history = OptimizedTrainer(_model(), LongTail(), spec, collate_fn=pad).fit().history[2:]
    return {"step_s": statistics.median(h["step_time"] for h in history),
            "straggler_s": statistics.median(h["balance/straggler_s"] for h in history)}


def _rank(rank: int, port: int, rounds: int, steps: int, out: str) -> None:
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    results: dict[str, list[dict[str, float]]] = {"off": [], "cost": []}
    for r in range(rounds):
        for mode in (("off", "cost") if r % 2 == 0 else ("cost", "off")):
            results[mode].append(_run(mode, steps))
    if rank == 0:
        Path(out).write_text(json.dumps(results))
    torch.distributed.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/cpu/rank_balance_2ranks.json"))
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    raw = tempfile.mktemp()
    torch.multiprocessing.spawn(_rank, args=(port, args.rounds, args.steps, raw), nprocs=2)
    results = json.loads(Path(raw).read_text())
    summary = {mode: {key: statistics.median(r[key] for r in runs) for key in ("step_s", "straggler_s")}
               for mode, runs in results.items()}
    summary["straggler_ratio_off_over_cost"] = summary["off"]["straggler_s"] / max(summary["cost"]["straggler_s"], 1e-9)
    summary["speedup_step"] = summary["off"]["step_s"] / summary["cost"]["step_s"]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"rounds": results, "summary": summary}, indent=1) + "\n")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
