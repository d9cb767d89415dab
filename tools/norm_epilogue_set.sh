#!/usr/bin/env bash
# The norm epilogue's first full GPU run, one device call on any GPU (docs/quant.md: KILN_NORM_EPILOGUE is
# off until this passes and gains): the dp4a GPU tests (every epilogue and prologue case, since d3666ce's
# shared helpers), then `kiln bench` of the 27B and the 9B at 4 bits with KILN_NORM_EPILOGUE=1 against
# without, one tree, each side in its own fresh kiln cache (tools/ab_tree.sh). Env: KILN_COMMIT, TAG.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout "${TEST_TIMEOUT:-300}" python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider tests/ops/test_quant_dp4a.py \
  -k "${TESTS:-epilogue or prologue}" 2>&1 | tail -15 | tee "$OUT/gputest_dp4a_epilogues${TAG:+_$TAG}.txt"
for m in ${MODELS:-qwen3.5-27b qwen3.5-9b}; do
  SAME_TREE=1 NEW_ENV=KILN_NORM_EPILOGUE=1 TAG=${TAG:-nout} STEP_TIMEOUT=${STEP_TIMEOUT:-150} \
    bash tools/ab_tree.sh bench "synth:$m:bits=4:router=8" --prompt-lengths 512 --gen 64 --runs 2 2>&1 \
    | grep -E "^==|run [12]/2|launches per|rror" | cut -c1-200
done
# the tuner's verdicts on the new side: each out_norm shape's kept form, its best dp4a form and `unfused`
python3 - <<'P' 2>&1 | tee "$OUT/out_norm_choices${TAG:+_$TAG}.txt"
import glob, json
for f in glob.glob("/tmp/kc_ab_new/tune/*.json"):
    for k, v in json.load(open(f))["entries"].items():
        if "_out_" in k and k.endswith("_add"):
            m = v["measured"]
            best = min((n for n in m if n.startswith("dp4a")), key=m.get, default=None)
            print(f"{k}: kept {v['variant']}; best dp4a {best} {m.get(best, 0) * 1e3:.2f} us; "
                  f"unfused {m.get('unfused', 0) * 1e3:.2f} us")
P
