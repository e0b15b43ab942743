#!/bin/bash
# Session 10, call 11 (one H100, carrying .whl): call 9's saturation trace (8B, 128 requests/s) with the pool at
# 85 % of free memory instead of bench_serving's 60 %: 2,048 adapters of ranks 8-64 need ~21 GB of adapter pages
# for this trace's 134 distinct adapters beside ~16 GB of KV, which a 60 % pool (~38 GB) does not hold at once
# (call 9/10: 36-37 evictions). Points 1 then 2,048.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 300 python3 scripts/bench_serving.py --shape 8b --num-adapters 1,2048 --rate 128 --requests 240 --memory-fraction 0.85 \
    --baselines "" --deadline 290 --point-max-s 140 --out $R > $R/serving.log 2>&1; echo "rc=$? t=${SECONDS}s"
grep -c "not finite" $R/serving.log; tail -4 $R/serving.log | cut -c1-250
cd $OUT && tar czf results.tgz r && rm -rf r
