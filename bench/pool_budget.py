"""The --gpu-memory budget that leaves a batch pool of about PAGES KV pages for MODEL, from kiln's own
memory plan (kiln.api.memory_plan) on this machine's backend, no weight loaded: for runs that
must run short of pages (preemption) without guessing the core's size.

    python3 bench/pool_budget.py synth:qwen3.5-9b --pages 250 --max-context 4096 --max-batch 64
prints the budget in GB on stdout, the plan on stderr."""

from __future__ import annotations

import argparse
import sys

import torch

from kiln.api import memory_plan, pick_device, pick_dtype
from kiln.backends import get_ops
from kiln.weights import open_checkpoint


def pages_at(ckpt, ops, dtype, context: int, batch: int, gb: float) -> int:
    try:
        plan = memory_plan(ckpt, ops, dtype, context, gb, None, None, None, batch)
    except Exception:               # below the core: no pool at all
        return -1
    return getattr(plan, "batch_pages", 0) or 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("model")
    p.add_argument("--pages", type=int, required=True)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--max-batch", type=int, default=64)
    p.add_argument("--dtype", default="bf16")
    p.add_argument("--backend", default="cuda")
    a = p.parse_args()
    device = pick_device(None)
    ops, dtype = get_ops(a.backend, device), pick_dtype(a.dtype, device)
    ckpt = open_checkpoint(a.model)
    lo, hi = 1.0, 200.0
    for _ in range(40):             # the pages grow with the budget: bisect to a hundredth of a GB
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if pages_at(ckpt, ops, dtype, a.max_context, a.max_batch, mid) < a.pages else (lo, mid)
        if hi - lo < 0.01:
            break
    got = pages_at(ckpt, ops, dtype, a.max_context, a.max_batch, hi)
    print(f"--gpu-memory {hi:.2f}: {got} KV pages for --max-batch {a.max_batch} at --max-context {a.max_context} "
          f"({device}, {a.backend})", file=sys.stderr)
    print(f"{hi:.2f}")
    return 0


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    sys.exit(main())
