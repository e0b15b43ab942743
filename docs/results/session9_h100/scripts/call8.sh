#!/bin/bash
# Session 9, call 8 (NOT RUN: no device time left; run it on branch session9-lora-segments-v2, carrying
# .whl and .ab_old = `git archive 1a8a9b0 lightning_lorafusion`): lora_segments'
# second version on CUDA (kernel tests, the engine against HF + PEFT), then the mixed step before this
# session vs now, same call.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
PYTHONPATH=$PWD:/tmp/site timeout 90 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lora_segments.py tests/serving/test_generation.py > $R/pytest.log 2>&1; echo "pytest rc=$? t=${SECONDS}s"; tail -2 $R/pytest.log
for v in old new; do
  if [ $v = old ]; then P=$PWD/.ab_old:$PWD:/tmp/site; else P=$PWD:/tmp/site; fi
  PYTHONPATH=$P timeout 80 python3 scripts/profile_prefill_step.py --shape 1b --prompts 1,12,21 --prompt-len 320 --repeats 8 --out $R/ab_$v > $R/ab_$v.log 2>&1; echo "ab $v rc=$? t=${SECONDS}s"
done
for v in old new; do echo "== $v"; grep -A4 "^1b," $R/ab_$v.log; done
cd $OUT && tar czf results.tgz r && rm -rf r
