#!/bin/bash
# The CPU host-time measurement of docs/BENCHMARKS.md ("Host work per decode step"): the engine
# before (commit 17d3b74, extracted with `git archive 17d3b74 | tar -x -C /tmp/enghost_base`, plus
# this branch's scripts/profile_engine_host.py copied in) and after (this branch), three rounds,
# alternating, on the shared 2-core development host.
for round in 1 2 3; do
  for v in base new; do
    if [ $v = base ]; then dir=/tmp/enghost_base; else dir=/work/wt/enghost; fi
    (cd $dir && echo "== $v round $round $(date -u +%H:%M:%S) $(cat /proc/loadavg)" && PYTHONPATH=$dir /work/main/.venv/bin/python scripts/profile_engine_host.py --rows 64,256 --repeats 3 --out /tmp/il_${v}_${round}.json 2>/dev/null | tail -6)
  done
done
