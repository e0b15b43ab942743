#!/bin/bash
# session 11 device call 6 (issue 16): the fused FP8 SwiGLU at its new default launch (16 warps,
# 4096 columns a step; call 5's winner): more launches around it, then 8B bf16 vs FP8 with the
# fused SwiGLU on / off, graphs, capacity 8192 and 16384, one process each.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
END=$((SECONDS + 590))
left() { local l=$((END - SECONDS)); [ $l -lt $1 ] && echo $l || echo $1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout $(left 120) python3 scripts/bench_fp8_swiglu.py --rows 8192 --configs auto,4/4096,8/4096,8/8192,16/8192,32/8192 --out $R/sw > $R/sw.log 2>&1
tail -8 $R/sw.log | cut -c1-300; echo "t=${SECONDS}s"
timeout $(left 200) python3 scripts/bench_e2e.py --shape llama8b --layers 32 --samples 64 --hf-batch 2 --capacity 8192 --variants triton_graphs --base-precision bf16,fp8 --fp8-fast-accum both --fp8-fused-swiglu on,off --out $R/c8k > $R/c8k.log 2>&1
grep -v "^\[\|Warning\|warn" $R/c8k.log | tail -7 | cut -c1-300; echo "t=${SECONDS}s"
timeout $(left 240) python3 scripts/bench_e2e.py --shape llama8b --layers 32 --samples 64 --hf-batch 2 --capacity 16384 --variants triton_graphs --base-precision bf16,fp8 --fp8-fast-accum both --fp8-fused-swiglu on,off --out $R/c16k > $R/c16k.log 2>&1
grep -v "^\[\|Warning\|warn" $R/c16k.log | tail -7 | cut -c1-300; echo "t=${SECONDS}s"
cd $OUT && tar czf results.tgz r && rm -rf r
