#!/bin/bash
# Issue 47's AVX2 table under the whole-process cap (Zen 4). Runs from the /tmp/snap snapshot.
set -u
OUT=/tmp/p47/runs; mkdir -p $OUT
cd /tmp/snap
export PYTHONPATH=/tmp/snap:/tmp/snap/engine:/tmp/snap/kernels
export KSERVE_PAGED_ISA=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 MKL_ENABLE_INSTRUCTIONS=AVX2
PY=/work/main/.venv/bin/python
LC=$HOME/.cache/kserve-paged/peers/llamacpp-avx2
note() { echo "$(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) $*" >> $OUT/series.txt; }
run() { local tag=$1; shift; note "start $tag"; $PY bench/compare.py --no-plots --no-progress --llamacpp-dir $LC --out-dir $OUT/$tag "$@" > $OUT/$tag.log 2>&1; note "end $tag rc=$?"; }
for i in 1 2 3; do run w1fp32_$i --peers vllm --only offline --workloads random --dtypes float32; done
run w2fp32 --peers vllm --only offline --workloads shared --dtypes float32
run serve1 --peers vllm,llamacpp --only serve,ready --dtypes default --serve-workloads random --max-concurrency 1 --num-prompts 16
run bf16 --peers vllm --only offline --workloads random,shared --dtypes bfloat16
run default --peers "" --only offline --workloads random,shared --dtypes default
note "all done"
