"""Requests decoded together through LLM.generate_batch: output tok/s by batch size, and whether each
request's greedy tokens are the ones it gets alone.

    PYTHONPATH=. python3 bench/batch_decode.py OUT.json [--model synth:qwen3.5-9b] [--batches 1,8,32]
        [--prompt-length 512] [--gen 64] [--device cuda] [--dtype bf16]

Per batch size B: B random prompts, greedy, `--gen` tokens each; the wall time of the whole batch
(prefills one after another, then the shared decode steps), output tok/s = B * gen / wall, the
median request's prefill time; and for B up to 8, each request's tokens against its own
single-request run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import kiln
from kiln.sampling import SamplingParams
from kiln.tools.benchutil import environment, now_iso


def run(llm, prompts, gen: int) -> tuple[float, list]:
    params = [SamplingParams(max_new_tokens=gen) for _ in prompts]
    if llm.engine.device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = llm.generate_batch(prompts, params)
    return time.perf_counter() - t, out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="synth:qwen3.5-9b")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--prompt-length", type=int, default=512)
    ap.add_argument("--gen", type=int, default=64)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default=None)
    a = ap.parse_args()
    llm = kiln.load(a.model, device=a.device, dtype=a.dtype, quiet=False)
    g = torch.Generator().manual_seed(0)
    vocab = llm.model.cfg.vocab_size
    rows = []
    for b in map(int, a.batches.split(",")):
        prompts = [torch.randint(0, vocab, (a.prompt_length,), generator=g).tolist() for _ in range(b)]
        run(llm, prompts[:1], 4)                                  # warm-up (tunes the shapes it meets)
        wall, out = run(llm, prompts, a.gen)
        row = {"batch": b, "wall_s": round(wall, 3), "output_tok_s": round(b * a.gen / wall, 1),
               "first_token_s_median": round(statistics.median(c.stats.prefill_tok_s and
                                                               a.prompt_length / c.stats.prefill_tok_s
                                                               for c in out), 4)}
        if b <= 8:
            alone = [run(llm, [p], a.gen)[1][0].token_ids for p in prompts]
            row["same_as_alone"] = sum(c.token_ids == t for c, t in zip(out, alone))
        print(json.dumps(row), flush=True)
        rows.append(row)
    report = {"model": a.model, "dtype": str(llm.engine.dtype), "backend": llm.model.ops.name,
              "device": str(llm.engine.device), **environment(llm.engine.device), "date": now_iso(),
              "command": "python3 bench/batch_decode.py " + " ".join(f"{k}={v}" for k, v in vars(a).items()),
              "prompt_length": a.prompt_length, "gen": a.gen, "results": rows}
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
