"""Streamed experts' decode under each policy and read mode, one load (issue 21; docs/streaming.md).

    PYTHONPATH=. python3 bench/stream_policies.py OUT.json --model synth:gemma4-26b-a4b:bits=4:router=8
        [--gpu-memory 3] [--max-context 4096] [--slots N] [--policies lfu,lru,os,static]
        [--zero-copy on,off] [--prompt-length 512] [--gen 64] [--home host|disk]

Loads the model once with its routed experts streamed, measures the link first (pinned host to
device: a copy's GB/s, and a kernel reading mapped host memory in place), then for each zero-copy
choice and policy: empty slots, a seeded random prompt prefilled, --gen decode steps timed (fed
seeded random tokens: --feed).
Counts are the decode's alone (taken after the prefill and two steps). With zero-copy the decode
runs as a CUDA graph (captured before the timed steps); copying runs eagerly. Per run: tok/s, hit rate,
promotions, bytes a token over the link, and the I/O bound: the tok/s those bytes allow at the
measured bandwidth of the way they moved (in place or copied; from disk: random expert reads by the
store's I/O threads, measured before the runs). static's hot set is the profile of the first lfu
run of the same read mode (in-sample: says so).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

import kiln
from kiln.backends.graphs import DecodeGraph
from kiln.fsutil import write_atomic
from kiln.tools.benchutil import command_line, disk_gb_s, environment, link_gb_s, now_iso

COUNTS = ("hits", "misses", "bytes", "promoted", "tokens")


def run(llm, prompt: list[int], gen: int, feed: list[int] | None) -> tuple[float, dict, list[int]]:
    """Prefill and two decode steps, then `gen` decode steps timed: their tok/s, the store's counts
    over them alone, and every token chosen (the greedy one). Each step is fed the last choice, or
    with `feed` the next of those tokens (a random model's greedy tokens repeat, and so would its
    routing)."""
    eng, store = llm.engine, llm.model.expert_store
    state = eng.new_state(len(prompt) + gen + 3)
    tokens = [int(eng.prefill(prompt, state).argmax())]
    fed = iter(feed) if feed is not None else None
    for k in range(2):          # eager, then the graph's capture (zero-copy)
        tokens.append(int(eng.decode_step(next(fed) if fed else tokens[-1], len(prompt) + k, state).argmax()))
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    sync()
    before = store.summary()
    t = time.perf_counter()
    for k in range(gen):
        tokens.append(int(eng.decode_step(next(fed) if fed else tokens[-1], len(prompt) + 2 + k, state).argmax()))
    sync()
    seconds = time.perf_counter() - t
    after = store.summary()
    counts = {c: after[c] - before[c] for c in COUNTS}
    return gen / seconds, counts, tokens


def measure(llm, prompt, gen: int, zero_copy: bool, policy: str, profile, link: dict, feed) -> dict:
    store = llm.model.expert_store
    eng = llm.engine
    eng.graph = eng._state = None       # a graph captured on the last run's slots and read mode: dropped
    if zero_copy and store.graph_safe:
        eng.graph = DecodeGraph(llm.model, eng.device)
    store.reset(policy, profile, zero_copy)
    tok_s, c, tokens = run(llm, prompt, gen, feed)
    seen = c["hits"] + c["misses"]
    per_token = c["bytes"] / c["tokens"] if c["tokens"] else None      # bytes summed over layers, rows a layer
    bw = link["disk"] if store.home_tier == "disk" else link["in_place" if store.zero_copy else "copy"]
    bound = bw * 1e9 / per_token if bw and per_token else None
    row = {"zero_copy": store.zero_copy, "graph": llm.engine.graph is not None, "policy": policy,
           "slots": store.slots, "decode_tok_s": round(tok_s, 2),
           "hit_rate": round(c["hits"] / seen, 4) if seen else None, "promoted_per_token": c["promoted"] / gen,
           "bytes_per_token": per_token, "io_bound_tok_s": round(bound, 1) if bound else None,
           "of_bound": round(tok_s / bound, 3) if bound else None, "tokens": tokens}
    print(f"zero-copy {'on ' if store.zero_copy else 'off'} {policy:6s} {tok_s:7.2f} tok/s  hit "
          f"{row['hit_rate']}  {per_token / 1e9 if per_token else 0:.3f} GB a token  bound "
          f"{row['io_bound_tok_s']}  ({row['of_bound']})", file=sys.stderr)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--model", default="synth:gemma4-26b-a4b:bits=4:router=8")
    ap.add_argument("--gpu-memory", type=float, default=3.0)
    ap.add_argument("--max-context", type=int, default=4096)
    ap.add_argument("--slots", type=int, default=None, help="slots a layer (default: what --gpu-memory fits)")
    ap.add_argument("--policies", default="lfu,lru,os,static")
    ap.add_argument("--zero-copy", default="on,off")
    ap.add_argument("--home", default="auto")
    ap.add_argument("--prompt-length", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--feed", choices=["random", "greedy"], default="random",
                    help="what each decode step is fed: seeded random tokens (default: a random model's "
                         "greedy tokens repeat, and so would its routing) or the greedy choice")
    a = ap.parse_args()
    llm = kiln.load(a.model, gpu_memory=a.gpu_memory, max_context=a.max_context, expert_cache_slots=a.slots,
                    expert_policy="lfu", expert_home=a.home, quiet=False)
    dev = llm.engine.device
    link = {**link_gb_s(dev), "disk": disk_gb_s(llm.model.expert_store)}
    print(f"link: copy {link['copy']} GB/s, read in place {link['in_place']} GB/s; disk reads {link['disk']} GB/s",
          file=sys.stderr)
    prompt = torch.randint(0, llm.model.cfg.vocab_size, (a.prompt_length,),
                           generator=torch.Generator().manual_seed(0)).tolist()
    rows, store = [], llm.model.expert_store
    feed = (torch.randint(0, llm.model.cfg.vocab_size, (a.gen + 2,), generator=torch.Generator().manual_seed(1))
            .tolist() if a.feed == "random" else None)
    run(llm, prompt[:32], 4, feed)      # compiles: outside the timed runs
    for zc in a.zero_copy.split(","):
        profile = None
        for policy in a.policies.split(","):
            if policy == "static" and profile is None:
                continue
            rows.append(measure(llm, prompt, a.gen, zc == "on", policy, profile, link, feed))
            if policy == "lfu":
                profile = store.profile()
    command = command_line().replace("kiln ", "python3 bench/stream_policies.py ", 1)
    report = {**environment(dev), "date": now_iso(), "command": command,
              "model": a.model, "gpu_memory": a.gpu_memory, "max_context": a.max_context,
              "memory_plan": llm.memory.summary() if getattr(llm, "memory", None) else None,
              "home": store.home_tier, "layers": len(store.homes),
              "expert_bytes": next(iter(store.homes.values())).nbytes(),
              "link_gb_s": link, "prompt_length": a.prompt_length, "gen": a.gen, "feed": a.feed, "runs": rows,
              "same_tokens": len({tuple(r["tokens"]) for r in rows}) == 1}
    write_atomic(a.out, lambda f: f.write((json.dumps(report, indent=1) + "\n").encode()))


if __name__ == "__main__":
    main()
