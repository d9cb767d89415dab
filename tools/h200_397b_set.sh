#!/usr/bin/env bash
# Issue 21's 397B row, one device call: synth:qwen3.5-397b-a17b at full depth with 4-bit experts
# (~217 GB), its hot experts resident (static policy, a uniform profile: each layer's lowest ids) and
# the rest pinned in host memory, `kiln bench` after a 512-token prompt. Env: KILN_COMMIT, TAG,
# GPU_GB (--gpu-memory, default 132), HOST_GB (--host-memory, default 100), STEP_TIMEOUT, EXTRA (more
# kiln bench flags, e.g. "--prompt-lengths 512,4096").
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
model=synth:qwen3.5-397b-a17b:bits=4:router=8
free -g | head -2; nvidia-smi --query-gpu=memory.total,memory.used --format=csv
python3 bench/uniform_profile.py "$model" /tmp/p397.json || exit 1
STEP_TIMEOUT=${STEP_TIMEOUT:-540} bash tools/gpu_run.sh bench "$model" --expert-policy static \
  --expert-profile /tmp/p397.json --expert-home host --gpu-memory "${GPU_GB:-132}" --host-memory "${HOST_GB:-100}" \
  --max-context 8192 --prompt-lengths 512 --gen 32 --runs 1 ${EXTRA:-}
