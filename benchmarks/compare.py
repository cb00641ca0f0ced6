"""vlmfast against a hand-written loop, Accelerate, the HF Trainer and Lightning Fabric on the same VLM and data.

A thin wrapper of `vlmfast bench` (vlmfast/bench): every option is the command's. Run from the repository root so
results land in benchmarks/results/<device>/.

Usage::

    python benchmarks/compare.py --quick                               # every configuration, 2 steps, once
    python benchmarks/compare.py --threads 1                           # the full CPU comparison + headroom
    python benchmarks/compare.py --size gpu --repeats 3                # on a GPU
"""

from __future__ import annotations

import sys

from vlmfast.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
