"""Where a batched sampled draw's time goes (kiln.sampling.sample_rows), on one GPU: the whole draw of
B rows against its parts, each timed alone on the same logits. Why: bench-serve's sampled runs
(temperature 0.8, top-p 0.95) lose ~1.8 ms a step at 32 rows of the 9B against greedy (bench/NOTES.md).

    PYTHONPATH=. python3 bench/sampler_gpu.py OUT.json [--rows 1,8,32,64] [--vocab 248320]
        [--temperature 0.8] [--top-p 0.95] [--iters 50]

Each part: GPU time (CUDA events around --iters calls, after 5 warm-up calls, per call) and host time
(the wall time of issuing those calls, per call: what the batch loop spends before it can launch the
next step). Logits ~ N(0, 2^2), near-flat like a random model's, so top-p keeps most of the
vocabulary. Parts: `full` (sample_rows, every row seeded), `process` (temperature and top-p),
`sort_stable` / `sort` (torch.sort of the rows), `topk_1024`, `cumsum` (_row_cumsum of the sorted
probabilities), `noise_rows` (one exponential_ a row from its own generator, as sample_rows draws),
`noise_one` (one exponential_ over every row), `draw` (softmax, divide, argmax) and `greedy` (argmax).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kiln import sampling  # noqa: E402
from kiln.tools.benchutil import command_line, environment, now_iso  # noqa: E402


def timed(fn, iters: int) -> dict:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    gpu, host = [], []
    for _ in range(3):
        t0 = time.perf_counter()
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        host.append((time.perf_counter() - t0) / iters * 1000)
        torch.cuda.synchronize()
        gpu.append(start.elapsed_time(end) / iters)
    return {"gpu_ms": round(statistics.median(gpu), 4), "host_ms": round(statistics.median(host), 4)}


def parts(rows: int, vocab: int, temperature: float, top_p: float, iters: int, dev=torch.device("cuda"),
          timer=timed) -> dict:
    logits = torch.randn(rows, vocab, device=dev, generator=torch.Generator(dev).manual_seed(rows)) * 2
    params = [sampling.SamplingParams(temperature=temperature, top_p=top_p, seed=j) for j in range(rows)]
    samplers = [sampling.Sampler(p, dev) for p in params]
    none = [None] * rows
    scores, _ = sampling._process(logits, params, none)
    sorted_probs = torch.softmax(torch.sort(scores, dim=-1, stable=True).values, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    q = torch.empty_like(probs)

    def noise_rows():
        for j, s in enumerate(samplers):
            q[j].exponential_(1.0, generator=s.generator)

    cases = {
        "full": lambda: sampling.sample_rows(logits, samplers, none),
        "process": lambda: sampling._process(logits, params, none),
        "sort_stable": lambda: torch.sort(scores, dim=-1, stable=True),
        "sort": lambda: torch.sort(scores, dim=-1),
        "topk_1024": lambda: torch.topk(scores, min(1024, vocab), dim=-1),
        "cumsum": lambda: sampling._row_cumsum(sorted_probs),
        "noise_rows": noise_rows,
        "noise_one": lambda: q.exponential_(1.0),
        "draw": lambda: torch.argmax(torch.softmax(scores, dim=-1) / q, dim=-1),
        "greedy": lambda: torch.argmax(logits, dim=-1),
    }
    return {name: timer(fn, iters) for name, fn in cases.items()}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--rows", type=lambda v: [int(r) for r in v.split(",")], default=[1, 8, 32, 64],
                   help="comma list of row counts")
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--iters", type=int, default=50)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("sampler_gpu: needs a CUDA GPU")
    report = {"environment": environment(torch.device("cuda")), "date": now_iso(), "command": command_line(),
              "settings": {"vocab": a.vocab, "temperature": a.temperature, "top_p": a.top_p, "iters": a.iters},
              "rows": {}}
    for rows in a.rows:
        report["rows"][rows] = parts(rows, a.vocab, a.temperature, a.top_p, a.iters)
        line = ", ".join(f"{k} {v['gpu_ms']:.3f}/{v['host_ms']:.3f}" for k, v in report["rows"][rows].items())
        print(f"[sampler_gpu] {rows} rows (gpu/host ms): {line}", file=sys.stderr)
        tmp = Path(f"{a.out}.tmp")
        tmp.write_text(json.dumps(report, indent=1))
        tmp.replace(a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
