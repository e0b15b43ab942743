#!/bin/bash
# The experiment's code was removed after this call (rejected: no gain); commit 7b7bf08 holds it.
# session 12 device call 11 (issue 12): an experiment, the decode rows' q/k/v and gate/up LoRA
# shrinks on a side stream beside the frozen GEMMs (LORAFUSION_DECODE_SHRINK_STREAM=1, captured in
# the decode graphs). GPU test (same bits), then the 8B setting off, on, on, off and 1B on, off.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 100 python3 -m pytest -q tests/serving/test_overlapped_decode.py -k "gpu or side_stream" -p no:cacheprovider > $R/tests.log 2>&1
echo "tests rc=$? t=${SECONDS}s"; tail -2 $R/tests.log
A8="--shape 8b --adapters 64 --ranks 16 --requests 64 --prompt-min 256 --prompt-max 256 --new-tokens 64 --skip-hf --max-num-seqs 64 --graphs on --step-batch 64 --step-count 24"
A1="--shape 1b --adapters 16 --ranks 8,16,32,64 --requests 256 --prompt-min 128 --prompt-max 1024 --new-tokens 128 --skip-hf --graphs on --step-batch 256 --step-count 16"
i=0
for spec in 8:0 8:1 8:1 8:0 1:1 1:0; do
  s=${spec%%:*}; v=${spec##*:}; i=$((i+1)); A=$A8; [ $s = 1 ] && A=$A1
  LORAFUSION_DECODE_SHRINK_STREAM=$v timeout 120 python3 scripts/bench_generation.py $A --out $R/g${s}b_${v}_$i > $R/g${s}b_${v}_$i.log 2>&1
  echo "${s}b aside=$v ($i) rc=$? t=${SECONDS}s"; grep -E "^(ours_all_again|step)" $R/g${s}b_${v}_$i.log | cut -c1-100
done
cd $OUT && tar czf results.tgz r && rm -rf r
