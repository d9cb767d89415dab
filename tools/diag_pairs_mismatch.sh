#!/usr/bin/env bash
# Why the streamed 35B-A3B's tokens differ from the resident model's with the dp4a pair mode on a cold
# tune cache (`kiln compare M --reference M --reference-backend cuda --expert-cache-slots 4`: 3/32 and
# 1/32 identical on an H100, 2026-12-06, where the fma pairs give 32/32 at rel err 0). One device call:
# each variant in its own process and its own empty cache: the default; without PDL; staging in order
# (no side stream); misses read in place from mapped host memory (no staging); the fma pairs. Then the
# expert shapes' tuned choices in each model's tune file (the two models must take the same forms).
# Env: MODEL (default the 4-layer 35B-A3B at 4 bits), LIMIT (seconds a step, default 150), STEPS (names).
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
M=${MODEL:-synth:qwen3.5-35b-a3b:layers=4:bits=4:router=8}
limit=${LIMIT:-150}
args=(compare "$M" --reference "$M" --reference-backend cuda --expert-cache-slots 4 --random-prompt 64 --tokens 32)
step() {      # name, env...
  local name=$1; shift
  case " ${STEPS:-default nopdl inorder inplace fma} " in *" $name "*) ;; *) return ;; esac
  rm -rf "/tmp/kd_$name"
  echo "== $name"
  env KILN_CACHE_DIR="/tmp/kd_$name" "$@" timeout "$limit" python3 -m kiln.cli "${args[@]}" 2>&1 \
    | grep -i "error\|fault\|warning\|PASS\|FAIL\|random 64" | cut -c1-300 | head -8
  python3 - "/tmp/kd_$name/tune" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    e = json.loads(f.read_text())["entries"]
    print(" ", f.name[-30:], {k.split(" ")[1]: v["variant"] for k, v in e.items()
                              if k.startswith("qgemv 1x1024x2048_q4g64") or k.startswith("qgemv 1x2048x512_q4g64")})
PY
}
step default
step nopdl KILN_PDL=0
step inorder KILN_STAGE_AHEAD=0
step inplace KILN_STAGE_MISSES=0
step fma KILN_DP4A_PAIRS=0
