#!/usr/bin/env bash
# Issue 23's cold starts, one device call: for each seed model, `kiln bench` as a new user meets it
# (an empty kiln cache and Triton cache, the shipped choices of kiln/tune/shipped/ gated at load), a
# 1,000-token prompt (a length not tuned for) and a few decode tokens; its first_token_s and load
# stages. Run after tools/h200_ship_set.sh has shipped this GPU's choices. Env: KILN_COMMIT, TAG,
# LIMIT_S (the call's seconds), MODELS ("model seconds" pairs separated by ';').
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-out}; mkdir -p "$OUT"
start=$SECONDS; limit=${LIMIT_S:-570}
left() { echo $((limit - (SECONDS - start))); }
MODELS=${MODELS:-"qwen3.5-0.8b 90;qwen3.5-9b 120;qwen3.5-35b-a3b 150;gemma4-26b-a4b 150;qwen3.5-2b 90;qwen3.5-27b 200"}
IFS=';' read -ra models <<< "$MODELS"
for spec in "${models[@]}"; do
  set -- $spec
  [ $# -eq 2 ] || { echo "bad spec '$spec' (want: model seconds)"; continue; }
  if [ "$(left)" -lt $(($2 + 10)) ]; then echo "skipped $1: $(left) s left"; continue; fi
  rm -rf /tmp/cold && mkdir -p /tmp/cold
  KILN_CACHE_DIR=/tmp/cold TRITON_CACHE_DIR=/tmp/cold/triton STEP_TIMEOUT=$2 TAG=${TAG:+${TAG}_}cold \
    bash tools/gpu_run.sh bench "synth:$1" --prompt-lengths 1000 --gen 16 --runs 1 \
    | grep -i "first\|decode\|prefill\|tune\|weights\|error" | tail -8
done
echo "total $((SECONDS - start)) s"
