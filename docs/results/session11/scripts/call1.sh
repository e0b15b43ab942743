#!/bin/bash
# session 11 device call 1 (issue 16): 8B FP8 (fast accumulation) vs bf16, eager and graphs, at
# capacity 16384 on an H200 (the H100's 80 GB does not hold bf16 at 16384), with what is live
# at each eager variant's memory peak; then the same at capacity 8192.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
END=$((SECONDS + 585))
left() { local l=$((END - SECONDS)); [ $l -lt $1 ] && echo $l || echo $1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout $(left 360) python3 scripts/bench_e2e.py --shape llama8b --layers 32 --samples 64 --hf-batch 2 --capacity 16384 --variants triton,triton_graphs --base-precision bf16,fp8 --fp8-fast-accum both --memory-peak --out $R/c16k > $R/c16k.log 2>&1
grep -v "^\[\|Warning\|warn" $R/c16k.log | grep -A40 "^{\|memory peak\|NVIDIA" | cut -c1-300 | tail -60; echo "t=${SECONDS}s"
timeout $(left 300) python3 scripts/bench_e2e.py --shape llama8b --layers 32 --samples 64 --hf-batch 2 --capacity 8192 --variants triton_graphs --base-precision bf16,fp8 --fp8-fast-accum both --out $R/c8k > $R/c8k.log 2>&1
grep -v "^\[\|Warning\|warn" $R/c8k.log | tail -8 | cut -c1-300; echo "t=${SECONDS}s"
cd $OUT && tar czf results.tgz r && rm -rf r
