#!/bin/bash
# session 11 device call 13 (issue 12), H100: where decode rows of many distinct adapters meet a
# prefill: one mixed step with 60 decoding rows over 64 adapters (old / new / old / new), then the
# 1B trace with 1,024 adapters at 128 requests/s (old, new, new, old).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
for i in 1 2; do for v in old new; do
  P=$PWD:/tmp/site; [ $v = old ] && P=$PWD/.ab_old:$PWD:/tmp/site
  PYTHONPATH=$P timeout 80 python3 scripts/profile_prefill_step.py --shape 1b --adapters 64 --prompts 1,4,12 --prompt-len 320 \
    --repeats 8 --warm-up --mixed-graphs on --out $R/mixed64_${v}_$i > $R/mixed64_${v}_$i.log 2>&1; echo "mixed64 $v $i rc=$? t=${SECONDS}s"
done; done
for v in old new new old; do
  P=$PWD:/tmp/site; [ $v = old ] && P=$PWD/.ab_old:$PWD:/tmp/site
  PYTHONPATH=$P timeout 100 python3 scripts/bench_serving.py --shape 1b --num-adapters 1024 --baselines "" --requests 400 \
    --rate 128 --mixed-graphs on --out $R/trace1024_$v > $R/trace1024_$v.log 2>&1; echo "trace1024 $v rc=$? t=${SECONDS}s"
  tail -1 $R/trace1024_$v.log | cut -c1-220
done
for i in 1 2; do for v in old new; do echo "== mixed64 $v $i"; grep -A4 "^1b," $R/mixed64_${v}_$i.log | tail -3 | cut -c1-100; done; done
cd $OUT && tar czf results.tgz r && rm -rf r
