#!/bin/bash
# session 12 device call 5 (issue 12), H100: GPU tests of the engine (overlapped decode on by
# default on CUDA), then the session's engine against the session's start (commit f97d613, in
# .ab_old with its own scripts/, run from there so its package is the one imported), one process
# per run: the 8B setting (old, new) and the 1B shape (new, old).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
PYTHONPATH=$PWD:/tmp/site timeout 270 python3 -m pytest -q tests/serving/test_overlapped_decode.py tests/serving/test_generation.py \
  tests/serving/test_engine_stream.py tests/serving/test_decode_graphs.py tests/serving/test_chunked_prefill.py \
  tests/serving/test_penalties.py tests/serving/test_nonfinite_logits.py -p no:cacheprovider > $R/tests.log 2>&1
echo "tests rc=$? t=${SECONDS}s"; tail -2 $R/tests.log
A8="--shape 8b --adapters 64 --ranks 16 --requests 64 --prompt-min 256 --prompt-max 256 --new-tokens 64 --skip-hf --max-num-seqs 64 --graphs on --step-batch 64 --step-count 24"
A1="--shape 1b --adapters 16 --ranks 8,16,32,64 --requests 256 --prompt-min 128 --prompt-max 1024 --new-tokens 128 --skip-hf --graphs on --step-batch 256 --step-count 16"
run() {  # $1 = old|new, $2 = name, rest = args
  v=$1; n=$2; shift 2; S=scripts; [ $v = old ] && S=.ab_old/scripts
  timeout 150 python3 $S/bench_generation.py "$@" --out $R/${n}_$v > $R/${n}_$v.log 2>&1
  echo "$n $v rc=$? t=${SECONDS}s"; grep -E "^(ours|step)" $R/${n}_$v.log | cut -c1-110
}
run old g8b $A8; run new g8b $A8; run new g1b $A1; run old g1b $A1
cd $OUT && tar czf results.tgz r && rm -rf r
