#!/bin/bash
# Session 10, call 3 (one H100, carrying .whl and .ab_old = lightning_lorafusion of ad50953): (1) GPU tests of
# the fixed pieces (q/k/v through fixed buffers), decode rows grouped by adapter, expand over column blocks;
# (2) the new wide-model capture test against the old pieces (expected to fail there: the bug of call 2);
# (3) lora_segments column blocks per expand program; (4) mixed step off / on; (5) the 1B trace off / on.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
PYTHONPATH=$PWD:/tmp/site timeout 150 python3 -m pytest -q -p no:cacheprovider tests/serving/test_pad_mixed.py \
  tests/kernels/test_lora_segments.py tests/serving/test_generation.py > $R/pytest.log 2>&1; echo "pytest rc=$? t=${SECONDS}s"; tail -2 $R/pytest.log
PYTHONPATH=$PWD/.ab_old:$PWD:/tmp/site timeout 90 python3 -m pytest -q -p no:cacheprovider tests/serving/test_pad_mixed.py -k wide \
  > $R/pytest_old.log 2>&1; echo "old pieces, wide test rc=$? t=${SECONDS}s"; grep -E "passed|failed" $R/pytest_old.log | tail -1
export PYTHONPATH=$PWD:/tmp/site
timeout 120 python3 scripts/bench_lora_segments.py --shape 1b --out $R/seg > $R/seg.log 2>&1; echo "seg rc=$? t=${SECONDS}s"
for m in off on; do
  timeout 100 python3 scripts/profile_prefill_step.py --shape 1b --prompts 1,4,12,21 --prompt-len 320 --repeats 8 \
    --warm-up --mixed-graphs $m --out $R/mixed_$m > $R/mixed_$m.log 2>&1; echo "mixed $m rc=$? t=${SECONDS}s"
done
for m in off on; do
  timeout 150 python3 scripts/bench_serving.py --shape 1b --num-adapters 16 --baselines "" --requests 400 \
    --mixed-graphs $m --out $R/trace_$m > $R/trace_$m.log 2>&1; echo "trace $m rc=$? t=${SECONDS}s"
done
cat $R/seg.log | tail -6
for m in off on; do echo "== mixed_graphs $m"; grep -A5 "^1b," $R/mixed_$m.log | cut -c1-80; done
for m in off on; do echo "== trace $m"; grep -c "not finite" $R/trace_$m.log; tail -2 $R/trace_$m.log | cut -c1-200; done
cd $OUT && tar czf results.tgz r && rm -rf r
