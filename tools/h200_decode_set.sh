#!/usr/bin/env bash
# The 4-bit decode set on the GPU machine (issue 19's rows), one call: 9B, 0.8b, 27B benches at 512
# tokens, then the tuner's qgemv choices of this GPU's new tune caches and the caches themselves
# (≤ 8 files back). Env: KILN_COMMIT, TAG.
set -u
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln-cache}
for spec in "9b 170" "0.8b 110" "27b 250"; do
  set -- $spec
  STEP_TIMEOUT=$2 bash tools/gpu_run.sh bench "synth:qwen3.5-$1:bits=4:router=8" --prompt-lengths 512 --gen 64 --runs 2 \
    | grep -v "^\[kiln\] prefill\|warm-up"
done
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1 | sed 's/^NVIDIA //' | awk '{print tolower($1)}')
for f in $(ls -t "$KILN_CACHE_DIR"/tune/nvidia-*.json | head -3); do
  python3 tools/tune_choices.py "$f" | grep "qgemv" | cut -c1-200
  cp "$f" "${OUT:-out}/${gpu}_tune_cache_$(basename "$f" .json | cut -c1-40)_${KILN_COMMIT:-x}.json"
done
