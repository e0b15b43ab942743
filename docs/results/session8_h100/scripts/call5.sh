#!/bin/bash
# session 8 device call 5 (issue 13): bench_server with aiohttp clients (the new default) and with httpx clients (as before)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 175 python3 scripts/bench_server.py --shape 1b --requests 768 --rounds 3 --engine-process --client-lib aiohttp --out $R/aiohttp > $R/aiohttp.log 2>&1; echo "aiohttp rc=$? t=${SECONDS}s"
grep -A2 "^engine view" $R/aiohttp.log; grep -E "overhead|^direct|^http" $R/aiohttp.log | cut -c1-200
timeout 140 python3 scripts/bench_server.py --shape 1b --requests 768 --rounds 2 --engine-process --client-lib httpx --out $R/httpx > $R/httpx.log 2>&1; echo "httpx rc=$? t=${SECONDS}s"
grep -A2 "^engine view" $R/httpx.log; grep -E "overhead" $R/httpx.log | cut -c1-200
cd $OUT && tar czf results.tgz r && rm -rf r
