#!/usr/bin/env bash
# The serve command: sets up (scripts/setup.sh), then starts the KServe server on the default
# model (or on /mnt/models when it exists). Extra arguments go to the server.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
VENV="${KSERVE_PAGED_VENV:-.venv}"
exec "$VENV/bin/python" -m kserve_paged --model_name "${MODEL_NAME:-smol}" \
  --http_port "${PORT:-8080}" "$@"
