#!/bin/bash
# session 6 device call 9: GPU tests after the default flips (graphs incl. FP8 base, paged prefill default, fp8, fused lora)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 400 python3 -m pytest -q -p no:cacheprovider -p no:logging -rs tests/training/test_cuda_graphs.py tests/training/test_fp8_base.py tests/serving/test_prefill_attention.py tests/serving/test_decode_graphs.py tests/kernels/test_dropout_triton.py -s 2>&1 | grep -E "graphs vs eager|update gap|fit on vs off|passed|failed|FAILED|Error|SKIP" | tee $R/tests.log | tail -25
cd $OUT && tar czf results.tgz r && rm -rf r
