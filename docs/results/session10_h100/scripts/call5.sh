#!/bin/bash
# Session 10, call 5 (one H100, carrying .whl and .ab_old = lightning_lorafusion of bd64c72, call 3's code): the
# segment shrink split over K (deterministic partials summed by the expand): (1) kernel tests on CUDA;
# (2) bench_lora_segments variants at the 1B and 8B shapes; (3) the mixed step and (4) the 1B trace, call 3's
# code ("old") against this one ("new"), same call. mixed_graphs on in both (call 3's code knew no "auto").
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
NEW=$PWD:/tmp/site; OLD=$PWD/.ab_old:$PWD:/tmp/site
PYTHONPATH=$NEW timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lora_segments.py tests/serving/test_pad_mixed.py \
  > $R/pytest.log 2>&1; echo "pytest rc=$? t=${SECONDS}s"; tail -1 $R/pytest.log
PYTHONPATH=$NEW timeout 150 python3 scripts/bench_lora_segments.py --shape 1b --out $R/seg1b > $R/seg1b.log 2>&1; echo "seg1b rc=$? t=${SECONDS}s"
PYTHONPATH=$NEW timeout 120 python3 scripts/bench_lora_segments.py --shape 8b --prompts 8 --prompt-len 512 --decode 56 \
  --adapters 64 --ranks 16 --variants d,4x1,4x2,4x4 --out $R/seg8b > $R/seg8b.log 2>&1; echo "seg8b rc=$? t=${SECONDS}s"
for v in old new; do
  P=$NEW; [ $v = old ] && P=$OLD
  PYTHONPATH=$P timeout 100 python3 scripts/profile_prefill_step.py --shape 1b --prompts 1,4,12,21 --prompt-len 320 --repeats 8 --mixed-graphs on \
    --warm-up --out $R/mixed_$v > $R/mixed_$v.log 2>&1; echo "mixed $v rc=$? t=${SECONDS}s"
  PYTHONPATH=$P timeout 120 python3 scripts/bench_serving.py --shape 1b --num-adapters 16 --baselines "" --requests 400 --mixed-graphs on \
    --out $R/trace_$v > $R/trace_$v.log 2>&1; echo "trace $v rc=$? t=${SECONDS}s"
done
tail -7 $R/seg1b.log; tail -5 $R/seg8b.log
for v in old new; do echo "== mixed $v"; grep -A5 "^1b," $R/mixed_$v.log | cut -c1-80; done
for v in old new; do echo "== trace $v"; grep -c "not finite" $R/trace_$v.log; tail -1 $R/trace_$v.log | cut -c1-200; done
cd $OUT && tar czf results.tgz r && rm -rf r
