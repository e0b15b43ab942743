#!/bin/bash
# session 11 device call 10 (issue 12), H100: the decode epilogues (shrink + RoPE / SwiGLU) at 2
# warps: GPU tests, then decode steps, before (.ab_old = the tree before, 4 warps) and after.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
PYTHONPATH=$PWD:/tmp/site timeout 120 python3 -m pytest -q -x tests/kernels/test_lora_epilogues.py > $R/tests.log 2>&1; tail -1 $R/tests.log
B8="--shape 8b --adapters 64 --ranks 16 --requests 64 --prompt-min 256 --prompt-max 256 --new-tokens 64 --skip-hf --max-num-seqs 64 --graphs on --step-batch 64 --step-count 24"
B1="--shape 1b --adapters 16 --ranks 8,16,32,64 --requests 256 --prompt-min 128 --prompt-max 1024 --new-tokens 128 --skip-hf --graphs on --step-batch 256 --step-count 16"
for shape in 1 8; do for v in old new; do
  P=$PWD:/tmp/site; [ $v = old ] && P=$PWD/.ab_old:$PWD:/tmp/site
  eval "args=\$B$shape"
  PYTHONPATH=$P timeout 200 python3 scripts/bench_generation.py $args --out $R/${v}_$shape > $R/${v}_$shape.log 2>&1
  echo "== $v ${shape}b"; grep -E "step_adapters|step_base|ours_all_again " $R/${v}_$shape.log | cut -c1-200 | tail -3
done; done
echo "t=${SECONDS}s"
cd $OUT && tar czf results.tgz r && rm -rf r
