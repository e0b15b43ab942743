#!/bin/bash
# Session 10, call 10 (one H100, carrying .whl): issue 12's 2,048 adapters against 1 at saturation, 8B shape:
# Poisson arrivals at 128 requests/s (240 requests arrive in ~2 s, so every point queues), points 64 then 2,048 (is the gap of call 9 paging or many adapters and ranks in a batch?); call 9 ran
# 1, 2,048, 1 (call 7 ran 1 first, call 8 2,048 first; both at 32 requests/s, where 1 adapter did not queue).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 400 python3 scripts/bench_serving.py --shape 8b --num-adapters 64,2048 --rate 128 --requests 240 \
    --baselines "" --deadline 390 --point-max-s 140 --out $R > $R/serving.log 2>&1; echo "rc=$? t=${SECONDS}s"
grep -c "not finite" $R/serving.log; tail -5 $R/serving.log | cut -c1-250
cd $OUT && tar czf results.tgz r && rm -rf r
