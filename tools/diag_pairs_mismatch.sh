#!/usr/bin/env bash
# Whether the dp4a pair mode (KILN_DP4A_PAIRS=1) gives a streamed 35B-A3B other tokens than the resident
# one more often than the fma pairs do: `kiln compare M --reference M --reference-backend cuda
# --expert-cache-slots 4` gave 3/32 and 1/32 identical in 2 of 9 runs with dp4a on an H100 (2026-12-06),
# 32/32 at logit error 0 in the rest and in ~4 with fma. One device call: each step REPEAT times in its
# own cache (the first run tunes, cold), one verdict line a run, then the expert shapes' tuned forms in
# each model's tune file (the two models must take the same ones). Steps: dp4a, fma (streamed against
# resident); dp4a_resident (resident against resident: is the kernel itself run-to-run stable?); nopdl,
# inorder (staging on the main stream), inplace (misses read from mapped host memory, no staging).
# Env: MODEL (default the 4-layer 35B-A3B at 4 bits), LIMIT (seconds a run, default 150), REPEAT
# (default 4), STEPS (default "dp4a fma dp4a_resident").
set -u
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
M=${MODEL:-synth:qwen3.5-35b-a3b:layers=4:bits=4:router=8}
limit=${LIMIT:-150}
base=(compare "$M" --reference "$M" --reference-backend cuda --random-prompt 64 --tokens 32)
step() {      # name, then env... and the extra compare flags after --
  local name=$1; shift
  case " ${STEPS:-dp4a fma dp4a_resident} " in *" $name "*) ;; *) return ;; esac
  local envs=() flags=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
  [ $# -gt 0 ] && shift && flags=("$@")
  rm -rf "/tmp/kd_$name"
  for i in $(seq "${REPEAT:-4}"); do
    echo "== $name run $i: $(env KILN_CACHE_DIR="/tmp/kd_$name" "${envs[@]}" timeout "$limit" python3 -m kiln.cli \
      "${base[@]}" "${flags[@]}" 2>&1 | grep -i "error\|fault\|random 64" | cut -c1-250 | tr '\n' ' ')"
  done
  python3 - "/tmp/kd_$name/tune" <<'PY'
import json, sys, pathlib
for f in sorted(pathlib.Path(sys.argv[1]).glob("*.json")):
    e = json.loads(f.read_text())["entries"]
    print(" ", f.name[-30:], {k.split(" ")[1]: v["variant"] for k, v in e.items()
                              if k.startswith("qgemv 1x1024x2048_q4g64") or k.startswith("qgemv 1x2048x512_q4g64")})
PY
}
slots=(--expert-cache-slots 4)
step dp4a KILN_DP4A_PAIRS=1 -- "${slots[@]}"
step fma KILN_DP4A_PAIRS=0 -- "${slots[@]}"
step dp4a_resident KILN_DP4A_PAIRS=1
step nopdl KILN_DP4A_PAIRS=1 KILN_PDL=0 -- "${slots[@]}"
step inorder KILN_DP4A_PAIRS=1 KILN_STAGE_AHEAD=0 -- "${slots[@]}"
step inplace KILN_DP4A_PAIRS=1 KILN_STAGE_MISSES=0 -- "${slots[@]}"
