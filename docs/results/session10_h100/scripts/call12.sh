#!/bin/bash
# Session 10, call 12 (one H100, carrying .whl): lora_segments num_warps of the shrink / expand (variants
# NxSxWsxWe) and the tile height (block_m 16 / 32 / 64) at the 1B and 8B shapes, GPU time from graph replays.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
V=d,4x4x2x4,4x4x8x4,4x4x4x2,4x4x4x8,4x4x8x8,4x4x2x2
timeout 150 python3 scripts/bench_lora_segments.py --shape 1b --variants $V --out $R/w1b > $R/w1b.log 2>&1; echo "w1b rc=$? t=${SECONDS}s"
timeout 100 python3 scripts/bench_lora_segments.py --shape 8b --prompts 8 --prompt-len 512 --decode 56 --adapters 64 --ranks 16 \
  --variants $V --out $R/w8b > $R/w8b.log 2>&1; echo "w8b rc=$? t=${SECONDS}s"
for bm in 16 32; do
  timeout 60 python3 scripts/bench_lora_segments.py --shape 1b --block-m $bm --variants d,4x4x8x4,4x4x4x8 --out $R/bm$bm > $R/bm$bm.log 2>&1; echo "bm$bm rc=$? t=${SECONDS}s"
done
tail -7 $R/w1b.log; tail -6 $R/w8b.log; for bm in 16 32; do tail -6 $R/bm$bm.log; done
cd $OUT && tar czf results.tgz r && rm -rf r
