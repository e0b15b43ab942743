#!/bin/bash
# session 8 device call 1 (issue 13): prefill coalescing sweep, HTTP (engine process) vs direct, 1B shape
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
for K in 0 4 8 2; do
  timeout 140 python3 scripts/bench_server.py --shape 1b --requests 768 --rounds 3 --engine-process --prefill-wait-steps $K --out $R/k$K > $R/k$K.log 2>&1; echo "K=$K rc=$? t=${SECONDS}s"
  grep -E "^direct|^http|overhead|prefill" $R/k$K.log | cut -c1-200
done
date -u | tee -a $R/gpu.txt
cd $OUT && tar czf results.tgz r && rm -rf r
