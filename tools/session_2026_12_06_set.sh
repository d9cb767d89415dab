#!/usr/bin/env bash
# The GPU half of what 2026-12-06's last session wrote without device time, one device call on any GPU
# (~8 min): the GPU tests of the moe pair forms (kiln/ops/moe/hpairs.py) and the RoPE table kernel
# (kiln/ops/rope/tables.py); the moe op tuned at the 35B-A3B's decode shapes (1 and 4 tokens, bf16, no
# weights drawn) with each shape's best pair form against its best Triton GEMV form; then the RoPE table
# kernel's A/B on the 0.8b (tools/switch_ab.sh, one round). Env: KILN_COMMIT, TAG. Results under $OUT.
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
timeout "${TEST_TIMEOUT:-240}" python3 -m pytest -q -m gpu -rf --tb=short -p no:cacheprovider \
  tests/ops/test_moe_hpairs.py tests/ops/test_rope_tables.py 2>&1 | tail -25 | tee "$OUT/gputests_${TAG:-new}.txt"
export KILN_CACHE_DIR=/tmp/kc_moe_pairs
KILN_MOE_PAIRS=1 timeout "${TUNE_TIMEOUT:-200}" python3 -m kiln.cli tune synth:qwen3.5-35b-a3b --dtype bf16 --ops moe --m 1 --m 4 \
  --quiet 2>&1 | tail -8
python3 - <<'P' 2>&1 | tee "$OUT/moe_pairs_${TAG:-new}.txt"
import glob, json
for f in glob.glob("/tmp/kc_moe_pairs/tune/*.json"):
    for k, v in json.load(open(f))["entries"].items():
        m = v["measured"]
        best = lambda pre: min((n for n in m if n.startswith(pre)), key=m.get, default=None)   # noqa: E731
        p, g = best("hpairs"), best("gemv")
        print(f"{k}: kept {v['variant']} {v['ms'] * 1e3:.2f} us; best pairs {p} {m.get(p, 0) * 1e3:.2f} us; "
              f"best gemv {g} {m.get(g, 0) * 1e3:.2f} us; {sum(n.startswith('hpairs') for n in m)} pair forms timed")
P
unset KILN_CACHE_DIR
SWITCH=KILN_ROPE_TABLES TAG=${TAG:-new}_rope ROUNDS=1 MODELS=synth:qwen3.5-0.8b TEST_FILE=none \
  bash tools/switch_ab.sh 2>&1 | grep -v "^tests\|exit" | tail -12
