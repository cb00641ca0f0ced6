#!/usr/bin/env bash
# One command for a GPU owner: every check that needs a real GPU, in one go, inside 25 minutes on one H100.
#
#   bash benchmarks/gpu_check.sh                 # on a CUDA machine, from the repository root
#   bash benchmarks/gpu_check.sh --dry-run       # on any machine: every step that can run, at toy sizes (CI runs it)
#   bash benchmarks/gpu_check.sh --out DIR       # results elsewhere (default: benchmarks/results/<device>/)
#
# Steps (each one bounded by its own time limit and by the overall deadline; one failing step does not stop the rest):
#   1. the GPU-marked tests (pytest -m gpu): real CUDA OOM, CUDA attention backends, GPU host-sync budget, ...
#   2. trainer overhead against a hand-written loop (benchmarks/overhead.py, paired and interleaved)
#   3. attention: eager / SDPA kernels / flex / flash-attn, unpacked and packed rows (benchmarks/attention.py)
#   4. memory headroom under a real allocator cap (benchmarks/headroom.py --size gpu)
#   5. vlmfast against a hand-written loop, Accelerate, the HF Trainer and Fabric (benchmarks/compare.py --size gpu)
#   6. host syncs per step under torch.cuda.set_sync_debug_mode (benchmarks/sync_check.py)
# Writes every step's JSON plus gpu_check.json (device, versions, each step's status, seconds and log file).
set -uo pipefail

cd "$(dirname "$0")/.."
DRY_RUN=0
OUT=""
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY_RUN=1 ;;
    --out) OUT="$2"; shift ;;
    -h|--help) sed -n '2,16p' "$0"; exit 0 ;;
    *) echo "gpu_check.sh: unknown argument $1 (see --help)" >&2; exit 2 ;;
  esac
  shift
done

