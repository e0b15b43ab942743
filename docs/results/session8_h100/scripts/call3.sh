#!/bin/bash
# session 8 device call 3 (issue 13): call 2's server parts again (call 2's bench_server was cut by its timeout while shutting down; its host profile lacked PYTHONPATH in the child)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
for cfg in "asyncio h11" "uvloop httptools"; do set -- $cfg
  timeout 45 python3 scripts/profile_server_host.py --concurrency 64 --step-ms 10 --seconds 10 --uvicorn-loop $1 --uvicorn-http $2 --out $R/host_$1 > $R/host_$1.log 2>&1; echo "host $1 rc=$? t=${SECONDS}s"; tail -4 $R/host_$1.log | cut -c1-200
done
timeout 260 python3 scripts/bench_server.py --shape 1b --requests 768 --rounds 3 --engine-process --out $R/srv > $R/srv.log 2>&1; echo "srv rc=$? t=${SECONDS}s"
grep -A4 "^engine view" $R/srv.log; grep -E "overhead" $R/srv.log | cut -c1-200
cd $OUT && tar czf results.tgz r && rm -rf r
