#!/bin/bash
# Session 9, call 2: where a mixed prefill + decode step's ~80 ms goes (issue 13), 1B shape, H100.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 280 python3 scripts/profile_prefill_step.py --shape 1b --prompts 0,1,4,12,21 --prompt-len 320 --torch-profile 12 --out $R/p320 > $R/p320.log 2>&1; echo "p320 rc=$? t=${SECONDS}s"
timeout 200 python3 scripts/profile_prefill_step.py --shape 1b --prompts 0,1,4,12,21 --prompt-len 32 --out $R/p32 > $R/p32.log 2>&1; echo "p32 rc=$? t=${SECONDS}s"
grep -A6 "^1b," $R/p320.log; grep -A6 "^1b," $R/p32.log
cd $OUT && tar czf results.tgz r && rm -rf r