PYTHON="${PYTHON:-}"
if [ -z "$PYTHON" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi

if [ "$DRY_RUN" = 0 ] && ! "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_check.sh: no CUDA device here; run with --dry-run to check the steps on this machine" >&2
  exit 2
fi
DEVICE_DIR=$("$PYTHON" -c "
import torch
print(torch.cuda.get_device_name(0).replace(' ', '-').lower() if torch.cuda.is_available() else 'cpu')")
if [ -z "$OUT" ]; then
  if [ "$DRY_RUN" = 1 ]; then OUT=$(mktemp -d -t vlmfast-gpu-check-XXXX); else OUT="benchmarks/results/$DEVICE_DIR"; fi
fi
mkdir -p "$OUT/logs"
START=$(date +%s)
DEADLINE=$((START + ${GPU_CHECK_BUDGET_S:-1470}))  # 24.5 minutes
STATUS="$OUT/logs/steps.tsv"
: > "$STATUS"

# run NAME LIMIT_SECONDS COMMAND...: bounded by LIMIT and by what is left before the deadline; logs to logs/NAME.log
run() {
  local name=$1 limit=$2; shift 2
  local now left code
  now=$(date +%s); left=$((DEADLINE - now))
  if [ "$left" -le 10 ]; then
    printf '%s\tskipped\t0\tno time left before the 25-minute deadline\n' "$name" >> "$STATUS"
    echo "== $name: skipped (deadline)"; return
  fi
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (at most ${limit}s): $*"
  timeout --kill-after=20 "$limit" "$@" > "$OUT/logs/$name.log" 2>&1
  code=$?
  local took=$(( $(date +%s) - now ))
  local state=ok
  [ "$code" = 124 ] && state=timeout
  [ "$code" != 0 ] && [ "$code" != 124 ] && state="failed ($code)"
  printf '%s\t%s\t%s\t%s\n' "$name" "$state" "$took" "logs/$name.log" >> "$STATUS"
  echo "   $state in ${took}s (log: $OUT/logs/$name.log)"
  tail -n 3 "$OUT/logs/$name.log" | sed 's/^/   | /'
}

if [ "$DRY_RUN" = 1 ]; then
  # Toy sizes on whatever device is here: every script, every option, the same files; the numbers mean nothing.
  GPU_TEST_FILES=$(grep -l "mark.gpu" tests/*.py tests/faults/*.py | tr '\n' ' ')
  run gpu_tests 300 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider $GPU_TEST_FILES
  run overhead 120 "$PYTHON" benchmarks/overhead.py --steps 2 --warmup 1 --repeats 1 --batch-size 2 \
    --out "$OUT/overhead.json"
  run attention 120 "$PYTHON" benchmarks/attention.py --lengths 64 --repeats 1 --reps-per-round 1 \
    --out "$OUT/attention.json"
  run attention_packed 120 "$PYTHON" benchmarks/attention.py --lengths 64 --repeats 1 --reps-per-round 1 \
    --packed 4 --out "$OUT/attention_packed4.json"
  run headroom 240 "$PYTHON" benchmarks/headroom.py --quick --batch-size 2 --out "$OUT"
  # hf-best then fabric-best: the order that made Fabric's TF32 check raise on a GPU (see vlmfast/tf32.py)
  run compare 300 "$PYTHON" benchmarks/compare.py --quick --no-headroom --batch-size 2 \
    --configs hf-best,fabric-best --out "$OUT"
  run sync_check 180 "$PYTHON" benchmarks/sync_check.py --steps 2 --batch-size 4 --configs default packing \
    --out "$OUT/sync_check.json"
else
  run gpu_tests 330 "$PYTHON" -m pytest -q -m gpu -p no:cacheprovider -rs tests/ --junitxml="$OUT/gpu_tests.xml"
  run overhead 120 "$PYTHON" benchmarks/overhead.py --out "$OUT/overhead.json"
  run attention 180 "$PYTHON" benchmarks/attention.py --dtype bf16 --lengths 1024 2048 4096 8192 \
    --out "$OUT/attention.json"
  run attention_packed 150 "$PYTHON" benchmarks/attention.py --dtype bf16 --lengths 2048 4096 8192 --packed 4 \
    --out "$OUT/attention_packed4.json"
  run headroom 240 "$PYTHON" benchmarks/headroom.py --size gpu --out "$OUT"
  run compare 480 "$PYTHON" benchmarks/compare.py --size gpu --repeats 2 --no-headroom --out "$OUT"
  run sync_check 120 "$PYTHON" benchmarks/sync_check.py --out "$OUT/sync_check.json"
fi

"$PYTHON" - "$OUT" "$DRY_RUN" "$START" <<'EOF'
import json, platform, sys, time
from pathlib import Path

import torch

out, dry_run, start = Path(sys.argv[1]), sys.argv[2] == "1", int(sys.argv[3])
versions = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
for name in ("vlmfast", "transformers", "accelerate", "lightning_fabric", "deepspeed", "flash_attn"):
    try:
        versions[name] = __import__(name).__version__
    except Exception:
        versions[name] = None
cuda = torch.cuda.is_available()
written = {"gpu_tests": ["gpu_tests.xml"], "overhead": ["overhead.json"], "attention": ["attention.json"],
           "attention_packed": ["attention_packed4.json"], "headroom": ["headroom.json", "headroom_quick.json"],
           "compare": ["compare.json", "compare_quick.json"], "sync_check": ["sync_check.json"]}
steps = []
for line in (out / "logs" / "steps.tsv").read_text().splitlines():
    name, state, seconds, log = line.split("\t")
    steps.append({"step": name, "status": state, "seconds": int(seconds), "log": log,
                  "results": [f for f in written.get(name, []) if (out / f).exists()]})
summary = {
    "benchmark": "gpu_check", "dry_run": dry_run,
    "device": torch.cuda.get_device_name(0) if cuda else "cpu",
    "device_memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 1) if cuda else None,
    "versions": versions, "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "total_seconds": int(time.time()) - start,
    "steps": steps, "all_ok": all(s["status"] == "ok" for s in steps),
}
(out / "gpu_check.json").write_text(json.dumps(summary, indent=2) + "\n")
print(f"gpu_check: {sum(s['status'] == 'ok' for s in steps)}/{len(steps)} steps ok in {summary['total_seconds']}s; "
      f"{out / 'gpu_check.json'}")
sys.exit(0 if summary["all_ok"] else 1)
EOF
