"""Chunked linear cross-entropy against the standard head + loss, at Qwen2-0.5B's head size, on CPU or a GPU.

Usage::

    python benchmarks/linear_cross_entropy.py                    # vocab 151,936, hidden 896, 4,096 tokens, 3 rounds
    python benchmarks/linear_cross_entropy.py --ignored 0.5      # half the positions are image / prompt tokens
    python benchmarks/linear_cross_entropy.py --tokens 512 --rounds 2 --out /tmp/lce.json   # a quick look
    python benchmarks/linear_cross_entropy.py --device cuda --precision bf16 --tokens 8192 --rounds 1   # on a GPU

The model is Qwen2-0.5B's shape (hidden 896, vocabulary 151,936, tied embeddings) with ``--layers`` decoder layers
(default 1, so the head, which is what changes, weighs as much as it can in the step). Every position carries a
loss unless ``--ignored`` says what share does not (the chunked path skips those tokens; the standard head does not).
Each (variant, round) runs in a fresh process, variants interleaved (standard, chunked, standard, ...), so the
peak RSS of one cannot hide in the other's and a slow period of the shared machine hits both. Per process: one
warm-up step, then ``--steps`` timed training steps (forward, backward, SGD step) on one micro-batch of
``--tokens`` tokens. Reported per variant:

- ``loss_path_saved_bytes``: what autograd keeps for backward from the hidden states to the loss (the hidden
  states, which both paths keep, included), measured with ``saved_tensor_bytes``;
- ``step_peak_rss_mb``: the process's peak RSS minus its RSS before the first step (the weights, their gradients
  and the batch exist in both), i.e. what the steps added at their peak; on CUDA ``step_peak_allocated_mb``, the
  peak of ``torch.cuda.max_memory_allocated`` over the steps minus what was allocated before them;
- ``step_time_s``: median of the timed steps over all rounds; ``time_ratio`` = variant / standard.

Variants: ``standard`` (the model's own head and loss), ``chunked`` (the default: logits recomputed in backward,
nothing of vocabulary size kept) and ``chunked_in_forward`` (``recompute: false``: gradients computed in forward,
the head weight's gradient kept until backward; three head matmuls like the standard path instead of four).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, write_result

from vlmfast.common.utils import resolve_device

# standard: the model's own head + loss; chunked: recompute in backward (the default); chunked_in_forward: the
# gradients computed in forward and kept (recompute: false, Liger's way).
VARIANTS = ("standard", "chunked", "chunked_in_forward")


def _model(layers: int, vocab: int, hidden: int) -> torch.nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=4864, num_hidden_layers=layers,
                         num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=32768,
                         tie_word_embeddings=True, attn_implementation="sdpa")
    torch.manual_seed(0)
    return Qwen2ForCausalLM(config)


def _loss_path_bytes(model: torch.nn.Module, hidden: torch.Tensor, labels: torch.Tensor, variant: str) -> int:
    from transformers.loss.loss_utils import ForCausalLMLoss

    from vlmfast.hooks import linear_cross_entropy, saved_tensor_bytes, shift_targets

    head = model.get_output_embeddings()
    leaf = hidden.detach().requires_grad_()

    def standard() -> torch.Tensor:
        return ForCausalLMLoss(head(leaf * 1.0), labels, vocab_size=head.weight.shape[0])

    def chunked() -> torch.Tensor:
        return linear_cross_entropy(leaf * 1.0, head.weight, shift_targets(labels), reduction="mean",
                                    recompute=variant == "chunked")

    return saved_tensor_bytes(standard if variant == "standard" else chunked)


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    """One process: warm-up, timed steps, saved bytes, peak memory (RSS; allocated on CUDA)."""
    from vlmfast.hooks import apply_linear_cross_entropy

    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    model = _model(args.layers, args.vocab, args.hidden).to(device)
    if args.variant != "standard":
        apply_linear_cross_entropy(model, chunk_tokens=args.chunk_tokens, recompute=args.variant == "chunked")
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, args.vocab, (1, args.tokens), generator=g)
    labels = ids.clone()
    labels[:, : int(args.ignored * args.tokens)] = -100  # image and prompt tokens carry no loss
    batch = {"input_ids": ids.to(device), "labels": labels.to(device)}
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-4)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16")
    cuda = device.type == "cuda"
    rss_before = psutil.Process().memory_info().rss
    allocated_before = torch.cuda.memory_allocated(device) if cuda else 0
    times = []
    for step in range(1 + args.steps):
        if cuda and step == 1:  # the warm-up step allocated the gradients: both variants hold them from here on
            torch.cuda.synchronize(device)
            allocated_before = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        with autocast:
            loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=False)  # keep the gradient buffers: both variants hold them
        if cuda:
            torch.cuda.synchronize(device)
        if step:
            times.append(time.perf_counter() - start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    memory = {"rss_before_mb": rss_before / 2**20, "step_peak_rss_mb": (peak - rss_before) / 2**20}
    if cuda:
        memory["step_peak_allocated_mb"] = (torch.cuda.max_memory_allocated(device) - allocated_before) / 2**20
    with torch.no_grad(), autocast:  # after the peak was read: this measurement allocates the logits once more
        hidden = model.model(input_ids=batch["input_ids"]).last_hidden_state
    saved = _loss_path_bytes(model, hidden, batch["labels"], args.variant)
    return {"variant": args.variant, "device": str(device), "step_times_s": times, "loss": float(loss),
            "loss_path_saved_bytes": saved, **memory}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=151_936)
    parser.add_argument("--hidden", type=int, default=896)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--chunk-tokens", type=int, default=None)
    parser.add_argument("--ignored", type=float, default=0.0,
                        help="share of positions whose label is -100 (a VLM sample's image and prompt tokens)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per process (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or auto")
    parser.add_argument("--precision", choices=["fp32", "bf16"], default="fp32", help="bf16: autocast")
    parser.add_argument("--out", default=None)
    parser.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:  # a child process
        print(json.dumps(run_one(args)))
        return
    runs: dict[str, list[dict[str, Any]]] = {variant: [] for variant in VARIANTS}
    forwarded = [f"--{key.replace('_', '-')}={value}" for key, value in vars(args).items()
                 if key not in ("out", "variant", "rounds") and value is not None]
    for round_ in range(args.rounds):
        for variant in VARIANTS:
            child = subprocess.run([sys.executable, __file__, *forwarded, "--variant", variant],
                                   capture_output=True, text=True)
            if child.returncode:
                raise RuntimeError(f"{variant} run failed:\n{child.stderr[-3000:]}")
            out = child.stdout
            runs[variant].append(json.loads(out.strip().splitlines()[-1]))
            print(f"round {round_ + 1} {variant}: {runs[variant][-1]}", flush=True)
    summary = {}
    for variant, results in runs.items():
        summary[variant] = {
            "step_time_s": median([t for r in results for t in r["step_times_s"]]),
            "loss_path_saved_mb": results[0]["loss_path_saved_bytes"] / 2**20,
            "step_peak_rss_mb": median([r["step_peak_rss_mb"] for r in results]),
            "loss": results[0]["loss"],
        }
        if "step_peak_allocated_mb" in results[0]:
            summary[variant]["step_peak_allocated_mb"] = median([r["step_peak_allocated_mb"] for r in results])
    std = summary["standard"]
    for variant in VARIANTS[1:]:
        ours = summary[variant]
        ours["time_ratio"] = ours["step_time_s"] / std["step_time_s"]
        ours["loss_path_memory_ratio"] = std["loss_path_saved_mb"] / ours["loss_path_saved_mb"]
        ours["step_peak_rss_ratio"] = std["step_peak_rss_mb"] / ours["step_peak_rss_mb"]
        if "step_peak_allocated_mb" in ours:
            ours["step_peak_allocated_ratio"] = std["step_peak_allocated_mb"] / ours["step_peak_allocated_mb"]
    summary["load_average_1m"] = psutil.getloadavg()[0]
    config = {k: getattr(args, k) for k in ("vocab", "hidden", "tokens", "layers", "chunk_tokens", "ignored", "steps",
                                            "rounds", "threads", "device", "precision")}
    name = "linear_cross_entropy" + (f"_ignored{args.ignored:g}" if args.ignored else "")
    path = write_result(name, resolve_device(args.device),
                        {"config": config, "summary": summary, "runs": runs}, args.out)
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
