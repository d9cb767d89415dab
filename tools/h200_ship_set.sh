#!/usr/bin/env bash
# Re-ship a GPU's tuning choices (issue 23's cold start; made for the H200), one device call: `kiln tune` of the seed
# models at the batch and prefill buckets in a fresh cache, then tools/ship_tune.py on that cache, the
# shipped file and the cache back under $OUT; then, while time is left, a cold start (empty kiln and
# Triton caches) that gates the new choices: kiln bench's first_token_s. Env: KILN_COMMIT, TAG, LIMIT_S, SPECS, MS.
set -u
export KILN_CACHE_DIR=/tmp/kiln-ship PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT" "$KILN_CACHE_DIR/tune"
start=$SECONDS; limit=${LIMIT_S:-570}
left() { echo $((limit - (SECONDS - start))); }
# MS: kiln tune's --m flags; default none: the rows a load tunes (512, 4096, a MoE's 1024 and 2048, 1), what a
# cold start needs. At all eight buckets (MS="--m 1 --m 4 --m 16 --m 64 --m 512 --m 1024 --m 2048 --m 4096",
# the batched decode's too) --budget left residual_norms, gemm_act, act_gemm and moe unshipped on an H100
# (2026-12-06), and its file holds one model's attention and qk_rope shapes (tools/ship_tune.py --cover)
ms=${MS:-}
# SPECS: "model seconds" pairs separated by ';' (default: every seed model, most used first)
SPECS=${SPECS:-"qwen3.5-9b 90;qwen3.5-0.8b 80;qwen3.5-35b-a3b 100;gemma4-26b-a4b 90;qwen3.5-27b 90;qwen3.5-2b 80;qwen3.5-35b-a3b:bits=4:router=8 90"}
IFS=';' read -ra specs <<< "$SPECS"
for spec in "${specs[@]}"; do
  set -- $spec
  [ $# -eq 2 ] || { echo "bad spec '$spec' (want: model seconds)"; continue; }
  if [ "$(left)" -lt $(($2 + 60)) ]; then echo "skipped $1: $(left) s left"; continue; fi
  t0=$SECONDS
  # --budget stops the measuring 15 s before the timeout; it counts the compile before it (25-36 s for
  # each bf16 seed model on an H100, 2026-12-06: at 2/3 of the seconds that left four ops unmeasured);
  # what is left is gated and not shipped. A killed tune keeps what it saved as it went
  # (kiln.tune.tuner.SAVE_EVERY_S, from the first measured shapes on).
  if [[ $1 == *bits=* ]]; then   # quantised: the qgemv shapes come from the loaded weights (kiln tune
    # measures the config's shapes only), so a load tunes them: kiln bench, its load's rows
    KILN_TUNE_BUDGET_S=$(($2 - 15)) timeout "$2" python3 -m kiln.cli bench "synth:$1" --prompt-lengths 512 \
      --gen 8 --runs 1 2>&1 | grep "^\[kiln\]\|^\[bench\] load\|Error" | cut -c1-300
  else
    timeout "$2" python3 -m kiln.cli tune "synth:$1" $ms --budget $(($2 - 15)) 2>&1 \
      | grep "^\[kiln\]\|Error" | cut -c1-300
  fi
  echo "tuned $1: exit ${PIPESTATUS[0]}, $((SECONDS - t0)) s"
done
python3 tools/ship_tune.py "$KILN_CACHE_DIR/tune" 2>&1 | tail -5
cp kiln/tune/shipped/*.json "$OUT/"      # this GPU's file made or merged (the H200's, or another's)
python3 tools/ship_tune.py --stale
tar czf "$OUT/tune_cache${TAG:+_$TAG}.tgz" -C "$KILN_CACHE_DIR" tune
if [ "$(left)" -gt 100 ]; then   # a cold start as a new user meets it: no kiln or Triton cache
  rm -rf /tmp/cold && mkdir -p /tmp/cold
  KILN_CACHE_DIR=/tmp/cold TRITON_CACHE_DIR=/tmp/cold/triton STEP_TIMEOUT=$(($(left) - 10)) TAG=${TAG:+${TAG}_}cold \
    bash tools/gpu_run.sh bench synth:qwen3.5-0.8b --prompt-lengths 1000 --gen 32 --runs 1 | grep -i "first\|decode\|prefill" | tail -8
fi
echo "total $((SECONDS - start)) s"
