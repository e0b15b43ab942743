#!/bin/bash
# Session 9, call 5 (carry .whl and .ab_old = `git archive 1a8a9b0 lightning_lorafusion`, the package
# before lora_segments): (1) the mixed step, old prefill LoRA path vs new, same script, same machine,
# alternating; (2) issue 13's HTTP overhead on bench_serving's length distributions (prompts 8-512,
# outputs 8-512 tokens per request) instead of the lockstep fixed-64 outputs.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
for v in old new; do
  if [ $v = old ]; then P=$PWD/.ab_old:$PWD:/tmp/site; else P=$PWD:/tmp/site; fi
  PYTHONPATH=$P timeout 100 python3 scripts/profile_prefill_step.py --shape 1b --prompts 1,4,12,21 --prompt-len 320 --repeats 10 --out $R/ab_$v > $R/ab_$v.log 2>&1; echo "ab $v rc=$? t=${SECONDS}s"
done
for v in old new; do echo "== $v"; grep -A5 "^1b," $R/ab_$v.log; done
export PYTHONPATH=$PWD:/tmp/site
timeout 330 python3 scripts/bench_server.py --shape 1b --requests 320 --prompt-min 8 --prompt-max 512 --new-tokens 8 --new-tokens-max 512 --rounds 4 --engine-process --out $R/srv > $R/srv.log 2>&1; echo "srv rc=$? t=${SECONDS}s"
grep "round" $R/srv.log | cut -c1-120; grep -A2 "^engine view" $R/srv.log; grep -E "overhead|greedy" $R/srv.log | cut -c1-220
cd $OUT && tar czf results.tgz r && rm -rf r
