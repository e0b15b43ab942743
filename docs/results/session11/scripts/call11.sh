#!/bin/bash
# session 11 device call 11 (issue 12), H100: padded mixed steps with the decode rows first and
# their LoRA gathered per row from the persistent decode tables (before: decode rows as 1-row
# lora_segments tiles). .ab_old = lightning_lorafusion before the change. (1) GPU tests; (2) one
# mixed step, 60 decode rows + k prompts of 320 tokens, old / new; (3) the 1B Poisson trace old / new.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
PYTHONPATH=$PWD:/tmp/site timeout 170 python3 -m pytest -q -p no:cacheprovider tests/serving/test_pad_mixed.py \
  tests/kernels/test_lora_gather.py tests/kernels/test_lora_epilogues.py tests/serving/test_generation.py > $R/pytest.log 2>&1
echo "pytest rc=$? t=${SECONDS}s"; tail -3 $R/pytest.log | cut -c1-300
for v in old new; do
  P=$PWD:/tmp/site; [ $v = old ] && P=$PWD/.ab_old:$PWD:/tmp/site
  PYTHONPATH=$P timeout 90 python3 scripts/profile_prefill_step.py --shape 1b --prompts 1,4,12,21 --prompt-len 320 --repeats 8 \
    --warm-up --mixed-graphs on --out $R/mixed_$v > $R/mixed_$v.log 2>&1; echo "mixed $v rc=$? t=${SECONDS}s"
done
for v in old new; do
  P=$PWD:/tmp/site; [ $v = old ] && P=$PWD/.ab_old:$PWD:/tmp/site
  PYTHONPATH=$P timeout 110 python3 scripts/bench_serving.py --shape 1b --num-adapters 16 --baselines "" --requests 400 \
    --mixed-graphs on --out $R/trace_$v > $R/trace_$v.log 2>&1; echo "trace $v rc=$? t=${SECONDS}s"
done
for v in old new; do echo "== mixed $v"; grep -A5 "^1b," $R/mixed_$v.log | cut -c1-100; done
for v in old new; do echo "== trace $v"; grep -c "not finite" $R/trace_$v.log; tail -2 $R/trace_$v.log | cut -c1-220; done
cd $OUT && tar czf results.tgz r && rm -rf r
