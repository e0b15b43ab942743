#!/bin/bash
# session 11 device call 9 (issue 12), H100: the decode LoRA shrink's launch, swept wider (K blocks
# of 1024 / 2048, 2 and 8 warps) in the fused epilogues at 8B shapes.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 400 python3 scripts/bench_decode_kernels.py --sections epilogues --out $R > $R/epi.log 2>&1
grep -E "configs|FAIL|\|" $R/epi.log | cut -c1-300 | tail -30; echo "t=${SECONDS}s"
cd $OUT && tar czf results.tgz r && rm -rf r
