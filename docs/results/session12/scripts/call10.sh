#!/bin/bash
# session 12 device call 10 (issue 12), H100: where the 1B decode step's LoRA time goes when
# rows share adapters (256 rows over 16 adapters of ranks 8-64): the step's kernel profile
# (eager, with adapters and base), and one layer's segment LoRA with the 256 decode rows grouped
# by adapter (one tile per adapter) against 1-row tiles (bench_lora_segments "grouped"/"decode").
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 150 python3 scripts/bench_generation.py --shape 1b --adapters 16 --ranks 8,16,32,64 --requests 256 \
  --prompt-min 128 --prompt-max 1024 --new-tokens 128 --skip-hf --graphs on --step-batch 256 --step-count 16 \
  --profile-steps 2 --out $R/p1b > $R/p1b.log 2>&1
echo "p1b rc=$? t=${SECONDS}s"; grep -E "^(ours|step)|^profile|kernels per step" $R/p1b.log | cut -c1-120
grep -A18 "^profile_adapters" $R/p1b.log | cut -c1-110
timeout 100 python3 scripts/bench_lora_segments.py --shape 1b --prompts 1 --prompt-len 1 --decode 256 --adapters 16 \
  --variants d --out $R/seg > $R/seg.log 2>&1
echo "seg rc=$? t=${SECONDS}s"; tail -7 $R/seg.log
cd $OUT && tar czf results.tgz r && rm -rf r
