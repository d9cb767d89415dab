#!/usr/bin/env bash
# Brings the bundled GGUF models to the GPU machine (which reaches no network) in chunks, over several calls.
# A device call carries at most 64 MiB and the two models are ~350 MB, so:
#   here:   `prepare` splits the models' bytes into .models-all/part00.. of 56 MiB and .models-all/SIZES
#           (and keeps .models-all out of git: .git/info/exclude); `list` shows the chunks.
#   device: each call carries one chunk and SIZES (carry: .models-all/partNN, .models-all/SIZES) beside its
#           own work and runs `stage`, which keeps the chunk under /tmp/kiln-models while the machine stays
#           warm; once every chunk is there, `install` rebuilds the files into $KILN_CACHE_DIR/models and
#           checks their sha256 against kiln.hub. tools/gpu_run.sh runs both as its `models` step.
# Usage: bash tools/stage_models.sh prepare|list|stage|install
set -eu
src=${KILN_CACHE_DIR:-$HOME/.cache/kiln}/models
staged=/tmp/kiln-models
case ${1:-} in
  prepare)
    [ -d .git ] && { grep -qx '/.models-all/' .git/info/exclude 2>/dev/null || echo '/.models-all/' >> .git/info/exclude; }
    rm -rf .models-all && mkdir -p .models-all
    for f in "$src"/*/*.gguf; do   # SIZES order is the stream order
      echo "$(basename "$(dirname "$f")") $(basename "$f") $(stat -c %s "$f")" >> .models-all/SIZES
    done
    while read -r name file size; do cat "$src/$name/$file"; done < .models-all/SIZES \
      | split -b 56M -d -a 2 - .models-all/part
    ls -la .models-all ;;
  list) ls .models-all/part* ;;
  stage)
    mkdir -p "$staged" && cp .models-all/SIZES "$staged/"
    for p in .models-all/part*; do
      [ -e "$p" ] || continue
      cmp -s "$p" "$staged/${p##*/}" || { cp "$p" "$staged/" && echo "staged ${p##*/}"; }
    done
    echo "on the machine: $(cd "$staged" && ls part* 2>/dev/null | tr '\n' ' ')" ;;
  install)
    at=1
    while read -r name file size; do
      mkdir -p "$src/$name"; f="$src/$name/$file"
      cat "$staged"/part* | tail -c +$at | head -c "$size" > "$f"; at=$((at + size))
      if [ "$(stat -c %s "$f")" != "$size" ]; then
        echo "$name: $(stat -c %s "$f") of $size bytes staged (a chunk is missing)"; rm -f "$f"; continue
      fi
      if python3 -c "import hashlib, sys; from kiln.hub import BUNDLED
sys.exit(hashlib.sha256(open(sys.argv[2], 'rb').read()).hexdigest() != BUNDLED[sys.argv[1]].sha256)" "$name" "$f"
      then echo "$name: installed in $f"
      else echo "$name: sha256 differs from kiln.hub's (or kiln did not import): removed"; rm -f "$f"
      fi
    done < "$staged/SIZES" ;;
  *) echo "usage: $0 prepare|list|stage|install"; exit 2 ;;
esac
