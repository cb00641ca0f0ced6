"""`vlmfast bench`: the comparison against the alternatives and the memory-headroom benchmark, in one command.

Usage::

    vlmfast bench                              # CPU: size cpu, 40 steps x 5 rounds, all configurations + headroom
    vlmfast bench --quick                      # every configuration for 2 steps, once, no headroom (< 1 min)
    vlmfast bench --size gpu --repeats 3       # on a GPU: the ~150M-parameter model
    vlmfast bench --size cpu-vlm --no-headroom # CPU: 21.7M parameters, 0-4 images, 16-1024 tokens; 2+20 steps
    vlmfast bench --size gpu-1b                # GPU: 1.4B LLaVA, start and each tool's best; --dry-run: toy, CPU
    vlmfast bench --configs start,vlmfast,accelerate --repeats 9 --no-headroom
    vlmfast bench --render benchmarks/results/cpu/compare.json      # Markdown + charts again from the JSON
    vlmfast bench --device-bound 150           # the GIL-free GPU stand-in: does each tool's data path keep up?

Files (in --out, default benchmarks/results/<device>/; with --quick runs/bench-quick/<device>/, which git ignores):
compare.json / .md, compare_throughput.png, compare_memory.png, headroom.json / .md / .png; a size other than the
device's own adds _<size>, --quick adds _quick. --quick prints no target verdicts ("not measured: --quick").

    add_bench_command(subparsers)              # how vlmfast.cli.main registers it
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["add_bench_command", "build_parser", "main", "run_bench"]

QUICK = {"steps": 2, "warmup": 1, "repeats": 1}


def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--size", choices=["cpu", "cpu-vlm", "gpu", "gpu-1b"], default=None,
                        help="model, data and batch size (default: gpu on CUDA, else cpu); cpu-vlm: a 21.7M-parameter "
                        "VLM on 0-4 images and 16-1024 text tokens per sample, compute-bound on a CPU; gpu-1b: a "
                        "1.4B-parameter Hugging Face LLaVA (random weights), 1,000-2,024 tokens per sample, the batch "
                        "that fills 80 GB by vlmfast's estimator; rows: start and each tool's best")
    from vlmfast.bench.workload import SIZES  # the command runs it anyway: its help reads the sizes' own figures

    parser.add_argument("--steps", type=int, default=None, help="timed optimizer steps per run (default: the "
                        f"size's: {_per_size(SIZES, 'steps')})")
    parser.add_argument("--warmup", type=int, default=None, help="steps per run before timing starts (default: the "
                        f"size's: {_per_size(SIZES, 'warmup')})")
    parser.add_argument("--repeats", type=int, default=5, help="interleaved rounds over all configurations (default 5)")
    parser.add_argument("--configs", default=None, help="comma-separated configuration names (default: all; "
                        "'start' is always added, every ratio is against it)")
    parser.add_argument("--without", default="", help="comma-separated strategies the best rows leave out, for "
                        "every tool alike (e.g. compile: a short GPU lease cannot pay its compile time)")
    parser.add_argument("--batch-size", type=int, default=None, help="samples per step (default: the size's)")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--out", default=None, help="output folder (default: benchmarks/results/<device>; --quick: "
                        "runs/bench-quick/<device>, ignored by git)")
    parser.add_argument("--quick", action="store_true", help="every configuration for 2 steps, once, no headroom "
                        "search (unless --headroom-only); results are named *_quick, prove only that everything runs "
                        "and judge no target")
    parser.add_argument("--dry-run", action="store_true", help="--quick on the size's model classes at a toy scale "
                        "(gpu-1b: the same LLaVA classes, tiny dimensions): every row runs in seconds on a CPU")
    parser.add_argument("--no-headroom", action="store_true", help="skip the memory-headroom benchmark")
    parser.add_argument("--headroom-only", action="store_true", help="run only the memory-headroom benchmark")
    parser.add_argument("--docs", default=None, help="also write the tables into this Markdown file, between "
                        "<!-- vlmfast-bench:NAME --> and <!-- /vlmfast-bench:NAME --> (NAME: compare, headroom, ...)")
    parser.add_argument("--device-bound", type=float, default=None, metavar="STEP_MS",
                        help="run only the device-bound stand-in (vlmfast.bench.device_bound): a step of STEP_MS ms of "
                        "GIL-free time, 2 GB of host ballast, 3 data layouts; writes device_bound.json")
    parser.add_argument("--render", nargs="+", default=None, metavar="JSON",
                        help="re-write the Markdown, charts and --docs sections from result JSONs, without running")


def _per_size(sizes: dict[str, Any], field: str) -> str:
    """'cpu 40, cpu-vlm 20, ...': one figure of every size, for the help."""
    return ", ".join(f"{name} {getattr(size, field)}" for name, size in sizes.items())


def add_bench_command(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` on the `vlmfast` sub-parsers."""
    bench = subparsers.add_parser("bench", help="train the same VLM with a hand-written loop, vlmfast (each strategy, "
                                  "best), Accelerate, the HF Trainer and Fabric; tables, charts, memory headroom")
    _add_arguments(bench)
    bench.set_defaults(run=run_bench)
    return bench


