#!/bin/bash
# session 8 device call 2: (13) where HTTP's wall time goes, engine view, K=0; (16) FP8 weight-only decode tile sweep; (13) server CPU per token on the GPU host
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 240 python3 scripts/bench_server.py --shape 1b --requests 768 --rounds 3 --engine-process --out $R/srv > $R/srv.log 2>&1; echo "srv rc=$? t=${SECONDS}s"
grep -A4 "^engine view" $R/srv.log; grep -E "overhead" $R/srv.log | cut -c1-200
timeout 200 python3 scripts/bench_fp8_decode.py --rows 64,16 --configs 16/64/1/4,16/64/2/4,16/64/4/4,16/128/1/4,16/128/2/4,16/128/4/4,32/64/1/4,32/64/2/4,32/64/4/4,32/128/1/4,32/128/2/4,32/128/4/4,64/64/1/4,64/64/2/4,64/64/4/4,64/128/1/4,64/128/2/4,64/128/4/4 --out $R/fp8 > $R/fp8.log 2>&1; echo "fp8 rc=$? t=${SECONDS}s"
tail -12 $R/fp8.log | cut -c1-200
for cfg in "asyncio h11" "uvloop httptools"; do set -- $cfg
  timeout 60 python3 scripts/profile_server_host.py --concurrency 64 --step-ms 10 --seconds 10 --uvicorn-loop $1 --uvicorn-http $2 --out $R/host_$1 > $R/host_$1.log 2>&1; echo "host $1 rc=$? t=${SECONDS}s"; tail -3 $R/host_$1.log | cut -c1-200
done
cd $OUT && tar czf results.tgz r && rm -rf r
