#!/usr/bin/env bash
# Every GPU check of vlmfast in ONE call of a short GPU lease (one H100/H200, 15 minutes in all, one command of at
# most 10 minutes, at most 8 files back from $OUT, no network). docs/benchmarks.md says how to send it and file
# what comes back.
#
#   bash benchmarks/gpu_lease.sh prepare [--python-version 3.12] [--dest .wheels]
#       on the development machine: downloads the wheels the device image lacks (pydantic and its exact
#       pydantic-core pin, annotated-types, typing-inspection, typing-extensions; cp312, manylinux) into .wheels/,
#       which git ignores and the device call carries.
#   bash benchmarks/gpu_lease.sh run [--dry-run] [--out DIR] [--deadline SECONDS] [--only STEP,...] [--plan FILE]
#       the one command sent to the device: installs the wheels (--no-index --target), puts the checkout on
#       PYTHONPATH, runs the steps below most valuable first under one deadline (default 480 s), and after EACH step
#       copies its results into --out (default $OUT): gpu_lease.json (summary), the step's JSON, logs.tar.gz. A step
#       that overruns its estimate is cut, one whose estimate exceeds the time left is skipped; everything before
#       it is already in --out. --dry-run: toy sizes on any machine. --only: the smoke step and these steps (a
#       second call for what the first could not finish). --plan FILE: the steps from FILE instead (lines
#       "name<TAB>estimated seconds<TAB>result file<TAB>command"; tests). COMPARE_CONFIGS=start,vlmfast-best,...
#       narrows the comparisons' rows.
#   bash benchmarks/gpu_lease.sh plan [--dry-run] [--deadline SECONDS]
#       prints the plan with each part's estimate and the total; exit 1 when it exceeds the deadline or 8 files.
#
# Parts, most valuable first (the smoke step stops the run when it fails: a broken install costs one minute):
#   smoke; compare_gpu (start, vlmfast-best and the three peers' best at the 172M gpu size: 30 steps, 3 rounds,
#   compile per block, MFU); compare_gpu1b (the same rows at the 1.4B LLaVA gpu-1b size); trace_gpu1b
#   (torch.profiler of vlmfast-best at gpu-1b reduced to where the GPU idles); device_bound (the GIL-free stand-in
#   on the device's CPUs); sync_check (host syncs per step). Earlier leases' parts (gpu_tests, attention,
#   linear_cross_entropy, overhead) run with --plan FILE.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON="${PYTHON:-python3}"  # the device image has python3 only, and our checkout is not installed there
WHEELS="${LEASE_WHEELS:-$ROOT/.wheels}"
# What the device image lacks that `import vlmfast` needs (the image has torch, transformers, accelerate, lightning,
# peft, pytest, numpy, pyyaml, tqdm, psutil, matplotlib, tensorboard, safetensors): pydantic's closure.
REQUIREMENTS=("pydantic>=2.6,<3")
MAX_FILES=8

usage() { sed -n '2,26p' "$0"; }