def _device_bound(args: argparse.Namespace) -> int:
    """`--device-bound STEP_MS`: the stand-in's table and verdicts, its JSON in --out (default: this device's)."""
    from vlmfast.bench.device_bound import main as device_bound

    default = "runs/bench-quick/device-bound" if args.quick else "benchmarks/results/cpu"  # the stand-in is a CPU's
    out = Path(args.out or default)
    out.mkdir(parents=True, exist_ok=True)
    argv = ["--step-ms", str(args.device_bound), "--out", str(out / "device_bound.json")]
    device_bound(argv + (["--quick"] if args.quick else ["--rounds", str(min(args.repeats, 3))]))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """A standalone parser with the same options (benchmarks/compare.py uses it)."""
    parser = argparse.ArgumentParser(prog="vlmfast bench", description=__doc__.splitlines()[0])
    _add_arguments(parser)
    parser.set_defaults(run=run_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run `vlmfast bench` with `argv` (default: sys.argv[1:])."""
    args = build_parser().parse_args(argv)
    return args.run(args)


def run_bench(args: argparse.Namespace) -> int:
    """The command: run (or re-render) and write JSON, Markdown and PNGs; print the tables."""
    if args.render:
        return _render(args.render, args.docs)
    if args.device_bound is not None:
        return _device_bound(args)
    import torch

    from vlmfast.bench.report import device_dir
    from vlmfast.bench.workload import SIZES
    from vlmfast.common.utils import resolve_device

    if args.threads:
        torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    size = args.size or ("gpu" if device.type == "cuda" else "cpu")
    args.quick = args.quick or args.dry_run
    if args.quick:
        args.steps, args.warmup, args.repeats = QUICK["steps"], QUICK["warmup"], QUICK["repeats"]
    _size_defaults(args, size)
    out = Path(args.out) if args.out else _default_out(device_dir(device), args.quick)
    # compare.md / headroom.md for the device's own size: the names docs/benchmarks.md includes for every device.
    suffix = ("" if size == ("gpu" if device.type == "cuda" else "cpu") else f"_{size}") + ("_quick" * args.quick)
    written = []
    if not args.headroom_only:
        written.append(_compare(args, device, size, out / f"compare{suffix}"))
    if args.quick and not args.headroom_only and not args.no_headroom:
        # The smoke test stays under a minute on 2 cores: the headroom search alone takes ~40 s there.
        print("vlmfast bench --quick: memory headroom left out (~40 s more on 2 cores); "
              "`vlmfast bench --quick --headroom-only` runs it", flush=True)
    elif not args.no_headroom and SIZES[size].data == "processor":
        print(f"vlmfast bench: no memory-headroom search at {size}: its batch is the estimator's fill of 80 GB "
              "already (workload.memory in the JSON)", flush=True)
    elif not args.no_headroom:
        written.append(_headroom(args, device, size, out / f"headroom{suffix}"))
    if args.docs:
        _render([str(path) for path in written], args.docs, rewrite=False)
    return 0


def _default_out(device: str, quick: bool) -> Path:
    """benchmarks/results/<device> (the results the docs include); --quick: runs/bench-quick/<device>, a folder git
    ignores (a smoke test's figures are not results, and must not litter the repository)."""
    return Path("runs") / "bench-quick" / device if quick else Path("benchmarks") / "results" / device


def _size_defaults(args: argparse.Namespace, size: str) -> None:
    """--steps / --warmup not given: the size's own (a cpu-vlm step takes seconds, a cpu step tens of ms)."""
    from vlmfast.bench.workload import SIZES

    args.steps = SIZES[size].steps if args.steps is None else args.steps
    args.warmup = SIZES[size].warmup if args.warmup is None else args.warmup


def _compare(args: argparse.Namespace, device: Any, size: str, path: Path) -> Path:
    from vlmfast.bench.configs import BEST_REASONS, START, build_configs
    from vlmfast.bench.harness import run_comparison
    from vlmfast.bench.report import comparison_markdown, environment, write_results
    from vlmfast.bench.workload import SIZES
    from vlmfast.bench.workload_builder import build_workload

    workload = build_workload(size, steps=args.steps, warmup=args.warmup, batch_size=args.batch_size,
                              toy=_toy(args, size))
    without = [name for name in args.without.split(",") if name]
    configs = build_configs(device.type, without, quick=args.quick, size=size)
    rows = args.configs or ",".join(SIZES[size].configs or ())
    if rows:
        wanted = {START, *rows.split(",")}
        unknown = wanted - {c.name for c in configs}
        if unknown:
            raise ValueError(f"unknown configuration(s) {sorted(unknown)}; choose from {[c.name for c in configs]}")
        configs = [c for c in configs if c.name in wanted]
    print(f"vlmfast bench: {len(configs)} configurations x {args.repeats} round(s), {args.warmup}+{args.steps} steps, "
          f"size {size} on {device}", flush=True)
    result = {"benchmark": "compare", "environment": environment(device), "workload": workload.describe(),
              "repeats": args.repeats, "quick": args.quick, "best_reason": BEST_REASONS[device.type],
              "best_without": without,
              **run_comparison(workload, configs, args.repeats, device, progress=_progress)}
    paths = write_results(result, path.parent, path.name)
    print(comparison_markdown(result), f"\nwritten: {', '.join(str(p) for p in paths.values())}", sep="\n")
    return paths["json"]


def _toy(args: argparse.Namespace, size: str) -> bool:
    """--dry-run builds the toy scale of a size that has one (gpu-1b); the other sizes are small already."""
    from vlmfast.bench.workload import SIZES

    return bool(getattr(args, "dry_run", False)) and SIZES[size].data == "processor"


def _headroom(args: argparse.Namespace, device: Any, size: str, path: Path) -> Path:
    from vlmfast.bench.headroom import run_headroom
    from vlmfast.bench.report import environment, headroom_markdown, write_results
    from vlmfast.bench.workload_builder import build_workload

    workload = build_workload(size, steps=1, warmup=0, batch_size=args.batch_size)
    max_size = 2 * workload.batch_size if args.quick else 16 * workload.batch_size
    print(f"vlmfast bench: memory headroom (micro-batches up to {max_size})", flush=True)
    result = {"benchmark": "headroom", "environment": environment(device), "size": size,
              **run_headroom(workload, device, max_size=max_size, steps=1 if args.quick else 3)}
    paths = write_results(result, path.parent, path.name)
    print(headroom_markdown(result), f"\nwritten: {', '.join(str(p) for p in paths.values())}", sep="\n")
    return paths["json"]


def _render(results: list[str], docs: str | None, rewrite: bool = True) -> int:
    """Markdown/PNGs (and doc sections) from result JSONs; doc keys are the files' names (compare, headroom ...)."""
    from vlmfast.bench.report import comparison_markdown, headroom_markdown, update_doc, write_results

    for name in results:
        path = Path(name)
        result = json.loads(path.read_text())
        if rewrite:
            write_results(result, path.parent, path.stem)
        markdown = headroom_markdown(result) if result.get("benchmark") == "headroom" else comparison_markdown(result)
        if docs and not update_doc(docs, path.stem, markdown):
            print(f"vlmfast bench: {docs} has no <!-- vlmfast-bench:{path.stem} --> section; add the marker pair "
                  f"where the table should go", file=sys.stderr)
    return 0


def _progress(line: str) -> None:
    print(line, flush=True)


if __name__ == "__main__":  # python -m vlmfast.bench.cli ... (before `vlmfast bench` is wired into vlmfast.cli.main)
    sys.exit(main())
