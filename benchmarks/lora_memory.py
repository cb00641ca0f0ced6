"""Memory on CPU, measured: LoRA against full fine-tuning of the same small Hugging Face LLaVA.

Usage::

    python benchmarks/lora_memory.py                    # ~36M parameters, 2 rounds of (full, lora), 4 steps each
    python benchmarks/lora_memory.py --rounds 1 --steps 2 --out /tmp/lora_memory.json   # a quick look

The model is a LLaVA built from a config (no download): a CLIP vision tower (width 256, 4 layers, 32x32 images
of 16 patches), the projector and a Llama (width 512, 8 layers, 8 heads of which 2 key/value, MLP 1,536,
vocabulary 8,192), about 36M parameters. Each run trains it through ``OptimizedTrainer`` as a user would:
fp32, AdamW, 4 samples of 128 tokens (16 image tokens) per step, ``--steps`` steps and one checkpoint at the end.
Modes: ``full`` (every parameter trains) and ``lora`` (``lora.enabled``: r 8 on every Linear of the language model,
the projector trained fully through ``modules_to_save``). Each (mode, round) runs in a fresh process, modes
interleaved, so one run's peak cannot hide in the other's. Reported per mode (medians over the rounds):

- ``peak_rss_mb``: the process's peak resident memory (``getrusage(RUSAGE_SELF).ru_maxrss`` read in the child at its
  end: everything, Python and torch included);
- ``rss_model_built_mb``: its RSS once the model is built, before the trainer; ``training_rss_mb`` = the peak minus
  that, what training added (gradients, optimizer states, activations, the checkpoint's host copy);
- ``checkpoint_bytes``: the bytes of the checkpoint folder (``step_0000000N``) the run wrote;
- ``trainable_params`` / ``total_params``, and the median ``step_time_s``.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import median, write_result

MODES = ("full", "lora")
IMAGE_TOKEN = 3


def build_model() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    vision = transformers.CLIPVisionConfig(image_size=32, patch_size=8, hidden_size=256, intermediate_size=1024,
                                           num_hidden_layers=4, num_attention_heads=4)
    text = transformers.LlamaConfig(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8,
                                    num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=256)
    config = transformers.LlavaConfig(vision_config=vision, text_config=text, image_token_index=IMAGE_TOKEN)
    return transformers.LlavaForConditionalGeneration(config)


class Captions(torch.utils.data.Dataset):
    """16 image tokens, then 112 text tokens (ids 4 and up) that are also the labels."""

    def __init__(self, n: int = 64, text_tokens: int = 112) -> None:
        g = torch.Generator().manual_seed(0)
        self.pixels = torch.rand(n, 3, 32, 32, generator=g)
        self.text = torch.randint(4, 8192, (n, text_tokens), generator=g)

    def __len__(self) -> int:
        return len(self.text)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = torch.cat([torch.full((16,), IMAGE_TOKEN), self.text[i]])
        labels = torch.cat([torch.full((16,), -100), self.text[i]])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels,
                "pixel_values": self.pixels[i]}


def _rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def run_one(mode: str, steps: int, save_dir: Path) -> dict[str, Any]:
    """One training run in this process (a child): its figures."""
    from vlmfast import OptimizedTrainer, TrainSpec

    model = build_model()
    rss_model = _rss_mb()
    total = sum(p.numel() for p in model.parameters())
    spec = TrainSpec(max_steps=steps, batch_size=4, micro_batch_size=4, device="cpu", precision="fp32",
                     optimizer={"name": "adamw", "lr": 1e-4}, log={"progress": "off"},
                     memory={"leak_check": False, "timeline_plot": False},
                     save={"dir": str(save_dir), "every_steps": steps, "resume": "never"},
                     lora={"enabled": mode == "lora", "r": 8, "alpha": 16,
                           "modules_to_save": ["multi_modal_projector"]})
    trainer = OptimizedTrainer(model, Captions(), spec)
    trainable = sum(p.numel() for p in trainer.engine.module.parameters() if p.requires_grad)
    result = trainer.fit()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    folder = save_dir / f"step_{steps:08d}"
    checkpoint = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    return {"mode": mode, "peak_rss_mb": peak, "rss_model_built_mb": rss_model, "training_rss_mb": peak - rss_model,
            "checkpoint_bytes": checkpoint, "trainable_params": trainable, "total_params": total,
            "step_times_s": [row["step_time"] for row in result.history if "step_time" in row][1:],
            "final_loss": result.history[-1]["loss"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--save-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.mode:  # a child process
        print(json.dumps(run_one(args.mode, args.steps, Path(args.save_dir))))
        return
    runs: dict[str, list[dict[str, Any]]] = {mode: [] for mode in MODES}
    root = Path(tempfile.mkdtemp(prefix="lora_memory_"))
    try:
        for round_ in range(args.rounds):
            for mode in MODES:
                save_dir = root / f"{mode}_{round_}"
                child = subprocess.run([sys.executable, __file__, f"--steps={args.steps}", f"--threads={args.threads}",
                                        f"--mode={mode}", f"--save-dir={save_dir}"], capture_output=True, text=True)
                if child.returncode:
                    raise RuntimeError(f"{mode} run failed:\n{child.stderr[-3000:]}")
                runs[mode].append(json.loads(child.stdout.strip().splitlines()[-1]))
                shutil.rmtree(save_dir, ignore_errors=True)
                print(f"round {round_ + 1} {mode}: {runs[mode][-1]}", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    summary: dict[str, Any] = {}
    for mode, results in runs.items():
        summary[mode] = {key: median([r[key] for r in results]) for key in
                         ("peak_rss_mb", "rss_model_built_mb", "training_rss_mb", "checkpoint_bytes")}
        summary[mode].update(trainable_params=results[0]["trainable_params"], total_params=results[0]["total_params"],
                             step_time_s=median([t for r in results for t in r["step_times_s"]]))
    full, lora = summary["full"], summary["lora"]
    summary["ratios"] = {"peak_rss": full["peak_rss_mb"] / lora["peak_rss_mb"],
                         "training_rss": full["training_rss_mb"] / lora["training_rss_mb"],
                         "checkpoint_bytes": full["checkpoint_bytes"] / lora["checkpoint_bytes"]}
    summary["load_average_1m"] = psutil.getloadavg()[0]
    config = {"steps": args.steps, "rounds": args.rounds, "threads": args.threads, "batch_size": 4, "tokens": 128,
              "precision": "fp32", "optimizer": "adamw", "lora_r": 8, "date": time.strftime("%Y-%m-%d")}
    path = write_result("lora_memory", torch.device("cpu"), {"config": config, "summary": summary, "runs": runs},
                        args.out)
    print(json.dumps(summary, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
