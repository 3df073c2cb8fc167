#!/bin/bash
# Three more interleaved W1 float32 pairs on the same snapshot (b0a5ca8), same cap.
set -u
OUT=${OUT:-/tmp/p47/runs3}; mkdir -p $OUT
cd ${SNAP:-/tmp/snap2}
export PYTHONPATH=${SNAP:-/tmp/snap2}:${SNAP:-/tmp/snap2}/engine:${SNAP:-/tmp/snap2}/kernels
export KSERVE_PAGED_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
PY=${PY:-/work/main/.venv/bin/python}
note() { echo "$(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) $*" >> $OUT/series.txt; }
run() { local tag=$1; shift; note "start $tag"; $PY bench/compare.py --no-plots --no-progress --out-dir $OUT/$tag "$@" > $OUT/$tag.log 2>&1; note "end $tag rc=$?"; }
for i in 4 5 6; do run w1fp32_$i --peers vllm --only offline --workloads random --dtypes float32; done
note "all done"
