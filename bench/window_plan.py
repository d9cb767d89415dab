"""The state a model's sliding-window layers hold on the cuda backend, rings (kiln.cache.WindowKVCache)
against plain buffers of every position, from kiln's own memory plan (kiln.api.memory_plan), no
weight loaded: the cache bytes at each context, and under a --gpu-memory budget the expert slots a
layer that the difference buys.

    TRITON_INTERPRET=1 python3 bench/window_plan.py OUT.json --model synth:gemma4-26b-a4b:bits=4:router=8 \\
        --contexts 4096,32768,131072 --gpu-memory 3
(on a CPU the cuda backend needs the interpreter to be made; nothing runs on it.) JSON to OUT, a
table on stdout."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch

from kiln.api import memory_plan, state_bytes
from kiln.backends import get_ops
from kiln.cache import KVCache
from kiln.errors import KilnError
from kiln.models import base, model_config
from kiln.tools.benchutil import environment, now_iso
from kiln.weights import open_checkpoint
from kiln.weights.experts import GB

GPU_CHUNK = 4096        # the cuda backend's prefill chunk on a GPU (the interpreter's is 512)


@contextlib.contextmanager
def plain_buffers(on: bool):
    """Sliding-window layers made as plain buffers of every position (as before the rings), when on."""
    ring = base.Model.kv_cache

    def plain(self, n_kv, head_dim, dtype, device, window=None):
        cache = KVCache(n_kv, head_dim, dtype, device)
        cache.window = window
        return cache

    base.Model.kv_cache = plain if on else ring
    try:
        yield
    finally:
        base.Model.kv_cache = ring


def ops_for(chunk: int):
    ops = get_ops("cuda", torch.device("cpu"))
    ops.prefill_chunk, ops.graphs = chunk, True
    return ops


def measure(ckpt, contexts: list[int], budget: float | None) -> list[dict]:
    cls, cfg = model_config(ckpt.config)
    rows = []
    for context in contexts:
        row = {"context": context}
        for form in ("ring", "plain"):
            with plain_buffers(form == "plain"):
                row[f"{form}_cache_bytes"] = state_bytes(cls, cfg, ops_for(GPU_CHUNK), torch.bfloat16, context,
                                                         min(GPU_CHUNK, context))
                if budget is not None:
                    try:
                        plan = memory_plan(ckpt, ops_for(GPU_CHUNK), torch.bfloat16, context, budget, None, "lfu")
                        row[f"{form}_plan"] = plan.summary() if plan is not None else None
                    except KilnError as e:      # the budget does not hold the core and cache
                        row[f"{form}_plan"] = {"error": str(e)}
        rows.append(row)
    return rows


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--model", required=True)
    p.add_argument("--contexts", default="4096,32768,131072")
    p.add_argument("--gpu-memory", type=float, default=None)
    a = p.parse_args()
    rows = measure(open_checkpoint(a.model), [int(x) for x in a.contexts.split(",")], a.gpu_memory)
    for r in rows:
        slots = ""
        if a.gpu_memory is not None:
            slots = "  slots " + " / ".join(str((r[f"{f}_plan"] or {}).get("slots")) for f in ("ring", "plain"))
        print(f"context {r['context']:>7}: cache ring {r['ring_cache_bytes'] / GB:7.2f} GB, plain "
              f"{r['plain_cache_bytes'] / GB:7.2f} GB{slots}")
    record = {"model": a.model, "gpu_memory": a.gpu_memory, "prefill_chunk": GPU_CHUNK, "rows": rows,
              **environment(torch.device("cpu")), "date": now_iso(), "command": " ".join(["python3", *sys.argv])}
    with open(a.out + ".tmp", "w") as f:
        json.dump(record, f, indent=1)
    os.replace(a.out + ".tmp", a.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
