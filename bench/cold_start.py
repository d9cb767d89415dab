"""Where a cold start's time goes: one kiln.load of a model with whatever tune and Triton caches the
environment points at (empty ones for a cold start), then its first prefill.

    KILN_CACHE_DIR=/tmp/c TRITON_CACHE_DIR=/tmp/c/triton \
        PYTHONPATH=. python3 bench/cold_start.py OUT.json [--model synth:qwen3.5-9b] [--length 1000]

Reports the import time, the load's stages, and inside the tune stage the seconds spent compiling in
worker processes, compiling (or loading from Triton's cache) in this process, gating shipped choices,
and measuring; plus the main process's top functions by cumulative time (cProfile) as text beside the
JSON, so the next change aims at the largest part.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
import time
from collections import defaultdict

T0 = time.perf_counter()
import torch  # noqa: E402

import kiln  # noqa: E402
from kiln.tools.benchutil import environment, now_iso  # noqa: E402
from kiln.tune import gate, tuner  # noqa: E402

IMPORT_S = time.perf_counter() - T0
SPENT: dict[str, float] = defaultdict(float)
COUNT: dict[str, int] = defaultdict(int)


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(owner, name: str, label: str) -> None:
    """Wrap owner.name so its calls add their seconds (device synchronised) to SPENT[label]."""
    inner = getattr(owner, name)

    def wrapper(*a, **k):
        t = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            sync()
            SPENT[label] += time.perf_counter() - t
            COUNT[label] += 1
    setattr(owner, name, wrapper)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("out")
    p.add_argument("--model", default="synth:qwen3.5-9b")
    p.add_argument("--length", type=int, default=1000)
    p.add_argument("--device", default="cuda")
    a = p.parse_args()
    timed(tuner.Tuner, "compile_in_workers", "compile in workers")
    timed(tuner.Tuner, "compile_all", "compile (all)")
    timed(tuner.Tuner, "gated", "gate shipped/pinned")
    timed(tuner.Tuner, "measure", "gate+time measured")
    timed(gate, "trusted_cases", "trusted cases")
    prof = cProfile.Profile()
    t = time.perf_counter()
    llm = prof.runcall(kiln.load, a.model, device=a.device, dtype="bf16", quiet=False)
    load_s = time.perf_counter() - t
    ids = torch.randint(0, llm.model.cfg.vocab_size, (a.length,), generator=torch.Generator().manual_seed(0))
    state = llm.engine.new_state(a.length + 8)
    sync()
    t = time.perf_counter()
    prof.runcall(llm.engine.prefill, ids.tolist(), state)
    sync()
    first_prefill_s = time.perf_counter() - t
    text = io.StringIO()
    st = pstats.Stats(prof, stream=text)
    st.sort_stats("cumulative").print_stats(60)
    st.sort_stats("tottime").print_stats(30)
    with open(a.out.removesuffix(".json") + "_profile.txt", "w") as f:
        f.write(text.getvalue())
    weights = llm.load_stages.get("weights", 0.0)
    report = {**environment(torch.device(a.device)), "date": now_iso(), "command": " ".join(sys.argv), "model": a.model,
              "import_s": round(IMPORT_S, 3), "load_s": round(load_s, 3), "load_stages": llm.load_stages,
              "first_prefill_s": round(first_prefill_s, 3),
              "first_token_less_weights_s": round(IMPORT_S + load_s + first_prefill_s - weights, 3),
              "tune_parts_s": {k: round(v, 3) for k, v in SPENT.items()}, "tune_parts_calls": dict(COUNT)}
    print(json.dumps(report, indent=1))
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
