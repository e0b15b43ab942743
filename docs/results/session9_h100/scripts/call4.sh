#!/bin/bash
# Session 9, call 4: prefill LoRA by row tiles (lora_segments) on the GPU: tests on CUDA, the mixed
# step's time against the number of prompts, and issue 13's five HTTP rounds (1B shape, H100).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 200 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lora_segments.py tests/serving/test_generation.py \
  tests/serving/test_prefix_cache.py tests/serving/test_chunked_prefill.py tests/serving/test_prefill_attention.py \
  tests/serving/test_decode_graphs.py > $R/pytest.log 2>&1; echo "pytest rc=$? t=${SECONDS}s"; tail -3 $R/pytest.log
timeout 150 python3 scripts/profile_prefill_step.py --shape 1b --prompts 1,4,12,21 --prompt-len 320 --repeats 8 --torch-profile 12 --out $R/p320 > $R/p320.log 2>&1; echo "p320 rc=$? t=${SECONDS}s"
grep -A5 "^1b," $R/p320.log
timeout 280 python3 scripts/bench_server.py --shape 1b --requests 768 --rounds 5 --engine-process --out $R/srv > $R/srv.log 2>&1; echo "srv rc=$? t=${SECONDS}s"
grep "round" $R/srv.log | cut -c1-120; grep -A2 "^engine view" $R/srv.log; grep -E "overhead|greedy" $R/srv.log | cut -c1-220
cd $OUT && tar czf results.tgz r && rm -rf r
