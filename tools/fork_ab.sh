#!/usr/bin/env bash
# An A/B of the decode forks (kiln/ops/fork.py) on one machine in one device call: per model, `kiln bench` with
# KILN_FORK=1 and KILN_FORK=0 alternating (ROUNDS pairs) in one kiln cache (the first run tunes, the rest hit:
# the same kernels both sides, so only the forks differ), then the fork GPU tests. Env: KILN_COMMIT, TAG,
# MODELS (specs, default the 0.8b in bf16 and at 4 bits), ROUNDS (2).
set -u
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kc_fork}
for m in ${MODELS:-synth:qwen3.5-0.8b synth:qwen3.5-0.8b:bits=4:router=8}; do
  for i in $(seq 1 "${ROUNDS:-2}"); do
    for f in 1 0; do
      echo "== $m KILN_FORK=$f round $i"
      KILN_FORK=$f TAG=${TAG:-fork}_$f$([ "$i" -gt 1 ] && echo "_$i") STEP_TIMEOUT=${STEP_TIMEOUT:-150} \
        bash tools/gpu_run.sh bench "$m" --prompt-lengths 512 --gen 64 --runs 2 2>&1 \
        | grep -E "run [12]/2|launches per|rror" | cut -c1-160
    done
  done
done
GPU_TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-200} bash tools/gpu_run.sh gputests tests/ops/test_fork.py
