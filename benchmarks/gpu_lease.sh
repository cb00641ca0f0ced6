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
#       that times out is cut; everything before it is already in --out. --dry-run: toy sizes on any machine.
#       --only: the smoke step and these steps (a second call for what the first could not finish). --plan FILE:
#       the steps from FILE instead (lines "name<TAB>seconds<TAB>result file<TAB>command"; tests).
#       COMPARE_CONFIGS=start,vlmfast-best,... narrows the comparison's rows.
#
# Steps, most valuable first (the smoke step stops the run when it fails: a broken install costs one minute):
#   smoke, gpu_tests, compare (vs hand-written, Accelerate, HF Trainer, with MFU), sync_check (torch's own syncs),
#   attention (2k, 4k), attention_packed, linear_cross_entropy (vocabulary 151,936), overhead.
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PYTHON="${PYTHON:-python3}"  # the device image has python3 only, and our checkout is not installed there
WHEELS="${LEASE_WHEELS:-$ROOT/.wheels}"
# What the device image lacks that `import vlmfast` needs (the image has torch, transformers, accelerate, lightning,
# peft, pytest, numpy, pyyaml, tqdm, psutil, matplotlib, tensorboard, safetensors): pydantic's closure.
REQUIREMENTS=("pydantic>=2.6,<3")
MAX_FILES=8

usage() { sed -n '2,19p' "$0"; }

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

default_plan() {
  local py=$PYTHON w=$WORK
  local gpu_files
  gpu_files=$(grep -l "mark.gpu" tests/*.py tests/faults/*.py | tr '\n' ' ')
  if [ "$DRY_RUN" = 1 ]; then
    printf 'smoke\t60\t-\t%s benchmarks/lease_smoke.py --out %s/smoke.json\n' "$py" "$w"
    printf 'gpu_tests\t240\t-\t%s -m pytest -q -m gpu -p no:cacheprovider -rs %s --junitxml=%s/gpu_tests.xml\n' \
      "$py" "$gpu_files" "$w"
    printf 'compare\t240\tcompare_quick.json\t%s benchmarks/compare.py --quick --no-headroom --batch-size 2 --without compile --configs start,vlmfast-best,hf-best --out %s\n' "$py" "$w"
    printf 'sync_check\t150\tsync_check.json\t%s benchmarks/sync_check.py --steps 2 --batch-size 4 --configs default packing token_budget --out %s/sync_check.json\n' "$py" "$w"
    printf 'attention\t90\tattention.json\t%s benchmarks/attention.py --lengths 64 --repeats 1 --reps-per-round 1 --out %s/attention.json\n' "$py" "$w"
    printf 'attention_packed\t90\tattention_packed4.json\t%s benchmarks/attention.py --lengths 64 --repeats 1 --reps-per-round 1 --packed 4 --out %s/attention_packed4.json\n' "$py" "$w"
    printf 'linear_cross_entropy\t150\tlinear_cross_entropy.json\t%s benchmarks/linear_cross_entropy.py --vocab 4096 --hidden 64 --tokens 128 --steps 1 --rounds 1 --out %s/linear_cross_entropy.json\n' "$py" "$w"
    printf 'overhead\t90\toverhead.json\t%s benchmarks/overhead.py --steps 2 --warmup 1 --repeats 1 --batch-size 2 --out %s/overhead.json\n' "$py" "$w"
    return
  fi
  local contenders=${COMPARE_CONFIGS:-start,vlmfast,vlmfast+bf16,vlmfast+sdpa,vlmfast+packing,vlmfast-best,accelerate,accelerate-best,hf-trainer,hf-best}
  printf 'smoke\t60\t-\t%s benchmarks/lease_smoke.py --out %s/smoke.json\n' "$py" "$w"
  printf 'gpu_tests\t100\t-\t%s -m pytest -v -m gpu -p no:cacheprovider -rs --timeout=40 %s --junitxml=%s/gpu_tests.xml\n' \
    "$py" "$gpu_files" "$w"
  printf 'compare\t190\tcompare.json\t%s benchmarks/compare.py --size gpu --steps 10 --warmup 3 --repeats 2 --no-headroom --without compile --configs %s --out %s\n' \
    "$py" "$contenders" "$w"
  printf 'sync_check\t45\tsync_check.json\t%s benchmarks/sync_check.py --steps 4 --out %s/sync_check.json\n' "$py" "$w"
  printf 'attention\t60\tattention.json\t%s benchmarks/attention.py --dtype bf16 --lengths 2048 4096 --repeats 3 --out %s/attention.json\n' "$py" "$w"
  printf 'attention_packed\t50\tattention_packed4.json\t%s benchmarks/attention.py --dtype bf16 --lengths 2048 4096 --packed 4 --repeats 3 --out %s/attention_packed4.json\n' "$py" "$w"
  printf 'linear_cross_entropy\t40\tlinear_cross_entropy.json\t%s benchmarks/linear_cross_entropy.py --device cuda --precision bf16 --tokens 8192 --steps 3 --rounds 1 --out %s/linear_cross_entropy.json\n' "$py" "$w"
  printf 'overhead\t30\toverhead.json\t%s benchmarks/overhead.py --steps 20 --warmup 5 --repeats 3 --out %s/overhead.json\n' "$py" "$w"
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

# step NAME LIMIT RESULT COMMAND: bounded by LIMIT and by the deadline; a step with too little time left is skipped
step() {
  local name=$1 limit=$2 result=$3 command=$4
  local now left code state took
  now=$(date +%s); left=$((DEADLINE - now - 5))  # 5 s for collecting
  if [ "$left" -lt 10 ]; then
    printf '%s\tskipped (deadline)\t0\t%s\n' "$name" "$result" >> "$STATUS"
    echo "== $name: skipped, the deadline is near"; collect; return 0
  fi
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
  run) shift; run "$@" ;;
  -h|--help|"") usage ;;
  *) echo "gpu_lease.sh: unknown verb $1 (prepare or run)" >&2; exit 2 ;;
esac
