#!/bin/bash
# session 6 device call 5 (issue 15): graphs warm up in their pool (8B OOM fix); GPU graph tests, e2e 8B + 1B
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
END=$((SECONDS + 575))
left() { local l=$((END - SECONDS)); [ $l -lt $1 ] && echo $l || echo $1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
python3 -c "import torch; print('pool api', [hasattr(torch._C, n) for n in ('_cuda_beginAllocateCurrentThreadToPool', '_cuda_endAllocateToPool', '_cuda_releasePool')])"
timeout $(left 150) python3 -m pytest -q -p no:cacheprovider -p no:logging tests/training/test_cuda_graphs.py --durations=5 > $R/tests.log 2>&1
grep -E "passed|failed|FAILED|Error|^[0-9.]+s " $R/tests.log | tail -10; echo "t=${SECONDS}s"
timeout $(left 220) python3 scripts/bench_e2e.py --shape llama8b --layers 32 --samples 32 --hf-batch 2 --capacity 8192 --variants triton_graphs,triton --out $R/e2e8b > $R/e2e8b.log 2>&1
grep -v "^ \|^-\|^#\|^\[\|Warning" $R/e2e8b.log | tail -8 | cut -c1-400; echo "t=${SECONDS}s"
timeout $(left 130) python3 scripts/bench_e2e.py --shape llama1b --layers 16 --capacity 8192 --variants hf_frozen,triton,triton_graphs --out $R/e2e1b > $R/e2e1b.log 2>&1
grep -v "^ \|^-\|^#\|^\[\|Warning" $R/e2e1b.log | tail -8 | cut -c1-400; echo "t=${SECONDS}s"
cd $OUT && tar czf results.tgz r && rm -rf r
