#!/usr/bin/env bash
# The bundled GGUF models (98 and 253 MB) do not fit in one device call (64 MiB travels a call), so
# they go over in chunks: `prepare` splits them here into .models-all/ (ignored, never carried);
# `next` moves the next chunk into .stage/ (carry it); on the device the `stage` step of
# h200_next.sh appends each chunk under /tmp/kiln-models (kept while the machine stays warm) and
# `bundled` checks the sizes and runs the compares.
# Usage (here): bash bench/stage_models.sh prepare | next | left
set -eu
src=${KILN_CACHE_DIR:-$HOME/.cache/kiln}/models
case ${1:-} in
  prepare)
    rm -rf .models-all .stage && mkdir -p .models-all .stage
    for f in "$src"/*/*.gguf; do
      name=$(basename "$(dirname "$f")")
      split -b 50M -d -a 2 "$f" ".models-all/${name}__$(basename "$f").part"
      echo "$name $(basename "$f") $(stat -c %s "$f")" >> .models-all/SIZES
    done
    ls -la .models-all ;;
  next)
    rm -f .stage/*.part*
    cp .models-all/SIZES .stage/
    p=$(ls .models-all/*.part* 2>/dev/null | head -1)
    [ -n "$p" ] || { echo "nothing left to stage"; exit 1; }
    mv "$p" .stage/ && ls .stage ;;
  left) ls .models-all/*.part* 2>/dev/null | wc -l ;;
  *) echo "usage: $0 prepare|next|left"; exit 2 ;;
esac
