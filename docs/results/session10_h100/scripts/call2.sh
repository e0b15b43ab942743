#!/bin/bash
# Session 10, call 2 (one H100, carrying .whl): where the padded mixed step's GPU time goes (torch.profiler:
# one 12-prompt step unpadded ("off") and padded as pieces run eagerly ("eager": the kernels the graphs
# replay)); then the 1B Poisson trace with mixed-step graphs off and on, one engine each, same call.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
for m in off eager on; do
  timeout 90 python3 scripts/profile_prefill_step.py --shape 1b --prompts 12 --prompt-len 320 --repeats 3 \
    --warm-up --mixed-graphs $m --torch-profile 12 --out $R/prof_$m > $R/prof_$m.log 2>&1; echo "prof $m rc=$? t=${SECONDS}s"
done
for m in off on; do
  timeout 150 python3 scripts/bench_serving.py --shape 1b --num-adapters 16 --baselines "" --requests 400 \
    --mixed-graphs $m --out $R/trace_$m > $R/trace_$m.log 2>&1; echo "trace $m rc=$? t=${SECONDS}s"
done
for m in off eager on; do echo "== prof $m"; grep -A3 "^prompts" $R/prof_$m.log; grep -B2 -A22 "Self CUDA %" $R/prof_$m.log | tail -26 | cut -c1-61,100-200; done
for m in off on; do echo "== trace $m"; tail -6 $R/trace_$m.log | cut -c1-250; done
cd $OUT && tar czf results.tgz r && rm -rf r
