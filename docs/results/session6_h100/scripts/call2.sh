#!/bin/bash
# session 6 device call 2 (issue 15): failed GPU tests again after the offset-hash fix, e2e graphs 1B + 8B
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
END=$((SECONDS + 575))
left() { local l=$((END - SECONDS)); [ $l -lt $1 ] && echo $l || echo $1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout $(left 130) python3 scripts/bench_e2e.py --shape llama1b --layers 16 --capacity 8192 --variants hf_frozen,triton,triton_graphs --out $R/e2e1b > $R/e2e1b.log 2>&1
grep -v "^ \|^-\|^#\|^\[\|Warning" $R/e2e1b.log | tail -8 | cut -c1-400; echo "t=${SECONDS}s"
timeout $(left 190) python3 scripts/bench_e2e.py --shape llama8b --layers 32 --samples 32 --hf-batch 2 --capacity 8192 --variants triton,triton_graphs --out $R/e2e8b > $R/e2e8b.log 2>&1
grep -v "^ \|^-\|^#\|^\[\|Warning" $R/e2e8b.log | tail -8 | cut -c1-400; echo "t=${SECONDS}s"
timeout $(left 250) python3 -m pytest -q -p no:cacheprovider -p no:logging tests/training/test_cuda_graphs.py tests/training/test_fp8_base.py::test_fp8_exempt_layers_keep_the_outermost_layers_16_bit "tests/kernels/test_fused_lora.py::test_cached_launches_repeat_calls_and_misaligned_inputs_cuda" --durations=8 > $R/tests.log 2>&1
grep -E "passed|failed|FAILED|Error|^[0-9.]+s " $R/tests.log | tail -16; echo "t=${SECONDS}s"
cd $OUT && tar czf results.tgz r && rm -rf r
