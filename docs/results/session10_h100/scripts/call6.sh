#!/bin/bash
# Session 10, call 6 (one H100, carrying .whl): (1) GPU tests of the split shrink and the pieces (call 5's were
# cut by their 90 s timeout); (2) bench_lora_segments timed as CUDA graph replays (call 5 timed eager launches,
# host-bound for small mixes); (3) issue 13's fixed-length closed loop (session 8/9's, 12-18 % HTTP overhead with
# eager mixed steps) with mixed steps as graphs (the default now).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lora_segments.py tests/serving/test_pad_mixed.py \
  tests/serving/test_generation.py > $R/pytest.log 2>&1; echo "pytest rc=$? t=${SECONDS}s"; tail -1 $R/pytest.log
timeout 90 python3 scripts/bench_lora_segments.py --shape 1b --variants d,4x1,4x2,4x4,1x4,8x4 --out $R/seg1b > $R/seg1b.log 2>&1; echo "seg1b rc=$? t=${SECONDS}s"
timeout 60 python3 scripts/bench_lora_segments.py --shape 8b --prompts 8 --prompt-len 512 --decode 56 \
  --adapters 64 --ranks 16 --variants d,4x1,4x2,4x4 --out $R/seg8b > $R/seg8b.log 2>&1; echo "seg8b rc=$? t=${SECONDS}s"
timeout 270 python3 scripts/bench_server.py --shape 1b --requests 768 --rounds 5 --engine-process --out $R/srv > $R/srv.log 2>&1; echo "srv rc=$? t=${SECONDS}s"
tail -7 $R/seg1b.log; tail -5 $R/seg8b.log
grep -A4 "^engine view" $R/srv.log; grep -E "overhead|greedy" $R/srv.log | cut -c1-220
cd $OUT && tar czf results.tgz r && rm -rf r
