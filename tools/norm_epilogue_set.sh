#!/usr/bin/env bash
# The norm epilogue's first full GPU run, one device call on any GPU (docs/quant.md: KILN_NORM_EPILOGUE is
# off until this passes and gains): the dp4a GPU tests (every epilogue and prologue case, since d3666ce's
# shared helpers), then `kiln bench` of the 27B and the 9B at 4 bits with KILN_NORM_EPILOGUE=1 against
# without, one tree, each side in its own fresh kiln cache (tools/ab_tree.sh). Env: KILN_COMMIT, TAG.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout "${TEST_TIMEOUT:-170}" python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider tests/ops/test_quant_dp4a.py \
  -k "epilogue or prologue" 2>&1 | tail -15 | tee "$OUT/gputest_dp4a_epilogues${TAG:+_$TAG}.txt"
for m in ${MODELS:-qwen3.5-27b qwen3.5-9b}; do
  SAME_TREE=1 NEW_ENV=KILN_NORM_EPILOGUE=1 TAG=${TAG:-nout} STEP_TIMEOUT=${STEP_TIMEOUT:-150} \
    bash tools/ab_tree.sh bench "synth:$m:bits=4:router=8" --prompt-lengths 512 --gen 64 --runs 2 2>&1 \
    | grep -E "^==|run [12]/2|launches per|rror" | cut -c1-200
done
