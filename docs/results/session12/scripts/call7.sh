#!/bin/bash
# session 12 device call 7 (issue 12), H100: steps with prefill rows left running under the
# overlapped decode (the decode step after them planned ahead). GPU tests, then the 1B Poisson
# trace at 128 requests/s: prev (.ab_old = the commit before, its own scripts/) and new in the
# order prev, new, new, prev; then the 8B setting (new).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
PYTHONPATH=$PWD:/tmp/site timeout 200 python3 -m pytest -q tests/serving/test_overlapped_decode.py tests/serving/test_generation.py \
  tests/serving/test_chunked_prefill.py tests/serving/test_engine_stream.py tests/serving/test_prefix_cache.py -p no:cacheprovider > $R/tests.log 2>&1
echo "tests rc=$? t=${SECONDS}s"; tail -2 $R/tests.log
i=0
for v in prev new new prev; do
  i=$((i+1)); S=scripts; [ $v = prev ] && S=.ab_old/scripts
  timeout 100 python3 $S/bench_serving.py --shape 1b --num-adapters 16 --baselines "" --requests 400 --rate 128 \
    --out $R/trace16_${v}_$i > $R/trace16_${v}_$i.log 2>&1
  echo "trace 16 $v ($i) rc=$? t=${SECONDS}s"; tail -1 $R/trace16_${v}_$i.log | cut -c1-200
done
timeout 150 python3 scripts/bench_generation.py --shape 8b --adapters 64 --ranks 16 --requests 64 --prompt-min 256 \
  --prompt-max 256 --new-tokens 64 --skip-hf --max-num-seqs 64 --graphs on --out $R/g8b > $R/g8b.log 2>&1
echo "8b rc=$? t=${SECONDS}s"; grep -E "^ours" $R/g8b.log
cd $OUT && tar czf results.tgz r && rm -rf r
