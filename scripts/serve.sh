#!/usr/bin/env bash
# The serve command: sets up (scripts/setup.sh), then runs the default model on a prompt.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${KSERVE_PAGED_VENV:-.venv}"
exec "$VENV/bin/python" -m engine generate "$@"
