"""The device-bound stand-in (issue 33): see vlmfast/bench/device_bound.py. Run from the repository root:

    .venv/bin/python benchmarks/device_bound.py --step-ms 150 --ballast-gb 2 --workers 4 --rounds 3 --out r.json
"""

from vlmfast.bench.device_bound import main

if __name__ == "__main__":
    main()
