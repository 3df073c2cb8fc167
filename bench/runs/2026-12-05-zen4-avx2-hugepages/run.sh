#!/bin/bash
# Issue 47's float32 rows and one-at-a-time again after packed weights moved to 2 MiB pages (b0a5ca8), same cap.
# SNAP: a `git archive` of b0a5ca8 unpacked there; OUT: where the results go. Every other process was stopped (SIGSTOP) while it ran.
set -u
OUT=${OUT:-/tmp/p47/runs2}; mkdir -p $OUT
cd ${SNAP:-/tmp/snap2}
export PYTHONPATH=${SNAP:-/tmp/snap2}:${SNAP:-/tmp/snap2}/engine:${SNAP:-/tmp/snap2}/kernels
export KSERVE_PAGED_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
PY=${PY:-/work/main/.venv/bin/python}
LC=$HOME/.cache/kserve-paged/peers/llamacpp-avx2
note() { echo "$(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) $*" >> $OUT/series.txt; }
run() { local tag=$1; shift; note "start $tag"; $PY bench/compare.py --no-plots --no-progress --llamacpp-dir $LC --out-dir $OUT/$tag "$@" > $OUT/$tag.log 2>&1; note "end $tag rc=$?"; }
for i in 1 2 3; do run w1fp32_$i --peers vllm --only offline --workloads random --dtypes float32; done
run w2fp32 --peers vllm --only offline --workloads shared --dtypes float32
run serve1 --peers vllm,llamacpp --only serve,ready --dtypes default --serve-workloads random --max-concurrency 1 --num-prompts 16
note "all done"
