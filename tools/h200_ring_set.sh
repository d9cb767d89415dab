#!/usr/bin/env bash
# The sliding-window rings (kiln.cache.WindowKVCache) on the GPU machine, one call: the attention GPU
# tests (every variant reads a ring as the plain buffer, bit for bit), Gemma 4 26B-A4B bf16 at 512 /
# 1,000 / 8,192 tokens (on the H200 at 50c9ac0, plain buffers: decode 365.8 after 512, prefill 33,238 /
# 40,337 at 512 / 1,000), then issue 21's 3 GB streamed run at a 4K context (8 slots a layer with rings,
# 3 at b7a8c4c: lfu 66.0 tok/s, os 51.8). Env: KILN_COMMIT (the real hash), TAG.
set -u
export KILN_CACHE_DIR=${KILN_CACHE_DIR:-/tmp/kiln-cache}
GPU_TEST_TIMEOUT=240 bash tools/gpu_run.sh gputests tests/ops/test_attention.py tests/ops/test_rope.py
STEP_TIMEOUT=200 bash tools/gpu_run.sh bench synth:gemma4-26b-a4b --prompt-lengths 512,1000,8192 --gen 64 --runs 2 \
  | grep -v "^\[kiln\] prefill\|warm-up"
STEP_TIMEOUT=240 bash tools/gpu_run.sh py bench/stream_policies.py @json --model synth:gemma4-26b-a4b:bits=4:router=8 \
  --gpu-memory 3 --max-context 4096 --gen 32 --policies lfu,os --zero-copy on
