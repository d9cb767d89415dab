"""A prefill chunk's routed experts on quantised stacks, two ways, at several chunk lengths: packed (the
grouped kernels dequantising each tile as they load it, kiln/ops/quant/grouped.py) against the copies
(both stacks dequantised whole, one launch each, then the grouped kernels on the 16-bit copies), each
with the MoE family's default grouped form for the chunk. The outputs should be equal, up to the two
GEMMs' rounding where the compiler sums the two kernels' tiles in other orders (at most 2 ulp of a
pair's largest value, else exit 1); the times set MoeCuda's COPIES_FROM rule (the copies from that
many pairs an expert on average; None since packed won every length measured).

    PYTHONPATH=. python3 bench/qmoe_prefill.py OUT.json [--model qwen3.5-35b-a3b] [--bits 4] [--group 64]
        [--tokens 64,512,1000,4096]

Models: qwen3.5-35b-a3b, qwen3.5-122b-a10b, qwen3.5-397b-a17b, gemma4-26b-a4b (one layer's stacks;
the 397B's 2-bit copies take 12.9 GB). Tokens route uniformly at random (a synthesized model's
routing). Times are medians of CUDA-graph replays (kiln.tune.timing); the copies' time includes
their two dequantising launches. On the CPU (the interpreter) a tiny shape and one length: a smoke
run, its times mean nothing."""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kiln.fsutil import write_atomic
from kiln.ops.moe import kernels as mk
from kiln.ops.quant import grouped as qgrouped
from kiln.ops.quant.cuda import dequantised_stacks
from kiln.tools.benchutil import environment, now_iso
from kiln.tune import timing
from kiln.tune.device import device_info

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from qmoe_forms import TINY, expert_shape, stack  # noqa: E402


class Plain:
    """What dequantised_stacks asks of its ops: the quant family on, nothing else."""

    @staticmethod
    def on(family, x) -> bool:
        return True


def stack_bytes(w) -> int:
    return w.nbytes


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen3.5-35b-a3b")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=64)
    ap.add_argument("--tokens", default="64,512,1000,4096")
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev, gen = device_info(device), torch.Generator(device=device).manual_seed(0)
    gpu = device.type == "cuda"
    e, top, h, i, act = expert_shape(args.model) if gpu else TINY
    gate_up = stack(e, 2 * i, h, args.bits, args.group, device, gen)
    down = stack(e, h, i, args.bits, args.group, device, gen)
    packed_bytes = stack_bytes(gate_up) + stack_bytes(down)
    copy_bytes = e * (2 * i * h + h * i) * 2
    rows = []
    for t in [int(s) for s in args.tokens.split(",")] if gpu else [16]:
        shape = mk.MoeShape(t, e, top, h, i, act)
        v = mk.OP.default(shape, dev)
        x = torch.randn(t, h, generator=gen, device=device).bfloat16()
        idx = torch.rand(t, e, generator=gen, device=device).argsort(dim=1)[:, :top].contiguous()
        rw = (torch.rand(t * top, generator=gen, device=device) + 0.1).bfloat16()
        y_packed = torch.empty((t * top, h), dtype=torch.bfloat16, device=device)
        y_copies = torch.empty_like(y_packed)

        def packed():
            qgrouped.run(x, idx, rw, gate_up, down, act, v.p, y_packed)

        def copies():
            gu, dn = dequantised_stacks(Plain, x, gate_up, down)
            mk.run_grouped(x, idx, rw, gu, dn, act, v.p, y_copies)

        packed()
        copies()
        equal = bool(torch.equal(y_packed, y_copies))
        diff = (y_packed.float() - y_copies.float()).abs().amax(dim=1)
        row_max = y_copies.float().abs().amax(dim=1).clamp_min(1e-6)
        ulps = float((diff / (2.0 ** (torch.floor(torch.log2(row_max)) + 1) * 2 ** -8)).max())
        ms_packed = timing.time_ms([packed], device)
        ms_copies = timing.time_ms([copies], device)
        row = {"tokens": t, "pairs_an_expert": t * top / e, "form": v.name, "equal": equal,
               "max_ulps_of_row_max": ulps, "bit_equal_fraction": float((y_packed == y_copies).float().mean()),
               "packed_ms": ms_packed, "copies_ms": ms_copies,
               "packed_bound_ms": packed_bytes / 4.27e12 * 1e3,
               "copies_bound_ms": (packed_bytes + 2 * copy_bytes) / 4.27e12 * 1e3}
        rows.append(row)
        print(f"{t} tokens ({row['pairs_an_expert']:.1f} pairs an expert, {v.name}): packed {ms_packed:.3f} ms, "
              f"copies {ms_copies:.3f} ms, equal {equal}", file=sys.stderr)
    result = {"model": args.model if gpu else "tiny", "experts": e, "top_k": top, "hidden": h, "ffn": i,
              "act": act, "bits": args.bits, "group": args.group, "rows": rows, "date": now_iso(),
              "command": " ".join(sys.argv), **environment(device)}
    write_atomic(args.out, lambda f: f.write(json.dumps(result, indent=1).encode()))
    return 0 if all(r["max_ulps_of_row_max"] <= 2 for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
