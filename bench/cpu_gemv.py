"""The CPU backend's decode-row forms on the bundled models' projection shapes, one row each.

    python bench/cpu_gemv.py OUT.json [--threads 2]

For each (n, k, bits) of gemma3-270m's and smollm2-135m's GGUF projections (GGUF-like weights:
f16 scales, bias -2^(bits-1) * scale as Q8_0 / Q5_0 / Q4_0 have), times the reference (dequantise
per call, F.linear in f32), the f16 copy, torch's int4 kernel where it fits and the compiled GEMV
(kiln/ops/quant/cgemv.py); reports each form's median ms over rotating weight copies larger than the
last-level cache (a decode step reads its weights from memory), its relative error against the f64
product, and the GB/s of the bytes it reads.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from kiln.ops.quant import cgemv
from kiln.ops.quant import cpu as qcpu
from kiln.tools.benchutil import command_line, environment, now_iso
from kiln.weights.quantized import QuantizedWeight, dequantize, pack

SHAPES = {   # (n, k, bits)
    "gemma3-270m": [(262144, 640, 8), (4096, 640, 5), (1536, 640, 5), (640, 2048, 4), (640, 1024, 4)],
    "smollm2-135m": [(49152, 576, 8), (3072, 576, 4), (576, 1536, 4), (960, 576, 4)],
}
ROTATE_BYTES = 256 << 20     # weight copies cycled so that each call reads from memory


def gguf_like(n: int, k: int, bits: int, seed: int) -> QuantizedWeight:
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.int32)
    d = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).half().float()
    return QuantizedWeight(pack(q, bits), d, -(1 << (bits - 1)) * d, bits, 32, torch.float32)


def forms(w: QuantizedWeight) -> dict:
    out = {"reference": (lambda x, d: torch.nn.functional.linear(x, dequantize(d)), lambda: w),
           "dense16": (qcpu.dense16_linear, lambda: qcpu.dense16(w))}
    if qcpu.int4_fits(w):
        out["int4"] = (qcpu.int4_linear, lambda: qcpu.to_int4(w))
    if cgemv.fits(w):
        out["cgemv"] = (cgemv.c_linear, lambda: cgemv.to_c(w))
    return out


def nbytes(copy) -> int:
    if isinstance(copy, torch.Tensor):
        return copy.numel() * copy.element_size()
    if isinstance(copy, QuantizedWeight):
        return copy.nbytes
    return sum(t.numel() * t.element_size() for t in vars(copy).values() if isinstance(t, torch.Tensor))


def time_form(run, make, x, reps: int = 30) -> tuple[float, object]:
    first = make()
    copies = [first] + [make() for _ in range(max(0, min(8, ROTATE_BYTES // max(nbytes(first), 1)) - 1))]
    for c in copies:
        run(x, c)
    times = []
    for i in range(reps):
        t = time.perf_counter()
        run(x, copies[i % len(copies)])
        times.append(time.perf_counter() - t)
    return statistics.median(times), first


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    rows = []
    for model, shapes in SHAPES.items():
        for n, k, bits in shapes:
            w = gguf_like(n, k, bits, n + k)
            x = torch.randn(1, k)
            want = (x.double() @ dequantize(w).double().t())
            for name, (run, make) in forms(w).items():
                sec, copy = time_form(run, make, x, reps=5 if name == "reference" and n * k > 1 << 24 else 30)
                err = ((run(x, copy).double() - want).abs().max() / want.abs().max()).item()
                row = {"model": model, "n": n, "k": k, "bits": bits, "form": name, "ms": round(sec * 1e3, 4),
                       "rel_err": err, "bytes": nbytes(copy), "gb_s": round(nbytes(copy) / sec / 1e9, 2)}
                rows.append(row)
                print(f"{model} {n}x{k} q{bits}: {name:9s} {row['ms']:8.3f} ms  {row['gb_s']:6.1f} GB/s  "
                      f"err {err:.1e}", file=sys.stderr)
    report = {"engine": "kiln", "device": "cpu", **environment(torch.device("cpu")), "threads": a.threads,
              "cgemv": cgemv.available(), "date": now_iso(), "command": command_line(), "results": rows}
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
