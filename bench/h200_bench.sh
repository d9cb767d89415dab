#!/usr/bin/env bash
# H200 runs behind issue 5: kiln bench with the transformers baseline on synthesized Qwen3.5 models.
# Usage (on the GPU machine, repo root): KILN_COMMIT=<hash> bash bench/h200_bench.sh OUTDIR MODEL LENGTHS [GEN]
# (the tree travels there without .git: KILN_COMMIT names the commit in the JSON)
set -u
out=$1; model=$2; lengths=$3; gen=${4:-32}
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
name=$(echo "$model" | tr ':=' '__')
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
python3 -m kiln.cli bench "$model" --device cuda --dtype bf16 --prompt-lengths "$lengths" --gen "$gen" --runs 1 \
  --baseline transformers --baseline-attn eager --json "$out/bench_$name.json" --plot "$out/bench_$name.png" \
  2>&1 | tee "$out/bench_$name.log"
