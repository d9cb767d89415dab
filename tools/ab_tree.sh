#!/usr/bin/env bash
# A/B on one machine in one device call: a tools/gpu_run.sh step run by the working tree and by an older
# kiln carried beside it. Set up the old side here first (ignored, so pass it in the run's carry):
#   rm -rf .ab_base && mkdir .ab_base && git archive REV kiln | tar -x -C .ab_base
# then on the GPU machine: BASE_COMMIT=REV KILN_COMMIT=NEW TAG=x ROUNDS=1 bash tools/ab_tree.sh bench MODEL [flags]
# Each side keeps its own kiln cache (its tune choices and shipped files are its own); order new, base per round.
# NEW_ENV="VAR=value ...": set for the new side only; with SAME_TREE=1 both sides run the working tree (an A/B
# of a switch such as KILN_NORM_EPILOGUE=1; no .ab_base needed).
# Results: gpu_run.sh's JSON with TAG_new[_round] and TAG_base[_round].
set -u
root=$PWD
[ -n "${SAME_TREE:-}" ] || [ -d .ab_base/kiln ] || { echo "no .ab_base/kiln: see the header"; exit 2; }
rounds=${ROUNDS:-1}
for i in $(seq 1 "$rounds"); do
  sfx=$([ "$rounds" -gt 1 ] && echo "_$i")
  for side in new base; do
    dir=$root; commit=${KILN_COMMIT:-new}; extra=${NEW_ENV:-}
    if [ $side = base ]; then
      extra=; commit=${BASE_COMMIT:-${SAME_TREE:+$commit}}; commit=${commit:-base}
      [ -n "${SAME_TREE:-}" ] || dir=$root/.ab_base
    fi
    echo "== $side$sfx ($commit${extra:+, $extra})"
    # shellcheck disable=SC2086  # NEW_ENV's words are separate assignments
    (cd "$dir" && env $extra KILN_CACHE_DIR=/tmp/kc_ab_$side KILN_COMMIT=$commit TAG=${TAG:-ab}_$side$sfx \
      bash "$root/tools/gpu_run.sh" "$@")
  done
done
