#!/usr/bin/env bash
# Create .venv and install vlmfast into it.
#   bash scripts/setup.sh          # the library and its CLI
#   bash scripts/setup.sh --dev    # plus the test, lint and Hugging Face dependencies, at CI's pinned versions
# torch is installed first, on its own: a bare `torch` requirement on a machine without torch makes pip pull the
# newest CUDA build (several GB). VLMFAST_TORCH overrides what is installed (pip arguments, e.g. "torch==2.5.1").
set -euo pipefail
cd "$(dirname "$0")/.."
python=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  echo "setup: installing torch (${VLMFAST_TORCH:-torch==2.13.0})" >&2
  # shellcheck disable=SC2086
  "${pip[@]}" install ${VLMFAST_TORCH:-torch==2.13.0}
fi
extras=""
constraints=()
if [ "${1:-}" = "--dev" ]; then
  extras="[dev]"
  # CI's exact versions (constraints/dev.txt): a new release cannot change a test's verdict between two runs.
  # VLMFAST_CONSTRAINTS=none installs the newest instead (scripts/update_constraints.sh does, to refresh them).
  [ "${VLMFAST_CONSTRAINTS:-}" = "none" ] || constraints=(-c constraints/dev.txt)
fi
if [ -n "$extras" ] && ! .venv/bin/python -c "import deepspeed" 2>/dev/null; then
  # DeepSpeed's sdist builds against the installed torch (no build isolation, or pip would fetch another torch);
  # DS_BUILD_OPS=0 skips compiling its CUDA ops here: the few it needs on CPU build on first use.
  echo "setup: installing deepspeed (for the ZeRO backend tests)" >&2
  "${pip[@]}" install ${constraints[@]+"${constraints[@]}"} setuptools wheel
  DS_BUILD_OPS=0 "${pip[@]}" install ${constraints[@]+"${constraints[@]}"} --no-build-isolation "deepspeed>=0.15"
fi
echo "setup: installing vlmfast${extras}" >&2
"${pip[@]}" install ${constraints[@]+"${constraints[@]}"} -e ".${extras}"
