#!/bin/bash
# session 11 device call 15 (issue 16), H100: kernel-time tables of 4 microbatches, bf16 vs FP8
# (fast accumulation, fused SwiGLU), eager, capacity 8192: what only FP8 still pays.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 300 python3 scripts/bench_e2e.py --shape llama8b --layers 32 --samples 32 --hf-batch 2 --capacity 8192 --variants triton --base-precision bf16,fp8 --fp8-fast-accum both --profile --out $R/prof > $R/prof.log 2>&1
tail -3 $R/prof.log | cut -c1-200
for f in $R/prof/profile_*.txt; do echo "== $f"; grep -E "_scaled_mm |_quantize_rows|_transpose|_swiglu_quant|aten::mm |fused_mul_silu|Self CUDA time" $f | cut -c1-70,150-200; done
cd $OUT && tar czf results.tgz r && rm -rf r
