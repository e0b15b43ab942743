#!/bin/bash
# session 6 device call 3 (issue 12): host work per step 8B/1B, paged vs varlen prefill, multi-turn prefix reuse, GPU tests
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
END=$((SECONDS + 580))
left() { local l=$((END - SECONDS)); [ $l -lt $1 ] && echo $l || echo $1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout $(left 210) python3 scripts/bench_generation.py --shape 8b --adapters 64 --ranks 16 --requests 64 --prompt-min 256 --prompt-max 256 --new-tokens 64 --skip-hf --max-num-seqs 64 --graphs on --step-batch 64 --step-count 24 --prefill-attention varlen,paged --prefill-reps 5 --out $R/8b > $R/8b.log 2>&1
grep -E "^ours|^step|^prefill|Error|error" $R/8b.log | cut -c1-300; echo "t=${SECONDS}s"
timeout $(left 120) python3 scripts/bench_generation.py --shape 1b --adapters 16 --ranks 8,16,32,64 --requests 256 --prompt-min 128 --prompt-max 1024 --new-tokens 128 --skip-hf --graphs on --step-batch 256 --step-count 16 --out $R/1b > $R/1b.log 2>&1
grep -E "^ours|^step|Error|error" $R/1b.log | cut -c1-300; echo "t=${SECONDS}s"
timeout $(left 100) python3 scripts/bench_multiturn.py --shape 1b --out $R/mt > $R/mt.log 2>&1
tail -12 $R/mt.log | cut -c1-300; echo "t=${SECONDS}s"
timeout $(left 150) python3 -m pytest -q -p no:cacheprovider -p no:logging tests/kernels/test_paged_prefill.py tests/serving/test_prefix_cache.py tests/serving/test_chunked_prefill.py tests/serving/test_decode_graphs.py > $R/tests.log 2>&1
grep -E "passed|failed|FAILED|Error" $R/tests.log | tail -8; echo "t=${SECONDS}s"
cd $OUT && tar czf results.tgz r && rm -rf r
