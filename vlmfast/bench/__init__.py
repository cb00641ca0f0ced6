"""``vlmfast bench``: vlmfast against the tools users would pick instead, on the same model and data, in one run.

Contenders (vlmfast.bench.runners): a hand-written PyTorch loop (the starting point), vlmfast with each strategy alone
and with its best combination, an Accelerate loop, the Hugging Face Trainer and a Lightning Fabric loop. Configurations
(vlmfast.bench.configs), interleaved repeated runs (vlmfast.bench.harness), the memory-headroom benchmark
(vlmfast.bench.headroom), JSON / Markdown / PNG output (vlmfast.bench.report).

Usage::

    vlmfast bench --quick                       # or: python benchmarks/compare.py --quick

    from vlmfast.bench import build_configs, build_workload, run_comparison
    result = run_comparison(build_workload("cpu"), build_configs("cpu"), repeats=5, device=torch.device("cpu"))
"""

from vlmfast.bench.configs import BenchConfig, build_configs, skip_reason
from vlmfast.bench.harness import run_comparison
from vlmfast.bench.headroom import run_headroom
from vlmfast.bench.runners import RunResult, Settings
from vlmfast.bench.workload import SIZES, Workload
from vlmfast.bench.workload_builder import build_workload

__all__ = ["SIZES", "BenchConfig", "RunResult", "Settings", "Workload", "build_configs", "build_workload",
           "run_comparison", "run_headroom", "skip_reason"]
