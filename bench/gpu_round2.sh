#!/usr/bin/env bash
# Device call: compare (tokens vs HF) and bench of the cuda backend. Usage: bash bench/gpu_round2.sh MODEL [EXTRA_COMPARE_FLAGS]
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
m=$1; shift
name=$(echo "$m" | tr ':=' '__')
python3 -m kiln.cli compare "$m" --dtype bf16 --random-prompt 512 --random-prompt 600 --tokens 32 --json $OUT/compare_$name.json 2>&1 | grep -v "^\[autotune\]\|load:" | tail -12
python3 -m kiln.cli compare "$m" --dtype bf16 --random-prompt 512 --tokens 32 --tune gdn_decode=unfused --json $OUT/compare_${name}_unfused.json 2>&1 | grep -v "^\[autotune\]\|load:" | tail -6
python3 -m kiln.cli bench "$m" --dtype bf16 --prompt-lengths 512,8192 --gen 64 --runs 2 --json $OUT/bench_$name.json 2>&1 | grep -v "^\[autotune\]\|load:" | tail -12
