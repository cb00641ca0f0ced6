"""Shared benchmark plumbing: machine/version info and result files."""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

RESULTS = Path(__file__).parent / "results"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device).replace(" ", "-").lower()
    return "cpu"


def environment(device: torch.device) -> dict[str, Any]:
    """What a reader needs to reproduce a number: machine, versions, command."""
    import vlmfast

    return {
        "device": device_name(device),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vlmfast": vlmfast.__version__,
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
    }


def write_result(name: str, device: torch.device, result: dict[str, Any], out: str | None = None) -> Path:
    path = Path(out) if out else RESULTS / device_name(device) / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"environment": environment(device), **result}, indent=2) + "\n")
    return path


def median(values: list[float]) -> float:
    return statistics.median(values)
