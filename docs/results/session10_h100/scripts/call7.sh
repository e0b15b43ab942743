#!/bin/bash
# Session 10, call 7 (one H100, carrying .whl): issue 12's 2,048-adapter point at saturation, 8B shape, with
# mixed steps as graphs and the shrink in 4 K splits (the defaults now): Poisson arrivals at 32 requests/s
# (session 9's 8 requests/s was a load the engine kept up with), 1 / 64 / 2,048 adapters, no baselines.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 560 python3 scripts/bench_serving.py --shape 8b --num-adapters 1,64,2048 --rate 32 --requests 240 \
    --baselines "" --deadline 540 --point-max-s 140 --out $R > $R/serving.log 2>&1
echo "rc=$? t=${SECONDS}s"; grep -c "not finite" $R/serving.log; tail -6 $R/serving.log | cut -c1-250
cd $OUT && tar czf results.tgz r && rm -rf r
