"""The routed experts' pair GEMVs reading their weights in place from pinned host memory (zero-copy
streaming, docs/streaming.md) against the same kernels on device stacks, by form (issue 21).

    PYTHONPATH=. python3 bench/zero_copy_gemv.py OUT.json [--shapes gemma4,qwen35moe] [--pairs 8]

For each shape's two stacks (an expert's gate|up, and down with its act(g) * u prologue; 4-bit g64),
each unsplit fma form that fits, and each home (host: pinned, read over the link; device: HBM; staged:
the misses copied from host into device scratch by kiln/ops/moe/staging.py's kernel first), one
launch over a token's `pairs` experts (distinct experts each repetition, cycling through all of them
so L2 holds none): microseconds and GB/s of weights read (bench/stream_policies.py measures the
link's own in-place read rate).
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kiln.fsutil import write_atomic
from kiln.ops.moe import staging
from kiln.ops.quant import kernels
from kiln.ops.quant.reference import quantize
from kiln.tools.benchutil import command_line, environment, now_iso

SHAPES = {"gemma4": (128, 2816, 704, "gelu_pytorch_tanh"), "qwen35moe": (256, 2048, 512, "silu")}


def stacks(e: int, h: int, i: int, pin: bool):
    g = torch.Generator().manual_seed(0)
    up = quantize((torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).bfloat16(), 4, 64)
    down = quantize((torch.randn(e, h, i, generator=g) * i ** -0.5).bfloat16(), 4, 64)
    if pin:
        return [w._with(w.packed.pin_memory(), w.scales.pin_memory(), w.biases.pin_memory()) for w in (up, down)]
    return [w.to("cuda") for w in (up, down)]


def nbytes(w) -> int:
    return (w.packed.nbytes + w.scales.nbytes + w.biases.nbytes) // w.packed.shape[0]


def time_launch(w, slot, mode: str, pairs: int, act: str | None, v) -> float:
    """Median microseconds of one launch over `pairs` experts of stack w, distinct experts each
    repetition: mode "device" reads them from `slot` (device stacks), "host" in place from w (pinned;
    rows -1 - e), "staged" after the staging kernel (kiln/ops/moe/staging.py) copied them from w into
    device scratch (both timed)."""
    e, n, k = w.shape
    xdiv = 1 if act else pairs
    x = torch.randn(pairs if act else 1, 2 * k if act else k, device="cuda").bfloat16()
    y = torch.empty(pairs, n, device="cuda", dtype=torch.bfloat16)
    rw = torch.rand(pairs, device="cuda").bfloat16() if act else None
    table = -1 - torch.arange(e, device="cuda", dtype=torch.int32)
    parts = [staging.words(t) for t in (w.packed, w.scales, w.biases)]
    scratch = w._with(*(torch.empty((pairs, *t.shape[1:]), dtype=t.dtype, device="cuda")
                        for t in (w.packed, w.scales, w.biases)))
    out = [staging.words(t) for t in (scratch.packed, scratch.scales, scratch.biases)]
    times = []
    for r in range(3 * (e // pairs)):
        idx = torch.arange(r * pairs, (r + 1) * pairs, device="cuda", dtype=torch.int32) % e
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        if mode == "staged":
            kernels.qgemv_pairs(x, slot, staging.stage(idx, table, parts, out), v, y, xdiv=xdiv, act=act, rw=rw,
                                host=scratch)
        else:
            host = mode == "host"
            kernels.qgemv_pairs(x, slot, -1 - idx if host else idx, v, y, xdiv=xdiv, act=act, rw=rw,
                                host=w if host else None)
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    times = times[e // pairs:]          # the first cycle compiles and warms
    return sorted(times)[len(times) // 2]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--shapes", default="gemma4,qwen35moe")
    ap.add_argument("--pairs", type=int, default=8)
    a = ap.parse_args()
    forms = [(bn, bw, w, pf) for bn in (16,) for bw in (8, 16, 32, 64, 128) for w in (4,)
             for pf in (False, True)]
    results = []
    for name in a.shapes.split(","):
        e, h, i, act = SHAPES[name]
        host, dev = stacks(e, h, i, pin=True), stacks(e, h, i, pin=False)
        for which, w, slot, pro in (("gate_up", host[0], dev[0], None), ("down", host[1], dev[1], act)):
            shape = kernels.QGemvShape(1, w.shape[1], w.shape[2], 4, 64)
            per = nbytes(w)
            for bn, bw, warps, pf in forms:
                v = kernels.fma_variant(bn, bw, warps, 1, pf)
                if not kernels.fits(shape, v.p):
                    continue
                row = {"shape": name, "stack": which, "form": v.name}
                for mode in ("host", "device", "staged"):
                    us = time_launch(w, slot, mode, a.pairs, pro, v)
                    row[f"{mode}_us"] = round(us, 1)
                    row[f"{mode}_gb_s"] = round(a.pairs * per / us / 1e3, 1)
                results.append(row)
                print(f"{name} {which:7s} {v.name:24s} host {row['host_us']:7.1f} us {row['host_gb_s']:5.1f} GB/s  "
                      f"device {row['device_us']:6.1f} us {row['device_gb_s']:6.1f} GB/s  "
                      f"staged {row['staged_us']:7.1f} us {row['staged_gb_s']:5.1f} GB/s", file=sys.stderr)
    best = {}
    for r in results:
        key = f"{r['shape']}.{r['stack']}"
        if key not in best or r["host_us"] < best[key]["host_us"]:
            best[key] = r
    report = {**environment(torch.device("cuda")), "date": now_iso(),
              "command": command_line().replace("kiln ", "python3 bench/zero_copy_gemv.py ", 1),
              "pairs": a.pairs, "results": results, "best_host": best}
    write_atomic(a.out, lambda f: f.write((json.dumps(report, indent=1) + "\n").encode()))


if __name__ == "__main__":
    main()
