#!/bin/bash
# session 11 device call 14 (issue 16), H100: what is live before each eager variant's memory peak,
# by block size (scripts/memory_peak.py, now with the "before" breakdown), bf16 vs FP8, capacity 8192.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 300 python3 scripts/bench_e2e.py --shape llama8b --layers 32 --samples 32 --hf-batch 2 --capacity 8192 --variants triton --base-precision bf16,fp8 --fp8-fast-accum both --memory-peak --out $R/mem > $R/mem.log 2>&1
grep -A40 "memory peak" $R/mem.log | grep -v "^{" | cut -c1-120 | head -70; tail -3 $R/mem.log | cut -c1-200
cd $OUT && tar czf results.tgz r && rm -rf r
