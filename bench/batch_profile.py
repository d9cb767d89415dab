"""Where a batched decode step's GPU time goes: B requests prefilled into the slot pool, then eager
batched steps (the kernels the step's CUDA graph replays) under torch.profiler, kernels summed by name.

    PYTHONPATH=. python3 bench/batch_profile.py OUT.json [--model synth:qwen3.5-9b] [--batch 32]
        [--prompt-length 512] [--steps 5]
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch.profiler import ProfilerActivity, profile

import kiln
from kiln.tools.benchutil import environment, now_iso


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="synth:qwen3.5-9b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-length", type=int, default=512)
    ap.add_argument("--steps", type=int, default=5)
    a = ap.parse_args()
    llm = kiln.load(a.model, dtype="bf16", quiet=False, max_batch=a.batch)
    eng = llm.engine
    pool = eng.slot_pool(a.batch)
    graphs, eng._batch_graphs = eng._batch_graphs, None     # eager: each kernel is its own event
    g = torch.Generator().manual_seed(0)
    states = [pool.take(a.prompt_length + a.steps + 64) for _ in range(a.batch)]    # its pages: prompt and steps
    tokens = []
    for st in states:
        ids = torch.randint(0, llm.model.cfg.vocab_size, (a.prompt_length,), generator=g).tolist()
        tokens.append(int(eng.prefill(ids, st).argmax()))
    pos = [a.prompt_length] * a.batch
    for _ in range(3):
        tokens = eng.decode_batch(tokens, pos, states).argmax(-1).tolist()
        pos = [p + 1 for p in pos]
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(a.steps):
            tokens = eng.decode_batch(tokens, pos, states).argmax(-1).tolist()
            pos = [p + 1 for p in pos]
        torch.cuda.synchronize()
    step_ms = {"eager": timed(eng, tokens, pos, states, a.steps)}
    pos = [p + 2 * a.steps for p in pos]
    if graphs is not None:              # the step as the server runs it: its CUDA graph
        eng._batch_graphs = graphs
        step_ms["graph"] = timed(eng, tokens, pos, states, a.steps)
    print(f"step ms: {step_ms}")
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us > 0:
            rows.append({"name": e.key[:160], "calls_per_step": e.count / a.steps, "us_per_step": us / a.steps})
    rows.sort(key=lambda r: -r["us_per_step"])
    total = sum(r["us_per_step"] for r in rows)
    for r in rows[:30]:
        print(f"{r['us_per_step']:9.1f} us {r['calls_per_step']:6.1f}x  {r['name'][:110]}")
    print(f"total kernel time a step: {total / 1e3:.2f} ms")
    report = {"model": a.model, "batch": a.batch, "prompt_length": a.prompt_length, **environment(eng.device),
              "date": now_iso(), "command": "python3 bench/batch_profile.py " + " ".join(
                  f"{k}={v}" for k, v in vars(a).items()), "kernel_ms_per_step": round(total / 1e3, 3),
              "step_ms": step_ms, "kernels": rows}
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


def timed(eng, tokens, pos, states, steps: int) -> float:
    """ms a batched step (host loop included), after `steps` untimed ones (a graph's capture)."""
    for k in range(2 * steps):
        if k == steps:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
        tokens = eng.decode_batch(tokens, [p + k for p in pos], states).argmax(-1).tolist()
    return round((time.perf_counter() - t0) * 1e3 / steps, 3)


if __name__ == "__main__":
    main()
