"""One batched decode step's time by batch size: B requests prefilled into a slot pool, then decode
steps of all B rows at once (Engine.decode_batch), greedy tokens fed back.

    PYTHONPATH=. python3 bench/batch_step.py OUT.json [--model synth:qwen3.5-9b] [--batches 1,8,32,64]
        [--prompt-length 512] [--steps 32] [--loop 8]

Per B: ms a step (median of --steps, after 3 warm-up steps) and B / step as output tok/s; where
B <= --loop, also the same steps with the per-request row loop (no pooled kernels) for comparison,
and whether both paths chose the same tokens. The load tunes the projections for batches up to the
largest B (kiln.load max_batch).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kiln
from kiln.cache import SlotPool
from kiln.tools.benchutil import environment, now_iso


def steps(eng, states, tokens, positions, n: int) -> tuple[list[float], list[list[int]]]:
    """n decode steps of every row; each step's seconds and the tokens it chose."""
    times, chosen = [], []
    tokens, positions = list(tokens), list(positions)
    for _ in range(n):
        if eng.device.type == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        logits = eng.decode_batch(tokens, positions, states)
        tokens = logits.argmax(-1).tolist()          # the host needs them for the next step, as Batch does
        times.append(time.perf_counter() - t)
        chosen.append(tokens)
        positions = [p + 1 for p in positions]
    return times, chosen


def snapshot(states):
    return [[(layer.length, [t.clone() for t in (layer.conv, layer.ssm)] if hasattr(layer, "ssm") else None)
             for layer in st] for st in states]


def restore(states, saved):
    for st, s in zip(states, saved):
        for layer, (length, tensors) in zip(st, s):
            layer.length = length
            if tensors is not None:
                layer.conv.copy_(tensors[0])
                layer.ssm.copy_(tensors[1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="synth:qwen3.5-9b")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--prompt-length", type=int, default=512)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--loop", type=int, default=8)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--eager", action="store_true", help="no CUDA graphs")
    a = ap.parse_args()
    batches = [int(b) for b in a.batches.split(",")]
    llm = kiln.load(a.model, dtype=a.dtype, device=a.device, backend=a.backend, quiet=False,
                    max_batch=max(batches), enforce_eager=a.eager)
    eng = llm.engine
    pool = eng.slot_pool(max(batches))
    g = torch.Generator().manual_seed(0)
    rows = []
    for b in batches:
        states = [pool.take(a.prompt_length + a.steps + 64) for _ in range(b)]    # its pages: prompt and steps
        t = time.perf_counter()
        first = []
        for st in states:
            ids = torch.randint(0, llm.model.cfg.vocab_size, (a.prompt_length,), generator=g).tolist()
            first.append(int(eng.prefill(ids, st).argmax()))
        prefill_s = time.perf_counter() - t
        positions = [a.prompt_length] * b
        saved = snapshot(states)     # KV past the prompt is rewritten by the next run: lengths suffice
        steps(eng, states, first, positions, 3)
        restore(states, saved)
        times, pooled = steps(eng, states, first, positions, a.steps)
        ms = statistics.median(times) * 1e3
        row = {"batch": b, "step_ms": round(ms, 3), "output_tok_s": round(b * 1e3 / ms, 1),
               "prefill_s_each": round(prefill_s / b, 4), "pool_capacity": pool.capacity,
               "graphs": eng._batch_graphs is not None and b in eng._batch_graphs.graphs}
        if b <= a.loop:       # the row loop: eager, attention and the GDN step request by request
            restore(states, saved)
            real = SlotPool.slots_of
            SlotPool.slots_of = staticmethod(lambda states: None)
            try:
                times, looped = steps(eng, states, first, positions, a.steps)
            finally:
                SlotPool.slots_of = staticmethod(real)
            row["loop_step_ms"] = round(statistics.median(times) * 1e3, 3)
            row["same_tokens_as_loop"] = pooled == looped
            row["same_steps_as_loop"] = sum(p == q for p, q in zip(pooled, looped))
        print(json.dumps(row), flush=True)
        rows.append(row)
        for st in states:
            pool.give(st)
    report = {"model": a.model, "dtype": str(eng.dtype), "backend": llm.model.ops.name, "device": str(eng.device),
              **environment(eng.device), "date": now_iso(),
              "command": "python3 bench/batch_step.py " + " ".join(f"{k}={v}" for k, v in vars(a).items()),
              "load_stages": llm.load_stages, "results": rows}
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
