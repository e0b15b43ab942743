#!/bin/bash
# decode helper, device call 2: GPU tests, final numbers (new tree, old tree f0427a0, fused epilogues, 1B shape)
cd "$(dirname "$0")"
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
END=$((SECONDS + 405))
left() { local l=$((END - SECONDS)); [ $l -lt $1 ] && echo $l || echo $1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
date -u
timeout $(left 70) python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lora_epilogues.py tests/kernels/test_rms_norm.py tests/kernels/test_lora_gather.py tests/serving/test_fused_weights.py > $OUT/tests.log 2>&1
timeout $(left 50) python3 -m pytest -q -p no:cacheprovider tests/serving/test_decode_graphs.py -k graph_replay >> $OUT/tests.log 2>&1
grep -E "passed|failed|error" $OUT/tests.log | tail -4
ARGS="--shape 8b --adapters 64 --ranks 16 --requests 64 --prompt-min 256 --prompt-max 256 --new-tokens 64 --hf-requests 64 --hf-batch 64 --skip-hf-mixed --max-num-seqs 64 --graphs on --step-batch 64 --step-count 24"
timeout $(left 160) python3 scripts/bench_generation.py $ARGS --profile-steps 3 --fp32-check --out $OUT/new > $OUT/new.log 2>&1
(cd old && PYTHONPATH=$PWD timeout $(left 75) python3 scripts/bench_generation.py $ARGS --skip-hf --out $OUT/old > $OUT/old.log 2>&1)
timeout $(left 50) python3 scripts/bench_decode_kernels.py --sections epilogues --out $OUT/k > /dev/null 2>&1
timeout $(left 90) python3 scripts/bench_generation.py --shape 1b --adapters 16 --ranks 8,16,32,64 --requests 256 --prompt-min 128 --prompt-max 1024 --new-tokens 128 --hf-requests 32 --hf-batch 32 --skip-hf --graphs on --step-batch 256 --step-count 16 --out $OUT/b1 2>&1 | grep -E "^ours|^step|Error|error" | cut -c1-160
echo "=== kernels"; grep -A 12 "## fused epilogues" $OUT/k/bench_decode_kernels.log; grep -E "configs|bf16 checks" $OUT/k/bench_decode_kernels.log
echo "=== old"; grep -E "^ours|^step" $OUT/old.log | cut -c1-160
echo "=== new"; grep -E "^\[bench|^ours|^step|^hf|^profile|^  its|errors" $OUT/new.log | grep -v "profile_adapters: {\|profile_base: {" | cut -c1-220
grep -A 14 "^profile_adapters" $OUT/new.log | cut -c1-120
