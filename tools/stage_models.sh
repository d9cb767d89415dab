#!/usr/bin/env bash
# The bundled GGUF models (98 and 253 MB together) do not fit in one device call (64 MiB travels a
# call), so they go over in chunks: `prepare` concatenates them here and splits the stream into
# .models-all/part00.. of 56 MiB (ignored; carry one chunk a call, with .models-all/SIZES). On the
# device the `stage` step of h200_next.sh keeps each carried chunk under /tmp/kiln-models (it lives
# while the machine stays warm) and `bundled` rebuilds the files from SIZES, checks them, and runs
# the compares. A chunk rides along with a call that does other work, so staging costs no extra call.
# Usage (here): bash bench/stage_models.sh prepare | list
set -eu
src=${KILN_CACHE_DIR:-$HOME/.cache/kiln}/models
case ${1:-} in
  prepare)
    rm -rf .models-all && mkdir -p .models-all
    for f in "$src"/*/*.gguf; do   # SIZES order is the stream order
      echo "$(basename "$(dirname "$f")") $(basename "$f") $(stat -c %s "$f")" >> .models-all/SIZES
    done
    while read -r name file size; do cat "$src/$name/$file"; done < .models-all/SIZES \
      | split -b 56M -d -a 2 - .models-all/part
    ls -la .models-all ;;
  list) ls .models-all/part* ;;
  *) echo "usage: $0 prepare|list"; exit 2 ;;
esac
