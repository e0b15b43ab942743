#!/bin/bash
# session 6 device call 7 (issue 15): HF+PEFT, HF+PEFT+Liger vs ours (eager, graphs) in one process, 8B capacity 8192 and 1B capacity 16384
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl > /dev/null 2>&1
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p $R
END=$((SECONDS + 580))
left() { local l=$((END - SECONDS)); [ $l -lt $1 ] && echo $l || echo $1; }
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $R/gpu.txt; date -u | tee -a $R/gpu.txt
python3 -c "import liger_kernel, importlib.metadata as m; print('liger', m.version('liger-kernel'))"
timeout $(left 330) python3 scripts/bench_e2e.py --shape llama8b --layers 32 --samples 32 --hf-batch 2 --capacity 8192 --variants hf,hf_liger,triton,triton_graphs --out $R/e2e8b > $R/e2e8b.log 2>&1
grep -v "^ \|^-\|^#\|^\[\|Warning" $R/e2e8b.log | tail -10 | cut -c1-400; echo "t=${SECONDS}s"
timeout $(left 240) python3 scripts/bench_e2e.py --shape llama1b --layers 16 --capacity 16384 --variants hf,hf_liger,triton,triton_graphs --out $R/e2e1b > $R/e2e1b.log 2>&1
grep -v "^ \|^-\|^#\|^\[\|Warning" $R/e2e1b.log | tail -10 | cut -c1-400; echo "t=${SECONDS}s"
cd $OUT && tar czf results.tgz r && rm -rf r
