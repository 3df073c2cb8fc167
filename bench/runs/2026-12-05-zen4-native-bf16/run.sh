#!/bin/bash
OUT=/tmp/p47/runs_native; mkdir -p $OUT
cd /tmp/snap3
export PYTHONPATH=/tmp/snap3:/tmp/snap3/engine:/tmp/snap3/kernels
note() { echo "$(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg) $*" >> $OUT/series.txt; }
note start
/work/main/.venv/bin/python bench/compare.py --no-plots --no-progress --out-dir $OUT --peers vllm --only offline --workloads random,shared --dtypes default,bfloat16 > $OUT/compare.log 2>&1
note "end rc=$?"
