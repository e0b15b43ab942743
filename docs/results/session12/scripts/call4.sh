#!/bin/bash
# session 12 device call 4 (issue 12), H100: SwiGLU / RoPE launches split at the gathered rows,
# the per-row RoPE kernel. GPU tests; the kernels at prefill sizes; the 8B setting with its
# prefill profiled and timed, new then old (.ab_old = the commit before) in one call.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
PYTHONPATH=$PWD:/tmp/site timeout 200 python3 -m pytest -q -x tests/kernels/test_lora_epilogues.py tests/serving/test_pad_mixed.py \
  tests/serving/test_overlapped_decode.py -p no:cacheprovider > $R/tests.log 2>&1
echo "tests rc=$? t=${SECONDS}s"; tail -2 $R/tests.log
PYTHONPATH=$PWD:/tmp/site timeout 120 python3 scripts/bench_prefill_epilogues.py --rows 4096,16384 --out $R > $R/epi.log 2>&1
echo "epi rc=$? t=${SECONDS}s"; tail -17 $R/epi.log
for v in new old; do
  P=$PWD:/tmp/site; [ $v = old ] && P=$PWD/.ab_old:$PWD:/tmp/site
  PYTHONPATH=$P timeout 200 python3 scripts/bench_generation.py --shape 8b --adapters 64 --ranks 16 --requests 64 --prompt-min 256 \
    --prompt-max 256 --new-tokens 64 --skip-hf --max-num-seqs 64 --graphs on --step-batch 64 --step-count 24 \
    --profile-steps 2 --prefill-reps 3 --out $R/g8b_$v > $R/g8b_$v.log 2>&1
  echo "8b $v rc=$? t=${SECONDS}s"; grep -E "^(ours|step)|its prefill|errors|_kernel|^prefill" $R/g8b_$v.log | cut -c1-120 | head -40
done
cd $OUT && tar czf results.tgz r && rm -rf r
