#!/bin/bash
# session 11 device call 7 (issue 16), H100: GPU tests of the fused FP8 SwiGLU; its launch sweep
# at 8192 rows; 8B bf16 vs FP8 (fused SwiGLU on / off), graphs, capacity 8192; then capacity
# 12288 (bf16 at 16384 does not fit 80 GB), one process each.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
END=$((SECONDS + 590))
left() { local l=$((END - SECONDS)); [ $l -lt $1 ] && echo $l || echo $1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout $(left 100) python3 -m pytest -q -x tests/kernels/test_fp8_swiglu.py tests/model/test_fusion.py > $R/tests.log 2>&1
tail -2 $R/tests.log | cut -c1-300; echo "t=${SECONDS}s"
timeout $(left 60) python3 scripts/bench_fp8_swiglu.py --rows 8192 --configs auto,8/2048,16/2048,32/4096,32/8192 --out $R/sw > $R/sw.log 2>&1
tail -7 $R/sw.log | cut -c1-300; echo "t=${SECONDS}s"
timeout $(left 200) python3 scripts/bench_e2e.py --shape llama8b --layers 32 --samples 64 --hf-batch 2 --capacity 8192 --variants triton_graphs --base-precision bf16,fp8 --fp8-fast-accum both --fp8-fused-swiglu on,off --out $R/c8k > $R/c8k.log 2>&1
grep -v "^\[\|Warning\|warn" $R/c8k.log | tail -7 | cut -c1-300; echo "t=${SECONDS}s"
timeout $(left 220) python3 scripts/bench_e2e.py --shape llama8b --layers 32 --samples 64 --hf-batch 2 --capacity 12288 --variants triton_graphs --base-precision bf16,fp8 --fp8-fast-accum both --out $R/c12k > $R/c12k.log 2>&1
grep -v "^\[\|Warning\|warn" $R/c12k.log | tail -6 | cut -c1-300; echo "t=${SECONDS}s"
cd $OUT && tar czf results.tgz r && rm -rf r
