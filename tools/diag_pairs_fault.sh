#!/usr/bin/env bash
# Why `kiln compare M --reference M --reference-backend cuda --expert-cache-slots 4` faults with the
# dp4a pair mode (KILN_DP4A_PAIRS=1) on an H100 (bench/NOTES.md, 2026-12-06): the resident reference
# runs, then the streamed model's load meets an illegal address. One device call, each step in its
# own process under a timeout (a fault poisons its CUDA context): the tune cache filled by the passing
# fma compare; the dp4a compare again (the fault, or not); with the plain kernels' warm-up thread off
# (KILN_WARM_PLAIN=0: it launches the plain kernels on uninitialised stand-ins while the weights load);
# then the dp4a compare under compute-sanitizer's memcheck, which names the faulting kernel and
# address. Output: each step's verdict lines and errors.
# Env: MODEL (default the 4-layer 35B-A3B at 4 bits), LIMIT (seconds a step, default 120).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln-pairs}
M=${MODEL:-synth:qwen3.5-35b-a3b:layers=4:bits=4:router=8}
limit=${LIMIT:-120}
args=(compare "$M" --reference "$M" --reference-backend cuda --expert-cache-slots 4 --random-prompt 64 --tokens 32)
step() {      # name, env..., then the command after --
  local name=$1; shift
  echo "== $name"
  env "$@" 2>&1 | grep -v "^\[autotune\]\|load:\|^\s*\^" | grep -i "error\|fault\|invalid\|PASS\|FAIL\|identical\|random 64\|at 0x\|by thread\|in kiln\|=========" \
    | head -30
  echo "== $name: exit ${PIPESTATUS[0]}"
}
step "fma (fills the tune cache)" KILN_DP4A_PAIRS=0 timeout "$limit" python3 -m kiln.cli "${args[@]}"
step "dp4a" KILN_DP4A_PAIRS=1 KILN_DEBUG=1 timeout "$limit" python3 -m kiln.cli "${args[@]}"
step "dp4a, no plain warm-up thread" KILN_DP4A_PAIRS=1 KILN_WARM_PLAIN=0 KILN_DEBUG=1 timeout "$limit" \
  python3 -m kiln.cli "${args[@]}"
step "dp4a under memcheck" KILN_DP4A_PAIRS=1 timeout $((limit * 3)) compute-sanitizer --tool memcheck \
  --print-limit 5 python3 -m kiln.cli "${args[@]}"
