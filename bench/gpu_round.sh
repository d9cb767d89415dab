#!/usr/bin/env bash
# One device call: kernel GPU tests, per-op benches, engine smoke. Usage: bash bench/gpu_round.sh "SPECS" [TESTS] [BENCHES]
set -u
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
specs=$1; tests=${2:-}; benches=${3:-}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
if [ -d .whl ]; then python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=$PYTHONPATH:/tmp/site; fi
for t in $tests; do timeout 240 python3 -m pytest -q -m gpu -x $t 2>&1 | tail -15; done
for b in $benches; do timeout 200 python3 bench/${b}_gpu.py $OUT/${b}_gpu.json 2>&1 | tail -25; done
[ -n "$specs" ] && timeout 400 python3 bench/gpu_smoke.py $OUT/smoke.json $specs 2>&1 | grep -v "^\[autotune\]\|load:" | tail -40
