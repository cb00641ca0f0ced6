#!/usr/bin/env bash
# Regenerate constraints/dev.txt from the newest releases: a fresh venv without constraints, the dev install, the
# whole suite on it, then its `pip freeze` written as the new constraints. Commit the result on its own, with the
# suite's outcome in the message, so a dependency update never hides inside another change.
#   bash scripts/update_constraints.sh
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
git worktree add -q --detach "$work/tree" HEAD
(cd "$work/tree" && VLMFAST_CONSTRAINTS=none bash scripts/setup.sh --dev && .venv/bin/python -m pytest -q -x)
{
  sed -n '1,3p' constraints/dev.txt
  "$work/tree/.venv/bin/python" -m pip freeze 2>/dev/null | grep -v '^-e ' | sed -E 's/^(torch==[0-9.]+)\+cpu$/\1/'
} > "$work/dev.txt"
mv "$work/dev.txt" constraints/dev.txt
git worktree remove --force "$work/tree"
echo "constraints/dev.txt updated: review the diff and commit it on its own"
