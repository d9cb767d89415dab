"""The decode attention's gate verdicts on one shape, every GPU candidate: why a shape falls back to
the trusted scalar form (the 122B's h32kv2d256 did on 2026-12-02).

    PYTHONPATH=. python3 tools/diag_attn_decode.py ROWS H KV D

Then the trusted form, the scalar form at several key blocks and two candidates against softmax in f32.
"""

from __future__ import annotations

import sys
import time

import torch

from kiln.ops.attention import kernels
from kiln.tune import gate
from kiln.tune.device import device_info


def main() -> None:
    rows, h, kv, d = (int(a) for a in sys.argv[1:5])
    dev_t = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    op, dev = kernels.DECODE_OP, device_info(dev_t)
    s = kernels.DecodeShape(rows, h, kv, d)
    gen = torch.Generator(device=dev_t).manual_seed(0)
    cases = gate.trusted_cases(op, s, op.trusted(s, dev), torch.bfloat16, dev_t, gen)
    for v in op.candidates(s, dev):
        t0 = time.perf_counter()
        print(f"{v.name:24s} {gate.check(op, v, cases)} {time.perf_counter() - t0:.1f} s", flush=True)
    # every form against softmax(q k^T) v in f32: which side of a failed gate is wrong
    i = cases[0].inputs
    n = int(i["pos"].item()) + 1
    k = i["k_buf"][:n].float().repeat_interleave(h // kv, 1)
    w = torch.softmax(torch.einsum("hd,nhd->hn", i["q"][0].float(), k) * i["scale"], -1)
    want = torch.einsum("hn,nhd->hd", w, i["v_buf"][:n].float().repeat_interleave(h // kv, 1))
    scalars = [kernels.decode_trusted_variant(bn) for bn in (1, 2, 4, 8, 16)]
    for v in [op.trusted(s, dev)] + scalars + op.candidates(s, dev)[:2]:
        out = op.outputs(s, i)
        op.run(v, i, out, None)
        print(f"{v.name:24s} max |err| against f32 softmax: {(out['o'][0].float() - want).abs().max().item():.4g}")


if __name__ == "__main__":
    main()
