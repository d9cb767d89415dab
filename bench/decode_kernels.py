"""Where a decode token's GPU time goes: kernels of the captured decode graph, by name.

    PYTHONPATH=. python3 bench/decode_kernels.py MODEL PROMPT_TOKENS OUT.json

On a GPU; on CPU it runs the reference backend eagerly (a smoke run: no graph, no kernel times).

Loads MODEL on the cuda backend (bf16), prefills a random prompt, decodes a few tokens so that the
step is captured as a CUDA graph, then records REPS more steps under torch.profiler and sums each
kernel's GPU time per token. Also the time per token three ways: ms_per_token, the engine's greedy
loop (the device picks each token, the host queues a step ahead: what `kiln bench` and generate()
run); ms_per_token_sync, the host-synchronous loop (decode_step, argmax, .item() every token);
graph_ms_per_token, the graph replayed back to back (the GPU's own time, no host in the loop);
and the weight bytes a token reads (the bandwidth floor: k / E of the routed experts).
Kernel names are Triton's function names (gemm_kernel, ...) with their launch grids folded together;
the JSON lists the top kernels and the total.
Read a PDL kernel's time with care (every kiln kernel launched with `launch_pdl`): it starts while the
kernel before it finishes and waits in pdl_wait, and the profiler counts that wait as its own time
(residual_norms: 7.9 us a call here against 2.2 us tuned alone, bench/NOTES.md 2026-12-03). The tune
cache's times (each op alone) and graph_ms_per_token are the figures to add up.
"""

from __future__ import annotations

import json
import sys
import time

import torch

import kiln
from kiln.tools.benchutil import environment, now_iso

REPS = 50


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def decode(eng, state, tok: int, pos: int, n: int, seen: list | None = None) -> tuple[int, int]:
    for _ in range(n):
        tok = int(torch.argmax(eng.decode_step(tok, pos, state)))
        pos += 1
        if seen is not None:
            seen.append(tok)
    return tok, pos


def token_bytes(model) -> tuple[int, int]:
    """(all weight bytes, the bytes one decode token reads): routed experts ([E, ...] tensors under
    `.experts.`) count k / E of their bytes, the embedding one row; the KV cache is not counted."""
    cfg = model.cfg
    k, e = getattr(cfg, "num_experts_per_tok", 0), getattr(cfg, "num_experts", 0)
    total = active = 0
    for name, w in model.w.items():
        parts = [w.packed, w.scales, w.biases] if hasattr(w, "packed") else [w]     # a QuantizedWeight's three
        b = sum(t.numel() * t.element_size() for t in parts)
        total += b
        if ".experts." in name and e:
            b = b * k // e
        elif "embed_tokens" in name and "lm_head.weight" in model.w:
            b = b // w.shape[0]
        active += b
    return total, active


def replay_ms(eng) -> float:
    """The captured step replayed REPS times back to back (each replay feeds itself: ids and pos are
    the graph's own). Run last: the state's host-side lengths are not advanced."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPS):
        eng.graph.graph.replay()
    end.record()
    end.synchronize()
    return round(start.elapsed_time(end) / REPS, 4)


def main(model: str, prompt: int, out: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    llm = kiln.load(model, dtype="bf16")
    eng = llm.engine
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, llm.model.cfg.vocab_size, (prompt,), generator=gen).tolist()
    state = eng.new_state(prompt + 5 * REPS + 8)
    tok, pos = int(torch.argmax(eng.prefill(ids, state))), prompt
    tokens = [tok]                                                  # the greedy tokens: A/B runs compare them
    tok, pos = decode(eng, state, tok, pos, 4, tokens)              # eager step, capture, replays
    sync()
    t0 = time.perf_counter()
    tok, pos = decode(eng, state, tok, pos, REPS, tokens)
    sync()
    sync_ms = (time.perf_counter() - t0) * 1e3 / REPS
    t0 = time.perf_counter()
    run = list(eng.greedy_tokens(tok, pos, state, REPS))
    sync()
    plain_ms = (time.perf_counter() - t0) * 1e3 / REPS
    tokens += run
    tok, pos = run[-1], pos + REPS          # run to its end, the loop feeds exactly REPS tokens
    acts = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
    with profile(activities=acts) as prof:
        t0 = time.perf_counter()
        tok, pos = decode(eng, state, tok, pos, REPS)
        sync()
        prof_ms = (time.perf_counter() - t0) * 1e3 / REPS
    graph_ms = replay_ms(eng) if eng.graph is not None and eng.graph.graph is not None else None
    kernels = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us:
            kernels[e.key[:90]] = {"us_per_token": round(us / REPS, 2), "calls_per_token": round(e.count / REPS, 2)}
    ranked = dict(sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_token"]))
    weight_bytes, active_bytes = token_bytes(llm.model)
    res = {"date": now_iso(), **environment(eng.device), "command": " ".join(sys.argv), "model": model,
           "prompt_tokens": prompt, "reps": REPS,
           "launches_per_token": eng.launches_per_token, "ms_per_token": round(plain_ms, 4),
           "ms_per_token_sync": round(sync_ms, 4), "graph_ms_per_token": graph_ms,
           "ms_per_token_profiled": round(prof_ms, 4),
           "kernel_us_per_token": round(sum(k["us_per_token"] for k in kernels.values()), 1),
           "weight_bytes": weight_bytes, "active_weight_bytes": active_bytes,
           "floor_ms_at_4.27TBps": round(active_bytes / 4.27e9, 4),
           "kernels": dict(list(ranked.items())[:40]), "tokens": tokens}
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k not in ("kernels", "tokens")}, indent=1))
    for name, k in list(ranked.items())[:15]:
        print(f"{k['us_per_token']:9.1f} us  {k['calls_per_token']:6.1f}x  {name}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
