#!/usr/bin/env bash
# Runs one maintained measurement on the GPU machine under its own timeout, its JSON under $OUT.
# Usage (GPU machine, repo root; chain calls with `;` so a later step runs when an earlier one fails):
#   bash tools/gpu_run.sh bench MODEL [kiln bench flags]     -> $OUT/<gpu>_bench_<model>[_<TAG>].json
#   bash tools/gpu_run.sh compare MODEL [kiln compare flags] -> $OUT/<gpu>_compare_<model>[_<TAG>].json
#   bash tools/gpu_run.sh profile MODEL [kiln profile flags] -> $OUT/<gpu>_profile_<model>[_<TAG>].json
#   bash tools/gpu_run.sh py SCRIPT [ARGS]   a bench/ or tools/ script; an argument @json becomes
#                                            $OUT/<gpu>_<script>[_<TAG>].json
#   bash tools/gpu_run.sh gputests [FILE...] pytest -m gpu, one process a file (default: every file with a
#                                            test marked gpu): a fault poisons the CUDA context for the rest
#   bash tools/gpu_run.sh models             the bundled models, carried in chunks (tools/stage_models.sh)
#   bash tools/gpu_run.sh tunecache          $KILN_CACHE_DIR/tune as $OUT/tune_cache[_<TAG>].tgz (a call brings
#                                            back at most 8 files of $OUT: count them)
# Environment: TAG (names the results, e.g. issue18_after), KILN_COMMIT (the JSON's kiln_commit: the
# machine's copy of the tree has no usable .git), STEP_TIMEOUT (seconds, default 540), GPU_TEST_TIMEOUT
# (a test file's seconds, default 150), KILN_CACHE_DIR (default /tmp/kiln-cache: it lasts while the
# machine stays warm). Carried folders it reads: .whl (wheels of peers such as flash-linear-attention,
# installed into /tmp/site) and .kiln-cache/tune (a tune cache from an earlier run: no re-tuning).
set -u -o pipefail
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln-cache}
OUT=${OUT:-out}; mkdir -p "$OUT" "$KILN_CACHE_DIR/tune"
if [ -d .whl ] && [ ! -e /tmp/site/.kiln-wheels ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && touch /tmp/site/.kiln-wheels
fi
[ -d /tmp/site ] && export PYTHONPATH=$PYTHONPATH:/tmp/site
[ -d .kiln-cache/tune ] && cp -n .kiln-cache/tune/*.json "$KILN_CACHE_DIR/tune/" 2>/dev/null
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | sed 's/^NVIDIA //' | awk '{print tolower($1)}')
gpu=${gpu:-cpu}
tag=${TAG:+_$TAG}
name() { echo "$1" | sed 's/^synth://; s/[:=]/_/g'; }
quiet() { { grep -v "load:\|^\[autotune\]" || true; } | cut -c1-400; }   # the tuner's lines: thousands
step=${1:?usage: bash tools/gpu_run.sh bench|compare|profile|py|gputests|models|tunecache ...}; shift
case $step in
  bench|compare|profile)
    model=$1; shift
    timeout "${STEP_TIMEOUT:-540}" python3 -m kiln.cli "$step" "$model" --dtype bf16 "$@" \
      --json "$OUT/${gpu}_${step}_$(name "$model")$tag.json" 2>&1 | quiet | tail -40 ;;
  py)
    script=$1; shift; json="$OUT/${gpu}_$(basename "$script" .py)$tag.json"
    timeout "${STEP_TIMEOUT:-540}" python3 "$script" "${@/#@json/$json}" 2>&1 | quiet | tail -40 ;;
  gputests)
    files=("$@")   # default: the files holding a test marked gpu, as pytest collects them
    [ ${#files[@]} -gt 0 ] || mapfile -t files < <(python3 -m pytest -m gpu --collect-only -q -p no:cacheprovider \
      2>/dev/null | grep '::' | cut -d: -f1 | sort -u)
    for f in "${files[@]}"; do
      timeout "${GPU_TEST_TIMEOUT:-150}" python3 -m pytest -q -m gpu -rf --tb=line -p no:cacheprovider "$f" 2>&1 \
        | { grep -v "^\s*$" || true; } | tail -6
      echo "$f: exit ${PIPESTATUS[0]}"
    done ;;
  models) bash tools/stage_models.sh stage && bash tools/stage_models.sh install ;;
  tunecache) tar czf "$OUT/tune_cache$tag.tgz" -C "$KILN_CACHE_DIR" tune && ls -la "$OUT/tune_cache$tag.tgz" ;;
  *) echo "unknown step $step"; exit 2 ;;
esac
