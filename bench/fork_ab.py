"""A/B of ops.fork at decode (kiln/ops/fork.py): one load, the decode graph captured again for each
mode, the modes alternated so that drift of the machine shows.

    PYTHONPATH=. python3 bench/fork_ab.py MODEL OUT.json [PROMPT_TOKENS] [GEN]

For each run: KILN_FORK set (1: the branches forked, 0: in order), a fresh DecodeGraph, a random
prompt of PROMPT_TOKENS (default 512) prefilled, GEN (default 128) greedy tokens by the engine's
pipelined loop (as `kiln bench` decodes), their tok/s, the graph replayed back to back (ms a step, no
host in the loop) and the launches a token. The tokens of every run must agree (same kernels, only
their overlap differs): the JSON says whether they did.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

import kiln
from kiln.backends.graphs import DecodeGraph
from kiln.tools.benchutil import environment, now_iso

MODES = ("1", "0", "1", "0")


def run(llm, prompt: list[int], gen: int, mode: str) -> dict:
    os.environ["KILN_FORK"] = mode
    eng = llm.engine
    eng.graph = DecodeGraph(llm.model, eng.device)       # captured again under this mode
    state = eng.new_state(len(prompt) + gen + 16)
    tok = int(torch.argmax(eng.prefill(prompt, state)))
    pos = len(prompt)
    for _ in range(3):                                    # eager step, capture, a replay
        tok = int(torch.argmax(eng.decode_step(tok, pos, state)))
        pos += 1
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    tokens = list(eng.greedy_tokens(tok, pos, state, gen))
    torch.cuda.synchronize()
    s = time.perf_counter() - t0
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        eng.graph.graph.replay()
    end.record()
    end.synchronize()
    return {"fork": mode, "decode_tok_s": round(gen / s, 1), "graph_ms": round(start.elapsed_time(end) / 50, 4),
            "launches": eng.launches_per_token, "tokens": tokens}


def main(model: str, out: str, prompt_tokens: int = 512, gen: int = 128) -> None:
    llm = kiln.load(model, dtype="bf16")
    gen_ = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, llm.model.cfg.vocab_size, (prompt_tokens,), generator=gen_).tolist()
    runs = [run(llm, prompt, gen, m) for m in MODES]
    same = all(r["tokens"] == runs[0]["tokens"] for r in runs)
    res = {"date": now_iso(), **environment(llm.engine.device), "command": " ".join(sys.argv), "model": model,
           "prompt_tokens": prompt_tokens, "gen": gen, "same_tokens": same,
           "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs], "tokens": runs[0]["tokens"]}
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(json.dumps({k: v for k, v in res.items() if k != "tokens"}, indent=1))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], *(int(a) for a in sys.argv[3:]))
