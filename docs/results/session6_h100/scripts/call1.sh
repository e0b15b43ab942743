#!/bin/bash
# session 6 device call 1 (issues 15+16): GPU tests of graphs/fused/fp8, e2e graphs 1B + 8B, fp8 convergence with fast accumulation
cd "$(git rev-parse --show-toplevel 2>/dev/null || pwd)"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
END=$((SECONDS + 570))
left() { local l=$((END - SECONDS)); [ $l -lt $1 ] && echo $l || echo $1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
python3 -c "import torch,triton,transformers;print(torch.__version__,triton.__version__,transformers.__version__)" | tee -a $R/gpu.txt
timeout $(left 150) python3 -m pytest -q -p no:cacheprovider tests/training/test_cuda_graphs.py tests/kernels/test_fused_lora.py tests/training/test_fp8_base.py tests/kernels/test_fp8_linear.py > $R/tests.log 2>&1
grep -E "passed|failed|FAILED|Error" $R/tests.log | tail -8; echo "t=${SECONDS}s"
timeout $(left 150) python3 scripts/bench_e2e.py --shape llama1b --layers 16 --capacity 8192 --variants hf_frozen,triton,triton_graphs --out $R/e2e1b > $R/e2e1b.log 2>&1
grep -v "^ \|^-\|^#\|^\[\|Warning" $R/e2e1b.log | tail -8; echo "t=${SECONDS}s"
timeout $(left 110) python3 scripts/bench_convergence.py --model llama8b --layers 4 --base-precision fp8 --fp8-fast-accum both --eval-samples 8 --out $R/conv > $R/conv.log 2>&1
tail -9 $R/conv.log; echo "t=${SECONDS}s"
timeout $(left 200) python3 scripts/bench_e2e.py --shape llama8b --layers 32 --samples 32 --hf-batch 2 --capacity 8192 --variants triton,triton_graphs --out $R/e2e8b > $R/e2e8b.log 2>&1
grep -v "^ \|^-\|^#\|^\[\|Warning" $R/e2e8b.log | tail -8; echo "t=${SECONDS}s"
cd $OUT && tar czf results.tgz r && rm -rf r
