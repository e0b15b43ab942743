#!/bin/bash
# Session 10, call 13 (one H100, carrying .whl): the expand at 2 warps for rank blocks >= 64 (now the default,
# "d"; 4x4x4x4 forces 4 warps, 4x4x4x2 forces 2): rank block 32 (1B, ranks 32), rank block 64 at the 8B
# shape, block_m 32 at 1B; then the GPU tests of the kernels, the pieces and the warm-up, and the mixed step.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 60 python3 scripts/bench_lora_segments.py --shape 1b --ranks 32 --variants d,4x4x4x4,4x4x4x2 --out $R/r32 > $R/r32.log 2>&1; echo "r32 rc=$? t=${SECONDS}s"
timeout 60 python3 scripts/bench_lora_segments.py --shape 8b --prompts 8 --prompt-len 512 --decode 56 --adapters 64 --ranks 64 \
  --variants d,4x4x4x4,4x4x4x2 --out $R/r64_8b > $R/r64_8b.log 2>&1; echo "r64_8b rc=$? t=${SECONDS}s"
timeout 60 python3 scripts/bench_lora_segments.py --shape 1b --block-m 32 --variants d,4x4x4x4 --out $R/bm32 > $R/bm32.log 2>&1; echo "bm32 rc=$? t=${SECONDS}s"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lora_segments.py tests/serving/test_pad_mixed.py \
  tests/serving/test_warm_up.py > $R/pytest.log 2>&1; echo "pytest rc=$? t=${SECONDS}s"; tail -1 $R/pytest.log
timeout 80 python3 scripts/profile_prefill_step.py --shape 1b --prompts 1,4,12,21 --prompt-len 320 --repeats 8 \
  --warm-up --out $R/mixed > $R/mixed.log 2>&1; echo "mixed rc=$? t=${SECONDS}s"
tail -6 $R/r32.log; tail -6 $R/r64_8b.log; tail -6 $R/bm32.log; grep -A5 "^1b," $R/mixed.log | cut -c1-80
cd $OUT && tar czf results.tgz r && rm -rf r
