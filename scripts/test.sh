#!/usr/bin/env bash
# The test command: sets up a fresh machine (scripts/setup.sh), lints, and runs the whole suite,
# printing its 25 slowest tests at the end. Arguments go to pytest; the inner loop while working
# is `bash scripts/test.sh -m "not slow and not e2e"`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${KSERVE_PAGED_VENV:-.venv}"
"$VENV/bin/ruff" check .
# A fresh Triton cache every run: a warm one hides compile failures a new machine would hit.
TRITON_CACHE_DIR="$(mktemp -d)"
export TRITON_CACHE_DIR
trap 'rm -rf "$TRITON_CACHE_DIR"' EXIT
set +e
"$VENV/bin/python" -m pytest --durations=25 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "pytest collected no tests: that is a failure" >&2
  exit 1
fi
exit "$rc"
