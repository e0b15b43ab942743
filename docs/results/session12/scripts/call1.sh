#!/bin/bash
# session 12 device call 1 (issue 12), H100: the overlapped decode (EngineConfig.async_decode).
# GPU tests of the changed paths, then decode steps and end to end with it off and on in one
# process: 8B shape at issue 12's setting (off, on), 1B shape at 256 rows (on, off).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 240 python3 -m pytest -q -x tests/serving/test_overlapped_decode.py tests/serving/test_decode_graphs.py \
  tests/serving/test_step_host_path.py tests/serving/test_pad_mixed.py -p no:cacheprovider > $R/tests.log 2>&1
echo "tests rc=$? t=${SECONDS}s"; tail -3 $R/tests.log
timeout 330 python3 scripts/bench_generation.py --shape 8b --adapters 64 --ranks 16 --requests 64 --prompt-min 256 \
  --prompt-max 256 --new-tokens 64 --skip-hf --max-num-seqs 64 --graphs on --step-batch 64 --step-count 24 \
  --async-decode off,on --out $R/g8b > $R/g8b.log 2>&1
echo "8b rc=$? t=${SECONDS}s"; grep -E "^(async|ours)|errors" $R/g8b.log | cut -c1-150
timeout 200 python3 scripts/bench_generation.py --shape 1b --adapters 16 --ranks 8,16,32,64 --requests 256 \
  --prompt-min 128 --prompt-max 1024 --new-tokens 128 --skip-hf --graphs on --step-batch 256 --step-count 16 \
  --async-decode on,off --out $R/g1b > $R/g1b.log 2>&1
echo "1b rc=$? t=${SECONDS}s"; grep -E "^(async|ours)|errors" $R/g1b.log | cut -c1-150
cd $OUT && tar czf results.tgz r && rm -rf r
