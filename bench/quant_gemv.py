"""Decode projections on quantised weights against their 16-bit GEMV and the HBM bound.

    PYTHONPATH=. python3 bench/quant_gemv.py OUT.json [--bits 4,8,2,3] [--group 64] [--models qwen3.5-9b]

For Qwen3.5-0.8B's, -9B's and -27B's decode projections (one row: gate|up, down, the attention and GDN input
projections, the LM head), tunes with kiln's own tuner (every candidate gated against the trusted
form, then timed on rotating input sets larger than L2) the quantised GEMV (op qgemv) at each bits
value and the bf16 GEMV (op gemm, one row), and reports each winner's time, the bytes it reads
(packed words, scales, biases, x, y) and the fraction of the 4.27 TB/s bound that makes.
"""

from __future__ import annotations

import argparse
import json

import torch

from kiln.ops.gemm import gemm
from kiln.ops.quant import kernels
from kiln.tools.benchutil import environment, now_iso
from kiln.tune.tuner import Tuner, Workload

HBM = 4.27e12      # bytes/s, measured on our H200 (docs: the floor is bytes / 4.27 TB/s)
SHAPES = {          # (n, k) of each one-row projection
    "qwen3.5-0.8b": [(7168, 1024), (1024, 3584), (6144, 1024), (248320, 1024)],
    "qwen3.5-9b": [(24576, 4096), (4096, 12288), (12352, 4096), (10240, 4096), (4096, 4096), (248320, 4096)],
    "qwen3.5-27b": [(34816, 5120), (5120, 17408), (16480, 5120), (14336, 5120), (5120, 6144), (248320, 5120)],
}


def q_bytes(n: int, k: int, bits: int, group: int) -> int:
    return n * k * bits // 8 + 2 * 2 * n * (k // group) + 2 * (k + n)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--bits", default="4,8,2,3")
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--models", default=",".join(SHAPES), help="whose shapes (default: all)")
    ap.add_argument("--forms", default="", help="only the qgemv variants whose names start so (comma-separated)")
    ap.add_argument("--shapes", default="", help="NxK,... instead of the models' shapes")
    ap.add_argument("--no-bf16", action="store_true", help="skip the 16-bit GEMV beside each shape (quicker)")
    a = ap.parse_args()
    if a.forms:     # fewer candidates to compile and time
        kernels.OP.only = tuple(a.forms.split(","))
    bits = [int(b) for b in a.bits.split(",")]
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    shapes = sorted({s for m in a.models.split(",") for s in SHAPES[m]}) if dev.type == "cuda" else [(64, 256)]
    if a.shapes:
        shapes = [tuple(int(d) for d in s.split("x")) for s in a.shapes.split(",")]
    work = [] if a.no_bf16 else [Workload(gemm.OP, gemm.GemmShape(1, n, k)) for n, k in shapes]
    work += [Workload(kernels.OP, kernels.QGemvShape(1, n, k, b, a.group)) for n, k in shapes for b in bits]
    _, report = Tuner(dev, torch.bfloat16, retune=True, budget_s=3600).tune(work)
    best = {label: (name, ms) for label, name, ms, _ in report.rows}
    rows = []
    for n, k in shapes:
        name16, ms16 = best.get(Workload(gemm.OP, gemm.GemmShape(1, n, k)).label, (None, None))
        for b in ([] if a.no_bf16 else [16]) + bits:
            label = (Workload(gemm.OP, gemm.GemmShape(1, n, k)) if b == 16 else
                     Workload(kernels.OP, kernels.QGemvShape(1, n, k, b, a.group))).label
            name, ms = best[label]
            nbytes = 2 * (n * k + k + n) if b == 16 else q_bytes(n, k, b, a.group)
            rows.append({"n": n, "k": k, "bits": b, "variant": name, "ms": ms, "bytes": nbytes,
                         "bound_ms": nbytes / HBM * 1e3, "of_bound": (nbytes / HBM * 1e3) / ms if ms else None,
                         "speedup_vs_bf16": ms16 / ms if ms and ms16 else None})
            print(f"{n:>6} x {k:<5} {b:>2}-bit  {ms or float('nan'):.4f} ms  {rows[-1]['of_bound'] or 0:.0%} of bound"
                  f"  x{rows[-1]['speedup_vs_bf16'] or 0:.2f} vs bf16  ({name})")
    out = {"command": "bench/quant_gemv.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items() if k != "out"),
           "date": now_iso(), **environment(dev), "group": a.group, "compile_s": report.compile_s,
           "tune_s": report.tune_s, "rows": rows}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
