#!/bin/bash
# Session 10, call 8 (one H100, carrying .whl): Engine.warm_up now captures every token bucket's mixed-step
# pieces for the adapters' rank blocks (bench_serving runs it per point): (1) GPU tests; (2) the mixed step
# after warm-up (no capture spikes expected in every step's wall time; warm-up's capture count and time);
# (3) call 7's 8B saturation trace again (1 and 2,048 adapters, 2,048 first this time).
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/serving/test_warm_up.py tests/serving/test_pad_mixed.py \
  tests/kernels/test_lora_segments.py > $R/pytest.log 2>&1; echo "pytest rc=$? t=${SECONDS}s"; tail -1 $R/pytest.log
timeout 100 python3 scripts/profile_prefill_step.py --shape 1b --prompts 1,4,12,21 --prompt-len 320 --repeats 8 \
  --warm-up --out $R/mixed > $R/mixed.log 2>&1; echo "mixed rc=$? t=${SECONDS}s"
timeout 330 python3 scripts/bench_serving.py --shape 8b --num-adapters 2048,1 --rate 32 --requests 240 \
    --baselines "" --deadline 320 --point-max-s 140 --out $R/trace8b > $R/trace8b.log 2>&1; echo "trace8b rc=$? t=${SECONDS}s"
grep "Engine.warm_up" $R/mixed.log; grep -A5 "^1b," $R/mixed.log | cut -c1-80; grep "every step" $R/mixed.log
grep -c "not finite" $R/trace8b.log; tail -3 $R/trace8b.log | cut -c1-250
python3 - $R/trace8b <<'PY'
import glob, json, sys
for f in glob.glob(sys.argv[1] + "/*.json"):
    for p in json.load(open(f)).get("points", []):
        print(p.get("num_adapters", p.get("n")), "warm_up_s", round(p.get("warm_up_s", 0), 1), "keys", p.get("mixed_piece_keys"),
              "peak_gib", round(p.get("peak_gib", 0), 1))
PY
cd $OUT && tar czf results.tgz r && rm -rf r
