#!/bin/bash
# session 12 device call 3 (issue 12), H100: the engine's SwiGLU and RoPE + KV write kernels at
# prefill sizes (4,096 and 16,384 rows, 8B shape), launch settings swept, against torch.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 300 python3 scripts/bench_prefill_epilogues.py --rows 4096,16384 --out $R > $R/epi.log 2>&1
echo "rc=$? t=${SECONDS}s"; tail -30 $R/epi.log
cd $OUT && tar czf results.tgz r && rm -rf r
