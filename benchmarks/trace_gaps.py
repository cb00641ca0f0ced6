"""A torch.profiler trace of vlmfast-best over a few steady steps, reduced to where the device idles (small JSON).

Trains the benchmark size (default gpu-1b) with vlmfast's best configuration for that device and size, profiles
optimizer steps ``--start-step`` .. ``--start-step + --steps - 1`` (vlmfast's own ``profile.trace``), and reduces the
Chrome trace with :func:`vlmfast.bench.trace_gaps.reduce_trace`: busy fraction per step, the longest idle gaps and
the host events during them. The raw trace stays in --trace-dir (hundreds of MB at gpu-1b: not for a lease's 8 files).

Usage::

    python benchmarks/trace_gaps.py --size gpu-1b --start-step 6 --steps 3 --out trace_gpu-1b.json     # on the GPU
    python benchmarks/trace_gaps.py --size gpu-1b --toy --start-step 2 --steps 2 --out /tmp/gaps.json  # CPU rehearsal
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from _common import write_result

from vlmfast.bench.configs import best_spec
from vlmfast.bench.runners import Settings, vlmfast_run
from vlmfast.bench.trace_gaps import reduce_trace
from vlmfast.bench.workload_builder import build_workload
from vlmfast.common.utils import resolve_device


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="gpu-1b")
    parser.add_argument("--toy", action="store_true", help="the size's toy scale (gpu-1b), for a CPU rehearsal")
    parser.add_argument("--start-step", type=int, default=6, help="first profiled optimizer step (1-based): after "
                        "compilation and the loader's start")
    parser.add_argument("--steps", type=int, default=3, help="profiled steps")
    parser.add_argument("--gaps", type=int, default=8, help="longest idle gaps kept")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--trace-dir", default=None, help="where the raw trace stays (default: a temporary folder)")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = resolve_device(args.device)
    quick = args.toy  # a toy rehearsal compiles nothing (dynamo's eager backend), as bench --quick
    spec = best_spec(device.type, quick=quick, size=args.size)
    trace_dir = Path(args.trace_dir or tempfile.mkdtemp(prefix="vlmfast-trace-"))
    spec["profile"] = {"trace": {"enabled": True, "start_step": args.start_step, "warmup_steps": 1,
                                 "active_steps": args.steps, "format": "chrome", "dir": str(trace_dir)}}
    workload = build_workload(args.size, steps=args.steps, warmup=args.start_step - 1, toy=args.toy)
    started = time.perf_counter()
    run = vlmfast_run(workload, Settings(spec=spec), device)
    traces = sorted(trace_dir.glob("trace_steps_*.json"))
    if not traces:
        raise SystemExit(f"trace_gaps: no trace written in {trace_dir}")
    summary = reduce_trace(traces[-1], gaps=args.gaps)
    result = {"benchmark": "trace_gaps", "size": args.size, "toy": args.toy, "spec": spec,
              "workload": workload.describe(), "profiled_steps": [args.start_step, args.start_step + args.steps - 1],
              "step_times_s": run.step_times, "trace_mb": traces[-1].stat().st_size / 2**20,
              "seconds": time.perf_counter() - started, **summary}
    path = write_result(f"trace_gaps_{args.size}", device, result, args.out)
    print(json.dumps({k: result[k] for k in ("busy_fraction", "idle_ms_per_step", "steps")}, indent=2))
    print(f"written: {path}")


if __name__ == "__main__":
    main()
