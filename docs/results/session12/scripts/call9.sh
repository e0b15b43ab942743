#!/bin/bash
# session 12 device call 9 (issue 12), H100: the serving tests not yet run on the GPU this session
# (the overlapped decode is on by default on CUDA): FP8 engine, warm-up, prefill attention, engine
# process, server, OpenAI API, penalties, prefix cache, multi-turn pieces; and the fixed graph test.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 420 python3 -m pytest -q tests/serving/test_decode_graphs.py tests/serving/test_fp8_engine.py tests/serving/test_warm_up.py \
  tests/serving/test_prefill_attention.py tests/serving/test_engine_process.py tests/serving/test_server.py \
  tests/serving/test_openai_api.py tests/serving/test_step_host_path.py tests/serving/test_pool.py -p no:cacheprovider -x > $R/tests.log 2>&1
echo "tests rc=$? t=${SECONDS}s"; tail -4 $R/tests.log
cd $OUT && tar czf results.tgz r && rm -rf r
