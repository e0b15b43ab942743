#!/bin/bash
# Session 9, call 3: every step's wall time and a cProfile of one mixed step (issue 13), 1B shape, H100.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 250 python3 scripts/profile_prefill_step.py --shape 1b --prompts 1,4,12,1 --prompt-len 320 --repeats 8 --cprofile 1 --out $R/a > $R/a.log 2>&1; echo "a rc=$? t=${SECONDS}s"
timeout 200 python3 scripts/profile_prefill_step.py --shape 1b --prompts 12 --prompt-len 320 --repeats 4 --cprofile 12 --out $R/b > $R/b.log 2>&1; echo "b rc=$? t=${SECONDS}s"
grep -A9 "^1b," $R/a.log; grep -A4 "^1b," $R/b.log
cd $OUT && tar czf results.tgz r && rm -rf r
