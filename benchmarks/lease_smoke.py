"""The GPU lease's first step: versions, the device, and one bf16 training step, in well under a minute.

A broken install (a missing wheel, an import error, a CUDA path that raises) then costs one minute of the lease,
not all of it: `benchmarks/gpu_lease.sh run` stops when this step fails.

Usage::

    python3 benchmarks/lease_smoke.py --out smoke.json              # on the GPU (or the CPU without one)
"""

from __future__ import annotations

import argparse
import importlib
import json
import platform
import sys
import time
from pathlib import Path
from typing import Any

PACKAGES = ("vlmfast", "torch", "transformers", "accelerate", "pydantic", "pydantic_core", "lightning_fabric", "peft",
            "deepspeed", "flash_attn", "webdataset", "safetensors", "numpy", "pytest")


def versions() -> dict[str, str | None]:
    """Each package's version, or None where it is missing (deepspeed and flash-attn are not on the lease's image)."""
    found: dict[str, str | None] = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            found[name] = getattr(importlib.import_module(name), "__version__", "?")
        except Exception:  # missing, or broken on import: either way unavailable here
            found[name] = None
    return found


def device_info() -> dict[str, Any]:
    import torch

    from vlmfast.profiling import peak_tflops

    if not torch.cuda.is_available():
        return {"device": "cpu", "cuda": None}
    props = torch.cuda.get_device_properties(0)
    return {"device": props.name, "cuda": torch.version.cuda, "capability": f"{props.major}.{props.minor}",
            "memory_gib": round(props.total_memory / 2**30, 1), "multiprocessors": props.multi_processor_count,
            "bf16_dense_peak_tflops": peak_tflops(torch.device("cuda"), "bf16")}


def one_bf16_step() -> dict[str, Any]:
    """One optimizer step of the built-in tiny VLM through OptimizedTrainer, bf16 on CUDA (fp32 on CPU)."""
    import torch

    from vlmfast import OptimizedTrainer, TrainSpec
    from vlmfast.models import build_tiny_vlm_task

    cuda = torch.cuda.is_available()
    model, dataset, collate = build_tiny_vlm_task(seed=0, num_samples=8)
    spec = TrainSpec(max_steps=1, batch_size=8, precision="bf16" if cuda else "fp32", device="cuda" if cuda else "cpu",
                     seed=0, log={"progress": "off"})
    start = time.perf_counter()
    result = OptimizedTrainer(model, dataset, spec, collate_fn=collate).fit()
    loss = result.history[-1].get("loss") if result.history else None
    return {"precision": spec.precision, "seconds": round(time.perf_counter() - start, 2), "loss": loss}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    found = versions()
    record: dict[str, Any] = {"versions": found, "executable": sys.executable}
    if found["vlmfast"] is None or found["pydantic"] is None:
        record["error"] = "vlmfast or pydantic does not import: were the wheels carried (gpu_lease.sh prepare)?"
    else:
        record.update(device_info())
        record["step"] = one_bf16_step()
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))
    return 1 if "error" in record else 0


if __name__ == "__main__":
    sys.exit(main())
