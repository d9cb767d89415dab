#!/usr/bin/env bash
# A/B on one machine in one device call: a tools/gpu_run.sh step run by the working tree and by an older
# kiln carried beside it. Set up the old side here first (ignored, so pass it in the run's carry):
#   rm -rf .ab_base && mkdir .ab_base && git archive REV kiln | tar -x -C .ab_base
# then on the GPU machine: BASE_COMMIT=REV KILN_COMMIT=NEW TAG=x ROUNDS=1 bash tools/ab_tree.sh bench MODEL [flags]
# Each side keeps its own kiln cache (its tune choices and shipped files are its own); order new, base per round.
# Results: gpu_run.sh's JSON with TAG_new[_round] and TAG_base[_round].
set -u
root=$PWD
[ -d .ab_base/kiln ] || { echo "no .ab_base/kiln: see the header"; exit 2; }
rounds=${ROUNDS:-1}
for i in $(seq 1 "$rounds"); do
  sfx=$([ "$rounds" -gt 1 ] && echo "_$i")
  for side in new base; do
    dir=$root; commit=${KILN_COMMIT:-new}
    [ $side = base ] && dir=$root/.ab_base && commit=${BASE_COMMIT:-base}
    echo "== $side$sfx ($commit)"
    (cd "$dir" && KILN_CACHE_DIR=/tmp/kc_ab_$side KILN_COMMIT=$commit TAG=${TAG:-ab}_$side$sfx \
      bash "$root/tools/gpu_run.sh" "$@")
  done
done
