#!/bin/bash
# session 6 device call 4 (issue 13): HTTP server load test with the engine in a child process
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 420 python3 scripts/bench_server.py --shape 1b --requests 768 --rounds 4 --engine-process --out $R/srv > $R/srv.log 2>&1; echo "rc=$?"
tail -30 $R/srv.log | cut -c1-300; echo "t=${SECONDS}s"
sleep 2; nvidia-smi --query-compute-apps=pid,used_memory --format=csv | tee $R/leftover.txt; ps aux | grep -c "[p]ython3" 
cd $OUT && tar czf results.tgz r && rm -rf r
