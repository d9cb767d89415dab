"""GPU smoke run of the cuda backend: for each model spec, greedy tokens and decode speed with the
decode step as a CUDA graph, eagerly, and on the reference backend, from one random prompt.

Usage (GPU machine, repo root): PYTHONPATH=. python3 bench/gpu_smoke.py OUT.json SPEC [SPEC ...]
  SPEC = synth:NAME[:layers=N] or a path; env SMOKE_PROMPT (512), SMOKE_GEN (64), SMOKE_MODES.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback

import torch

import kiln
from kiln.benchutil import environment, now_iso


def run_mode(spec: str, mode: str, ids: list[int], gen: int) -> dict:
    t0 = time.perf_counter()
    llm = kiln.load(spec, device="cuda", dtype="bf16", backend="reference" if mode == "reference" else "cuda",
                    quiet=False, enforce_eager=(mode == "eager"))
    load_s = time.perf_counter() - t0
    out = {"mode": mode, "load_s": round(load_s, 2)}
    for rep in range(2):   # the first run warms the graph; the second is the one reported
        c = llm.generate(ids, max_new_tokens=gen, temperature=0)
        st = c.stats
        out.update(tokens=list(c.token_ids), prefill_tok_s=round(st.prefill_tok_s, 1),
                   decode_tok_s=round(st.decode_tok_s, 1))
    out["launches_per_token"] = llm.engine.launches_per_token
    out["graph_captures"] = None if llm.engine.graph is None else llm.engine.graph.captures
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return out


def main() -> int:
    path, specs = sys.argv[1], sys.argv[2:]
    n, gen = int(os.environ.get("SMOKE_PROMPT", 512)), int(os.environ.get("SMOKE_GEN", 64))
    modes = os.environ.get("SMOKE_MODES", "graph,eager,reference").split(",")
    report = {"date": now_iso(), **environment(torch.device("cuda")), "commit": os.environ.get("KILN_COMMIT"),
              "prompt": n, "gen": gen, "runs": []}
    for spec in specs:
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(100, 20000, (n,), generator=g).tolist()
        for mode in modes:
            try:
                r = run_mode(spec, mode, ids, gen)
            except Exception as e:   # record and go on: one failure must not lose the other runs
                r = {"mode": mode, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()[-3000:]}
            r["spec"] = spec
            report["runs"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k not in ("tokens", "trace")}), flush=True)
            if "trace" in r:
                print(r["trace"], file=sys.stderr)
        runs = [r for r in report["runs"] if r["spec"] == spec and "tokens" in r]
        for r in runs[1:]:
            same = next((i for i, (a, b) in enumerate(zip(runs[0]["tokens"], r["tokens"])) if a != b), len(r["tokens"]))
            print(f"{spec}: {runs[0]['mode']} vs {r['mode']}: first {same} tokens equal", flush=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
