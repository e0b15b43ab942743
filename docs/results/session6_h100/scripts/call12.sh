#!/bin/bash
# session 6 device call 12 (issue 16): weight-only FP8 decode product: GPU tests, kernel bench, engine bf16 vs fp8
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader; date -u
timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_fp8_linear.py 2>&1 | tail -2 | tee $R/tests.log
timeout 90 python3 scripts/bench_fp8_decode.py --out $R > $R/kernel.log 2>&1; tail -14 $R/kernel.log
timeout 200 python3 scripts/bench_generation.py --shape 8b --adapters 64 --ranks 16 --requests 64 --prompt-min 256 --prompt-max 256 --new-tokens 64 --skip-hf --max-num-seqs 64 --graphs on --step-batch 64 --step-count 24 --base-precision bf16,fp8 --out $R > $R/engine.log 2>&1; echo rc=$?
grep -E "^bf16|^fp8|engine_agreement|Traceback|Error" $R/engine.log | cut -c1-250 | tail -14
cd $OUT && tar czf results.tgz r && rm -rf r
