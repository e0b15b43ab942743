#!/bin/bash
# For branch session9-pad-mixed (NOT RUN: written after session 9's device time was spent). One H100 call,
# ~6 minutes, carrying .whl: (1) the padded / piecewise mixed steps on CUDA (tests, the GPU one captures
# every piece as a CUDA graph); (2) the mixed step's time with the pieces eager and captured, against one
# eager forward, same call (every step's wall time shows the first use of a bucket: its capture).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 120 python3 -m pytest -q -p no:cacheprovider tests/serving/test_pad_mixed.py tests/serving/test_generation.py \
  tests/kernels/test_lora_segments.py > $R/pytest.log 2>&1; echo "pytest rc=$? t=${SECONDS}s"; tail -2 $R/pytest.log
for m in off eager on; do
  timeout 100 python3 scripts/profile_prefill_step.py --shape 1b --prompts 1,4,12,21 --prompt-len 320 --repeats 8 \
    --warm-up --mixed-graphs $m --out $R/mixed_$m > $R/mixed_$m.log 2>&1; echo "mixed $m rc=$? t=${SECONDS}s"
done
for m in off eager on; do echo "== mixed_graphs $m"; grep -A5 "^1b," $R/mixed_$m.log; grep "every step" $R/mixed_$m.log; done
cd $OUT && tar czf results.tgz r && rm -rf r
