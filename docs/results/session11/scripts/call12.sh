#!/bin/bash
# session 11 device call 12 (issue 12), H100: call 11's 1B trace again in the other order (new,
# then old), then at 128 requests/s (every point queues: what the engine can do), old / new.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
for rv in 40:new 40:old 128:old 128:new; do
  rate=${rv%%:*}; v=${rv##*:}
  P=$PWD:/tmp/site; [ $v = old ] && P=$PWD/.ab_old:$PWD:/tmp/site
  PYTHONPATH=$P timeout 110 python3 scripts/bench_serving.py --shape 1b --num-adapters 16 --baselines "" --requests 400 \
    --rate $rate --mixed-graphs on --out $R/trace_${rate}_$v > $R/trace_${rate}_$v.log 2>&1; echo "trace $rate $v rc=$? t=${SECONDS}s"
done
for rv in 40:new 40:old 128:old 128:new; do rate=${rv%%:*}; v=${rv##*:}; echo "== rate $rate $v"; grep -c "not finite" $R/trace_${rate}_$v.log; tail -1 $R/trace_${rate}_$v.log | cut -c1-220; done
cd $OUT && tar czf results.tgz r && rm -rf r