prepare() {
  local pyver=3.12 dest=$WHEELS
  while [ $# -gt 0 ]; do
    case "$1" in
      --python-version) pyver=$2; shift ;;
      --dest) dest=$2; shift ;;
      *) echo "gpu_lease.sh prepare: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
  done
  local abi="cp${pyver/./}"
  mkdir -p "$dest"
  rm -f "$dest"/*.whl
  # pip resolves pydantic's requirements for that Python and platform (--only-binary is required with --platform)
  "$PYTHON" -m pip download --disable-pip-version-check -q --only-binary=:all: --dest "$dest" \
    --python-version "$pyver" --implementation cp --abi "$abi" --abi abi3 --abi none \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform any "${REQUIREMENTS[@]}" || exit 1
  ls "$dest"
  du -sh "$dest"
}

# ------------------------------------------------------------------------------------------------------ run

DRY_RUN=0 OUT_DIR="${OUT:-}" DEADLINE_S=480 PLAN="" ONLY=""
WORK="" STATUS="" START=0 DEADLINE=0

# The plan: one line per part, most valuable first: name, ESTIMATED seconds on an H200 (from the first lease: a
# compare run costs ~6 s of set-up and evaluation besides its steps), result file, command. `plan` prints it with
# the total, which must fit the deadline. Drop order when the deadline nears: the last parts first (sync_check,
# device_bound, trace, compare_gpu1b); a part whose estimate exceeds the time left is skipped and smaller ones
# after it still run; a part that overruns its estimate by 30 % (+10 s) is cut.
default_plan() {
  local py=$PYTHON w=$WORK
  local rows=${COMPARE_CONFIGS:-start,vlmfast-best,accelerate-best,hf-best,fabric-best}
  if [ "$DRY_RUN" = 1 ]; then
    printf 'smoke\t60\t-\t%s benchmarks/lease_smoke.py --out %s/smoke.json\n' "$py" "$w"
    printf 'compare_gpu\t100\tcompare_quick.json\t%s benchmarks/compare.py --quick --no-headroom --batch-size 2 --configs %s --out %s\n' "$py" "$rows" "$w"
    printf 'compare_gpu1b\t60\tcompare_gpu-1b_quick.json\t%s benchmarks/compare.py --size gpu-1b --dry-run --no-headroom --configs %s --out %s\n' "$py" "$rows" "$w"
    printf 'trace_gpu1b\t60\ttrace_gaps_gpu-1b.json\t%s benchmarks/trace_gaps.py --size gpu-1b --toy --start-step 2 --steps 2 --out %s/trace_gaps_gpu-1b.json\n' "$py" "$w"
    printf 'device_bound\t120\tdevice_bound.json\t[ ! -f benchmarks/device_bound.py ] || %s benchmarks/device_bound.py --quick --out %s/device_bound.json\n' "$py" "$w"
    printf 'sync_check\t40\tsync_check.json\t%s benchmarks/sync_check.py --steps 2 --batch-size 4 --configs default packing --out %s/sync_check.json\n' "$py" "$w"
    return
  fi
  # smoke 40 s; compare at gpu: 5 rows x 3 rounds x (3 + 30) steps of 15-110 ms, ~6 s set-up each, compile per
  # block (inductor: ~30 s cold once, ~4 s a run after) ~170 s; gpu-1b: building the 1.4B model ~20 s, 5 rows x 1
  # round x (2 + 8) steps (start ~2.5 s/step at fp32, best rows ~0.5 s) + ~8 s set-up and compile each ~150 s;
  # the trace: 5 + 3 steps of vlmfast-best at gpu-1b ~45 s; the stand-in on the device's CPUs ~40 s; syncs ~20 s.
  printf 'smoke\t40\t-\t%s benchmarks/lease_smoke.py --out %s/smoke.json\n' "$py" "$w"
  printf 'compare_gpu\t170\tcompare.json\t%s benchmarks/compare.py --size gpu --steps 30 --warmup 3 --repeats 3 --no-headroom --configs %s --out %s\n' \
    "$py" "$rows" "$w"
  printf 'compare_gpu1b\t150\tcompare_gpu-1b.json\t%s benchmarks/compare.py --size gpu-1b --steps 8 --warmup 2 --repeats 1 --no-headroom --configs %s --out %s\n' \
    "$py" "$rows" "$w"
  printf 'trace_gpu1b\t45\ttrace_gaps_gpu-1b.json\t%s benchmarks/trace_gaps.py --size gpu-1b --start-step 6 --steps 3 --out %s/trace_gaps_gpu-1b.json\n' "$py" "$w"
  printf 'device_bound\t40\tdevice_bound.json\t[ ! -f benchmarks/device_bound.py ] || %s benchmarks/device_bound.py --quick --out %s/device_bound.json\n' "$py" "$w"
  printf 'sync_check\t20\tsync_check.json\t%s benchmarks/sync_check.py --steps 4 --configs default packing device_prefetch --out %s/sync_check.json\n' "$py" "$w"
}

# `plan`: the parts, their estimates and the total against the deadline (exit 1 when it does not fit).
show_plan() {
  while [ $# -gt 0 ]; do
    case "$1" in
      --dry-run) DRY_RUN=1 ;;
      --deadline) DEADLINE_S=$2; shift ;;
      *) echo "gpu_lease.sh plan: unknown argument $1" >&2; exit 2 ;;
    esac
    shift
  done
  WORK='$WORK'
  local name estimate result command total=0 files=2
  while IFS=$'\t' read -r name estimate result command; do
    [ -z "$name" ] && continue
    total=$((total + estimate))
    [ "$result" != - ] && files=$((files + 1))
    printf '%-14s %4ss  %-28s %s\n' "$name" "$estimate" "$result" "$command"
  done <<< "$(default_plan)"
  printf 'total %ss of %ss; %s files back (gpu_lease.json, logs.tar.gz and the results; at most %s)\n' \
    "$total" "$DEADLINE_S" "$files" "$MAX_FILES"
  [ "$total" -le "$DEADLINE_S" ] && [ "$files" -le "$MAX_FILES" ]
}

# Install the carried wheels where the image lacks pydantic; the checkout itself goes on PYTHONPATH.
install() {
  local site=$WORK/site
  if ! "$PYTHON" -c "import pydantic" 2>/dev/null; then
    if ! ls "$WHEELS"/*.whl >/dev/null 2>&1; then
      echo "gpu_lease.sh: pydantic is missing and $WHEELS holds no wheels: run 'bash benchmarks/gpu_lease.sh" \
        "prepare' here and carry .wheels with the call" >&2
      return 1
    fi
    # a wheel is a zip: where the image's python has no pip, unpacking it is the whole install
    "$PYTHON" -m pip install -q --disable-pip-version-check --no-index --no-deps --no-compile --no-cache-dir \
      --upgrade --target "$site" "$WHEELS"/*.whl \
      || "$PYTHON" -c "import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]" \
        "$site" "$WHEELS"/*.whl || return 1
    export PYTHONPATH="$site:$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  else
    export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
  fi
}

# The summary and the logs go into OUT after every step: a cut step never loses what came before it.
collect() {
  local file
  for file in "$@"; do
    [ "$file" != - ] && [ -f "$WORK/$file" ] && cp "$WORK/$file" "$OUT_DIR/"
  done
  "$PYTHON" - "$WORK" "$OUT_DIR" "$DRY_RUN" "$START" "$DEADLINE_S" <<'EOF'
import json, sys, time
from pathlib import Path

work, out, dry_run, start, deadline = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4]), \
    int(sys.argv[5])
smoke = work / "smoke.json"
steps = []
for line in (work / "logs" / "steps.tsv").read_text().splitlines():
    name, state, seconds, result = line.split("\t")
    steps.append({"step": name, "status": state, "seconds": int(seconds), "log": f"logs/{name}.log",
                  "result": result if result != "-" and (out / result).exists() else None})
summary = {"benchmark": "gpu_lease", "dry_run": dry_run, "deadline_s": deadline,
           "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "elapsed_s": int(time.time()) - start,
           **(json.loads(smoke.read_text()) if smoke.exists() else {}),
           "steps": steps, "all_ok": bool(steps) and all(s["status"] == "ok" for s in steps)}
(out / "gpu_lease.json").write_text(json.dumps(summary, indent=2) + "\n")
EOF
  # the logs, the smoke record, the GPU tests' JUnit XML and the Markdown tables travel in one tarball
  tar -czf "$OUT_DIR/logs.tar.gz" -C "$WORK" logs $(cd "$WORK" && ls smoke.json gpu_tests.xml ./*.md 2>/dev/null)
}

# step NAME ESTIMATE RESULT COMMAND: skipped when its estimate exceeds the time left (the drop order: later, smaller
# steps still run), cut at 130 % of the estimate + 10 s or at the deadline
step() {
  local name=$1 estimate=$2 result=$3 command=$4
  local now left code state took limit
  now=$(date +%s); left=$((DEADLINE - now - 5))  # 5 s for collecting
  if [ "$left" -lt 10 ] || [ "$estimate" -gt "$left" ]; then
    printf '%s\tskipped (needs ~%ss, %ss left)\t0\t%s\n' "$name" "$estimate" "$left" "$result" >> "$STATUS"
    echo "== $name: skipped, ~${estimate}s needed and ${left}s left"; collect; return 0
  fi
  limit=$((estimate * 13 / 10 + 10))
  [ "$limit" -gt "$left" ] && limit=$left
  echo "== $name (at most ${limit}s): $command"
  # timeout signals the whole process group: DataLoader workers and compile workers end with the step
  timeout --kill-after=5 "$limit" bash -c "$command" > "$WORK/logs/$name.log" 2>&1
  code=$?
  took=$(( $(date +%s) - now ))
  state=ok
  { [ "$code" = 124 ] || [ "$code" = 137 ]; } && state=timeout
  [ "$state" = ok ] && [ "$code" != 0 ] && state="failed ($code)"
  printf '%s\t%s\t%s\t%s\n' "$name" "$state" "$took" "$result" >> "$STATUS"
  echo "   $state in ${took}s"
  tail -n 4 "$WORK/logs/$name.log" | sed 's/^/   | /'
  collect "$result"
  [ "$state" = ok ]
}

run() {
  while [ $# -gt 0 ]; do
    case "$1" in
      --dry-run) DRY_RUN=1 ;;
      --out) OUT_DIR=$2; shift ;;
      --deadline) DEADLINE_S=$2; shift ;;
      --plan) PLAN=$2; shift ;;
      --only) ONLY=",smoke,$2,"; shift ;;
      *) echo "gpu_lease.sh run: unknown argument $1 (see --help)" >&2; exit 2 ;;
    esac
    shift
  done
  if [ -z "$OUT_DIR" ]; then
    OUT_DIR=$(mktemp -d -t vlmfast-lease-XXXX)
    echo "gpu_lease.sh: \$OUT is not set; results in $OUT_DIR"
  fi
  mkdir -p "$OUT_DIR"
  START=$(date +%s); DEADLINE=$((START + DEADLINE_S))
  WORK=$(mktemp -d -t vlmfast-lease-work-XXXX)
  export LEASE_WORK=$WORK  # where steps write their results (--plan files use it)
  mkdir -p "$WORK/logs"; STATUS="$WORK/logs/steps.tsv"; : > "$STATUS"
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
  [ "$DRY_RUN" = 1 ] && export CUDA_VISIBLE_DEVICES=""
  command -v nvidia-smi > /dev/null && nvidia-smi > "$WORK/logs/nvidia-smi.log" 2>&1
  if ! install > "$WORK/logs/install.log" 2>&1; then
    printf 'install\tfailed\t%s\t-\n' "$(( $(date +%s) - START ))" >> "$STATUS"
    cat "$WORK/logs/install.log"; collect; exit 1
  fi
  local plan name limit result command first=1
  plan=$(if [ -n "$PLAN" ]; then cat "$PLAN"; else default_plan; fi)
  while IFS=$'\t' read -r name limit result command; do
    [ -z "$name" ] && continue
    [ -n "$ONLY" ] && [[ "$ONLY" != *",$name,"* ]] && continue
    if ! step "$name" "$limit" "$result" "$command" && [ "$first" = 1 ]; then
      echo "gpu_lease.sh: the first step ($name) failed: the rest would fail the same way; stopping" >&2
      break
    fi
    first=0
  done <<< "$plan"
  echo "gpu_lease.sh: $(ls "$OUT_DIR" | wc -l) files in $OUT_DIR after $(( $(date +%s) - START ))s"
  [ "$(ls "$OUT_DIR" | wc -l)" -le "$MAX_FILES" ] || echo "gpu_lease.sh: more than $MAX_FILES files in $OUT_DIR" >&2
  "$PYTHON" -c "import json,sys; s=json.load(open(sys.argv[1])); sys.exit(0 if s['all_ok'] else 1)" \
    "$OUT_DIR/gpu_lease.json"
}

case "${1:-}" in
  prepare) shift; prepare "$@" ;;
  plan) shift; show_plan "$@" ;;
  run) shift; run "$@" ;;
  -h|--help|"") usage ;;
  *) echo "gpu_lease.sh: unknown verb $1 (prepare or run)" >&2; exit 2 ;;
esac
