#!/bin/bash
# session 11 device call 5 (issue 16): call 4's sweep again, the unfused backward compiled explicitly (autograd cannot be captured by do_bench_cudagraph)
# second pass recomputed from the inputs). Now the second pass reads back the stored row: GPU
# tests, then the kernel sweep against inductor's SwiGLU + quantize_rows at 8192 / 16384 rows.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
END=$((SECONDS + 590))
left() { local l=$((END - SECONDS)); [ $l -lt $1 ] && echo $l || echo $1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
# (GPU tests passed in call 4: 26 passed, 1 skipped)

timeout $(left 400) python3 scripts/bench_fp8_swiglu.py --rows 8192,16384 --configs auto,4/512,4/1024,8/1024,8/2048,16/1024,16/2048,16/4096,32/2048,32/4096 --out $R/sw > $R/sw.log 2>&1
tail -24 $R/sw.log | cut -c1-300; echo "t=${SECONDS}s"
cd $OUT && tar czf results.tgz r && rm -rf r
