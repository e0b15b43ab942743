#!/bin/bash
# session 6 device call 13: weight-only FP8 tile sweep at decode rows (L2-fair: 4 weight copies per timing)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
timeout 200 python3 scripts/bench_fp8_decode.py --rows 64,16 --configs 16/64/1/4,16/64/2/4,16/64/4/4,16/128/1/4,16/128/2/4,16/128/4/4,32/64/1/4,32/64/2/4,32/64/4/4,32/128/1/4,32/128/2/4,32/128/4/4,64/64/1/4,64/64/2/4,64/64/4/4,64/128/1/4,64/128/2/4,64/128/4/4 --out $OUT > $OUT/sweep.log 2>&1; echo rc=$?
tail -11 $OUT/sweep.log
