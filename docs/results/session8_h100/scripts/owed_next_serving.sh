#!/bin/bash
# Owed (issue 12, never run): the serving trace at the 8B shape with 1, 64 and 2,048 adapters, HF + PEFT
# baselines at 64 (one H100 call, ~9 minutes; the rate is a first guess for the 8B shape: the 1B run
# saturated at 40/s; lower it if every point only measures a queue).
R=$OUT/r; mkdir -p $R
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 560 python3 scripts/bench_serving.py --shape 8b --num-adapters 1,64,2048 --rate 8 --requests 240 \
    --baseline-at 64 --deadline 540 --point-max-s 110 --baseline-max-s 45 --out $R > $R/serving.log 2>&1
echo "rc=$? t=${SECONDS}s"; tail -20 $R/serving.log | cut -c1-250
cd $OUT && tar czf results.tgz r && rm -rf r
