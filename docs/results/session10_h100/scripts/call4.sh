#!/bin/bash
# Session 10, call 4 (one H100, carrying .whl and .ab_old = lightning_lorafusion of ad50953): (1) the engine's
# GPU tests with mixed_graphs "auto" (now the default: on with CUDA graphs); (2) attribution of call 2's NaN:
# the old code on the 1B trace with the pieces run eagerly (no capture); (3) issue 12's 8B setting with
# mixed-step graphs off and on, same process.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
cd tests/serving && PYTHONPATH=$OLDPWD:/tmp/site timeout 240 python3 -m pytest -q -p no:cacheprovider test_generation.py \
  test_pad_mixed.py test_decode_graphs.py test_chunked_prefill.py test_prefill_attention.py test_prefix_cache.py \
  test_warm_up.py test_nonfinite_logits.py test_fused_weights.py test_step_host_path.py test_prefill_coalescing.py \
  ../kernels/test_lora_segments.py > $R/pytest.log 2>&1; echo "pytest rc=$? t=${SECONDS}s"; tail -3 $R/pytest.log; cd $OLDPWD
PYTHONPATH=$PWD/.ab_old:$PWD:/tmp/site timeout 100 python3 scripts/bench_serving.py --shape 1b --num-adapters 16 --baselines "" \
  --requests 400 --mixed-graphs eager --out $R/old_eager > $R/old_eager.log 2>&1; echo "old eager trace rc=$? t=${SECONDS}s"
export PYTHONPATH=$PWD:/tmp/site
timeout 330 python3 scripts/bench_generation.py --shape 8b --adapters 64 --ranks 16 --requests 64 --prompt-min 256 \
  --prompt-max 256 --new-tokens 64 --skip-hf --max-num-seqs 64 --graphs on --mixed-graphs off,on --step-batch 64 \
  --step-count 24 --prefill-reps 3 --out $R/gen8b > $R/gen8b.log 2>&1; echo "gen8b rc=$? t=${SECONDS}s"
echo "== old code, pieces eager: non-finite aborts"; grep -c "not finite" $R/old_eager.log; tail -1 $R/old_eager.log | cut -c1-200
echo "== 8B"; sed -n "/^run /,\$p" $R/gen8b.log | cut -c1-200
cd $OUT && tar czf results.tgz r && rm -rf r
