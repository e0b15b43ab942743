#!/bin/bash
# Session 9, call 6: lora_segments in bf16 on CUDA (tests), then issue 13's overhead on bench_serving's
# length distributions again, six rounds (a second, independent run of call 5's second half).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lora_segments.py > $R/pytest.log 2>&1; echo "pytest rc=$? t=${SECONDS}s"; tail -2 $R/pytest.log
timeout 420 python3 scripts/bench_server.py --shape 1b --requests 320 --prompt-min 8 --prompt-max 512 --new-tokens 8 --new-tokens-max 512 --rounds 6 --seed 11 --engine-process --out $R/srv > $R/srv.log 2>&1; echo "srv rc=$? t=${SECONDS}s"
grep "round" $R/srv.log | cut -c1-120; grep -A2 "^engine view" $R/srv.log; grep -E "overhead|greedy" $R/srv.log | cut -c1-220
cd $OUT && tar czf results.tgz r && rm -rf r
