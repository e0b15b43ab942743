#!/bin/bash
# session 12 device call 6 (issue 12), H100: the 1B Poisson trace at 128 requests/s (saturating),
# the session's engine (new) against its start (old: commit f97d613, .ab_old/scripts run from
# there), 16 adapters (old, new, new, old) and 1,024 adapters (new, old).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
i=0
for spec in old:16 new:16 new:16 old:16 new:1024 old:1024; do
  v=${spec%%:*}; n=${spec##*:}; i=$((i+1)); S=scripts; [ $v = old ] && S=.ab_old/scripts
  timeout 110 python3 $S/bench_serving.py --shape 1b --num-adapters $n --baselines "" --requests 400 --rate 128 \
    --out $R/trace${n}_${v}_$i > $R/trace${n}_${v}_$i.log 2>&1
  echo "trace $n $v ($i) rc=$? t=${SECONDS}s"; tail -1 $R/trace${n}_${v}_$i.log | cut -c1-200
done
cd $OUT && tar czf results.tgz r && rm -rf r
