#!/bin/bash
# session 8 device call 4 (issue 13): where HTTP's time to first token goes (engine / server / client), K=0
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
nvidia-smi --query-gpu=name --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
timeout 230 python3 scripts/bench_server.py --shape 1b --requests 768 --rounds 2 --engine-process --out $R/srv > $R/srv.log 2>&1; echo "srv rc=$? t=${SECONDS}s"
grep -A4 "^engine view" $R/srv.log; grep -E "overhead" $R/srv.log | cut -c1-200
cd $OUT && tar czf results.tgz r && rm -rf r
