"""Memory headroom: the largest micro-batch per strategy under one budget, and the OOM fallback completing a run
that crashes the plain loop. A thin wrapper of `vlmfast bench --headroom-only` (vlmfast/bench/headroom.py).

Usage::

    python benchmarks/headroom.py                  # CPU memory model (or real CUDA memory on a GPU)
    python benchmarks/headroom.py --size gpu                          # real CUDA memory
"""

from __future__ import annotations

import sys

from vlmfast.bench.cli import main

if __name__ == "__main__":
    sys.exit(main(["--headroom-only", *sys.argv[1:]]))
