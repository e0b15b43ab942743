#!/bin/bash
# Owed after session 8 (no device time left): one H100 call, ~8 minutes, from the repo root, carrying .whl
# (run fetch_wheels.sh beside this here first: the wheels named in docs/BENCHMARKS.md, issue 13, session 8).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
# issue 13: the overhead with aiohttp clients and the child's receiver thread, five rounds (close it if the
# pooled figure over rounds 2-5 is <= 10%)
timeout 300 python3 scripts/bench_server.py --shape 1b --requests 768 --rounds 5 --engine-process --out $R/srv > $R/srv.log 2>&1; echo "srv rc=$? t=${SECONDS}s"
grep -A2 "^engine view" $R/srv.log; grep -E "overhead" $R/srv.log | cut -c1-220
# issue 16: FP8 weight-only decode products at 16 rows (weight_only_wins), bf16 vs fp8 engines
timeout 200 python3 scripts/bench_generation.py --shape 8b --adapters 16 --ranks 16 --requests 16 --prompt-min 256 --prompt-max 256 --new-tokens 64 --skip-hf --max-num-seqs 16 --graphs on --step-batch 16 --step-count 24 --base-precision bf16,fp8 --fp8-weight-only-rows 16 --out $R/wo16 > $R/wo16.log 2>&1; echo "wo16 rc=$? t=${SECONDS}s"
grep -E "^bf16|^fp8|Traceback|Error" $R/wo16.log | cut -c1-250 | tail -14
cd $OUT && tar czf results.tgz r && rm -rf r
