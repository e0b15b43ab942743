#!/bin/bash
# session 11 device call 8 (issue 16 item 2, the engine), H100: bf16 vs FP8 vs FP8 with weight-only
# decode products (<= 16 rows) in one process, 8B, 16 requests (each its own r=16 adapter), then 1.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
END=$((SECONDS + 590))
left() { local l=$((END - SECONDS)); [ $l -lt $1 ] && echo $l || echo $1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout $(left 330) python3 scripts/bench_generation.py --shape 8b --adapters 16 --ranks 16 --requests 16 --prompt-min 256 --prompt-max 256 --new-tokens 64 --skip-hf --max-num-seqs 16 --graphs on --step-batch 16 --step-count 24 --base-precision bf16,fp8,fp8wo --out $R/r16 > $R/r16.log 2>&1
grep -E "step_adapters|step_base|ours_all_again|ours_all_base" $R/r16.log | cut -c1-260 | tail -12; echo "t=${SECONDS}s"
timeout $(left 240) python3 scripts/bench_generation.py --shape 8b --adapters 1 --ranks 16 --requests 1 --prompt-min 256 --prompt-max 256 --new-tokens 64 --skip-hf --max-num-seqs 1 --graphs on --step-batch 1 --step-count 24 --base-precision bf16,fp8,fp8wo --out $R/r1 > $R/r1.log 2>&1
grep -E "step_adapters|step_base|ours_all_again|ours_all_base" $R/r1.log | cut -c1-260 | tail -12; echo "t=${SECONDS}s"
cd $OUT && tar czf results.tgz r && rm -rf r
