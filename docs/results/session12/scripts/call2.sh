#!/bin/bash
# session 12 device call 2 (issue 12), H100: the overlapped decode on a saturating 1B Poisson
# trace (128 requests/s, 16 adapters; off, on, on, off), then the 8B step profile of the current
# code (prefill and decode kernel tables, eager, with adapters and base).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
for v in off on on off; do
  timeout 110 python3 scripts/bench_serving.py --shape 1b --num-adapters 16 --baselines "" --requests 400 \
    --rate 128 --async-decode $v --out $R/trace_${v}_$SECONDS > $R/trace_${v}_$SECONDS.log 2>&1; echo "trace $v rc=$? t=${SECONDS}s"
done
for f in $R/trace_*.log; do echo "== $f"; tail -2 $f | cut -c1-250; done
timeout 240 python3 scripts/bench_generation.py --shape 8b --adapters 64 --ranks 16 --requests 64 --prompt-min 256 \
  --prompt-max 256 --new-tokens 64 --skip-hf --max-num-seqs 64 --graphs on --step-batch 64 --step-count 24 \
  --profile-steps 3 --out $R/prof8b > $R/prof8b.log 2>&1
echo "prof8b rc=$? t=${SECONDS}s"; grep -E "^(ours|step)|its prefill|errors" $R/prof8b.log | cut -c1-150
cd $OUT && tar czf results.tgz r && rm -rf r
