#!/bin/bash
# Owed after session 9 (no device time left), one H100 call of ~7 minutes from the repo root, carrying .whl
# (docs/results/session8_h100/scripts/fetch_wheels.sh fetches them). (1) Issue 13's trace with the server's
# child engine also streamed without HTTP (--compare-direct-process): the HTTP layer alone, same process
# layout; (2) the mixed step after the do_not_specialize hints and with serve's warm-up in place: every
# step's wall time (the 1-3 s first-time stalls of session 9 calls 3-4 should be gone after the first
# repeat of each prompt count).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 60 python3 -m pytest -q -p no:cacheprovider tests/kernels/test_lora_segments.py > $R/pytest.log 2>&1; echo "pytest rc=$? t=${SECONDS}s"; tail -1 $R/pytest.log
timeout 330 python3 scripts/bench_server.py --shape 1b --requests 320 --prompt-min 8 --prompt-max 512 --new-tokens 8 \
  --new-tokens-max 512 --rounds 4 --engine-process --compare-direct-process --out $R/srv > $R/srv.log 2>&1; echo "srv rc=$? t=${SECONDS}s"
grep -A4 "^engine view" $R/srv.log; grep -E "overhead|greedy" $R/srv.log | cut -c1-220
timeout 100 python3 scripts/profile_prefill_step.py --shape 1b --prompts 1,4,12,21 --prompt-len 320 --repeats 8 --warm-up --out $R/p320 > $R/p320.log 2>&1; echo "p320 rc=$? t=${SECONDS}s"
grep -A5 "^1b," $R/p320.log; grep "every step" $R/p320.log
cd $OUT && tar czf results.tgz r && rm -rf r
