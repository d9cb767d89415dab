#!/usr/bin/env bash
# An A/B of an on/off switch on one machine in one device call: per model, `kiln bench` with SWITCH=1 and SWITCH=0
# alternating (ROUNDS pairs) in one kiln cache (the first run tunes, the rest hit: the same tuned kernels both
# sides, so only the switch differs), then the GPU tests of TEST_FILE. Env: SWITCH (default KILN_FORK, the
# decode forks of kiln/ops/fork.py; KILN_ROPE_TABLES: the RoPE table kernel), TEST_FILE (default the switch's
# tests; none: no tests), KILN_COMMIT, TAG, MODELS (specs, default the 0.8b in bf16 and at 4 bits), ROUNDS (2).
# (Until 2026-12-06 this was tools/fork_ab.sh, KILN_FORK only.)
set -u
sw=${SWITCH:-KILN_FORK}
case $sw in KILN_FORK) tests=tests/ops/test_fork.py ;; KILN_ROPE_TABLES) tests=tests/ops/test_rope_tables.py ;; *) tests= ;; esac
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kc_switch}
for m in ${MODELS:-synth:qwen3.5-0.8b synth:qwen3.5-0.8b:bits=4:router=8}; do
  for i in $(seq 1 "${ROUNDS:-2}"); do
    for f in 1 0; do
      echo "== $m $sw=$f round $i"
      env "$sw=$f" TAG=${TAG:-switch}_$f$([ "$i" -gt 1 ] && echo "_$i") STEP_TIMEOUT=${STEP_TIMEOUT:-150} \
        bash tools/gpu_run.sh bench "$m" --prompt-lengths 512 --gen 64 --runs 2 2>&1 \
        | grep -E "run [12]/2|launches per|rror|warning" | cut -c1-200
    done
  done
done
t=${TEST_FILE:-$tests}
[ -z "$t" ] || [ "$t" = none ] || GPU_TEST_TIMEOUT=${GPU_TEST_TIMEOUT:-240} bash tools/gpu_run.sh gputests "$t"
