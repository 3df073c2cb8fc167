#!/bin/bash
# Issue 47's float32 rows after the decode-attention prefetch change (1f424bd), same cap; three interleaved W1 pairs and W2.
# SNAP: a `git archive` of 1f424bd unpacked there; OUT: where the results go. Every other process was stopped (SIGSTOP) while it ran.
set -u
OUT=${OUT:-/tmp/p47/runs4}; mkdir -p $OUT
cd ${SNAP:-/tmp/snap3}
export PYTHONPATH=${SNAP:-/tmp/snap3}:${SNAP:-/tmp/snap3}/engine:${SNAP:-/tmp/snap3}/kernels
export KSERVE_PAGED_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
PY=${PY:-/work/main/.venv/bin/python}
note() { echo "$(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) $*" >> $OUT/series.txt; }
run() { local tag=$1; shift; note "start $tag"; $PY bench/compare.py --no-plots --no-progress --out-dir $OUT/$tag "$@" > $OUT/$tag.log 2>&1; note "end $tag rc=$?"; }
# build the native library first, so no compiler runs during a measurement
$PY -c "from kserve_paged_kernels.cpu_native import loader; print(loader.load())" >> $OUT/series.txt 2>&1
for i in 1 2 3; do run w1fp32_$i --peers vllm --only offline --workloads random --dtypes float32; done
run w2fp32 --peers vllm --only offline --workloads shared --dtypes float32
note "all done"
