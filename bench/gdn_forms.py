"""Time GDN prefill split forms that are not (yet) in the catalogue beside those that are, each gated
against the op's trusted variant first: which launch settings to offer the tuner next.

    PYTHONPATH=. python3 bench/gdn_forms.py OUT.json [--heads 16,32,48] [--rows 512,1024,4096]

Why outside the catalogue: a variant added to kiln/ops/gdn retires every shipped gdn choice (the
sources hash), so a candidate is measured here first and added, with a re-tune and a re-ship, only
when it wins. The extras vary what ncu showed limiting the split kernels on the H200 (bench/NOTES.md,
2026-12-03): the output kernel (182 registers at 8 warps: one program an SM), the state kernel
(112 KB of shared memory: one an SM; its pipeline stages), the state kernel's dv block.
Shapes: 16 key heads, dk = dv = 128, conv 4 (qwen3.5: 16 value heads 0.8b/2b, 32 the 9B/35B, 48 the 27B).
On CPU (TRITON_INTERPRET=1) it runs one small case as a smoke test; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import zlib

import torch

import kiln.backends.cuda  # noqa: F401  (registers every op)
from kiln.ops.gdn import kernels as gdn
from kiln.tools.benchutil import environment, now_iso
from kiln.tune import gate, timing
from kiln.tune.device import device_info

HK, DK, DV, K = 16, 128, 128, 4


def extras(dv: int) -> list:
    """Candidates beside the catalogue's split forms: each changes one launch setting of the best
    (split_h16w4_o128w8_pw4_bf16_inv-tf32_p2)."""
    v = gdn.split_variant
    return [v(16, 4, dv, 4, "bf16", pw=4, inv="tf32", prep2=True),           # output on 4 warps
            v(16, 4, dv, 8, "bf16", pw=4, inv="tf32", prep2=True, hs=2),     # state: 2 stages
            v(16, 4, dv, 8, "bf16", pw=4, inv="tf32", prep2=True, hs=1),     # state: no pipelining
            v(32, 4, dv, 8, "bf16", pw=4, inv="tf32", prep2=True),           # state: dv blocks of 32
            v(16, 8, dv, 8, "bf16", pw=4, inv="tf32", prep2=True),           # state on 8 warps
            v(16, 4, dv, 4, "bf16", pw=4, inv="tf32", prep2=True, hs=2)]


def case(shape, forms, dtype, device) -> dict:
    op = gdn.PREFILL
    label = op.shape_str(shape)
    gen = torch.Generator(device=device).manual_seed(zlib.crc32(label.encode()))
    trusted = op.trusted(shape, device_info(device))
    cases = gate.trusted_cases(op, shape, trusted, dtype, device, gen)
    first = op.inputs(shape, dtype, device, gen)
    out = op.outputs(shape, first)
    n = timing.set_count(timing.nbytes(first) + timing.nbytes(out), device)
    sets = [(first, out)] + [(i := op.inputs(shape, dtype, device, gen), op.outputs(shape, i)) for _ in range(n - 1)]
    rows = {}
    for v in forms:
        verdict = gate.check(op, v, cases)
        row = {"ok": verdict.ok, "err": verdict.err, "reason": verdict.reason}
        if verdict.ok:
            row["ms"] = timing.time_ms([lambda i=i, o=o, v=v: op.run(v, i, o, None) for i, o in sets], device)
        rows[v.name] = row
        said = f"{row['ms']:.4f} ms" if verdict.ok else f"FAILED {verdict.reason or verdict.err}"
        print(f"{label} {v.name}: {said}", file=sys.stderr)
    return {"shape": label, "forms": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out")
    ap.add_argument("--heads", default="16,32,48")
    ap.add_argument("--rows", default="512,1024,4096")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda" if cuda else "cpu")
    heads = [int(h) for h in a.heads.split(",")] if cuda else [4]
    rows = [int(r) for r in a.rows.split(",")] if cuda else [70]
    dk = DK if cuda else 16
    res = {"date": now_iso(), **environment(device), "command": " ".join(sys.argv), "cases": []}
    for hv in heads:
        for t in rows:
            shape = gdn.GdnShape(t, HK if cuda else 2, hv, dk, dk, K)
            forms = gdn.split_forms(dk) + extras(dk) if cuda else [gdn.split_forms(dk)[0]]
            res["cases"].append(case(shape, forms, torch.bfloat16, device))
    with open(a.out, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
