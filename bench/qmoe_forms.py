"""Would tuning the quantised routed experts' decode GEMVs pay? quant_moe (kiln/ops/quant/cuda.py) runs
its two pair launches (every (token, expert) pair's gate|up GEMV, then the down GEMV with act(g) * u
and the routing weight) on QGemvOp's untuned default made unsplit (an fma form without split-K).
This times every unsplit fma form of both launches at one token on a model's expert shapes, each
first checked against dequantize + matmul in f32, and prints the default's time beside the best and
the bytes bound.

    PYTHONPATH=. python3 bench/qmoe_forms.py OUT.json [--model qwen3.5-35b-a3b] [--bits 4] [--group 64]

Models: qwen3.5-35b-a3b, qwen3.5-122b-a10b, qwen3.5-397b-a17b, gemma4-26b-a4b. Routing sets are
rotated (kiln.tune.timing) with distinct experts each, so the experts come from DRAM as in decode.
On the CPU (the interpreter) it runs a tiny shape and its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

from kiln.fsutil import write_atomic
from kiln.ops.quant import kernels as qk
from kiln.ops.quant.cuda import unsplit
from kiln.ops.quant.kernels import QGemvShape
from kiln.tools.benchutil import environment, now_iso
from kiln.tune import timing
from kiln.tune.device import device_info
from kiln.weights.quantized import dequantize, quantize
from kiln.weights.synth import synth_config

TINY = (8, 2, 256, 256, "silu")         # experts, top-k, hidden, expert FFN, act: the interpreter's shape
SETS = 16


def expert_shape(model: str) -> tuple:
    c = synth_config(model)
    c = c.get("text_config", c)
    act = c.get("hidden_act") or c.get("hidden_activation")
    return c["num_experts"], c.get("num_experts_per_tok") or c["top_k_experts"], c["hidden_size"], \
        c["moe_intermediate_size"], act


def stack(e: int, n: int, k: int, bits: int, group: int, dev, gen) -> qk.QuantizedWeight:
    """[e, n, k] random weights quantised a few experts at a time (the 397B's stack is 4.3 G values)."""
    parts = [quantize((torch.randn(min(16, e - i), n, k, generator=gen, device=dev) * k ** -0.5).bfloat16(),
                      bits, group) for i in range(0, e, 16)]
    return parts[0]._with(*(torch.cat([getattr(p, a) for p in parts]) for a in ("packed", "scales", "biases")))


def forms(shape: QGemvShape, dev) -> list:
    cat = qk.CPU_FMA if dev.capability is None else qk.GPU_FMA
    return qk.fma_forms(shape, [f for f in cat if f[3] == 1])


def check(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="qwen3.5-35b-a3b")
    ap.add_argument("--bits", type=int, default=4)
    ap.add_argument("--group", type=int, default=64)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev, gen = device_info(device), torch.Generator(device=device).manual_seed(0)
    e, top, h, i, act = expert_shape(args.model) if device.type == "cuda" else TINY
    gate_up, down = stack(e, 2 * i, h, args.bits, args.group, device, gen), stack(e, h, i, args.bits, args.group,
                                                                              device, gen)
    perm = torch.randperm(e, generator=gen, device=device)
    sets = []
    for s in range(SETS if device.type == "cuda" else 1):
        idx = perm.roll(-s * top)[:top].contiguous()
        w = torch.rand(top, generator=gen, device=device) + 0.1
        sets.append({"x": torch.randn(1, h, generator=gen, device=device).bfloat16(), "idx": idx,
                     "rw": (w / w.sum()).bfloat16(), "gu": torch.empty(top, 2 * i, dtype=torch.bfloat16, device=device),
                     "y": torch.empty(top, h, dtype=torch.bfloat16, device=device)})
    d0 = sets[0]
    wgu = torch.stack([dequantize(gate_up._with(gate_up.packed[j], gate_up.scales[j], gate_up.biases[j])).float()
                       for j in d0["idx"].tolist()])
    wdn = torch.stack([dequantize(down._with(down.packed[j], down.scales[j], down.biases[j])).float()
                       for j in d0["idx"].tolist()])
    want_gu = torch.einsum("pnk,k->pn", wgu, d0["x"][0].float())
    launches = {
        "gate_up": (QGemvShape(1, 2 * i, h, args.bits, args.group),
                    lambda d, v: qk.qgemv_pairs(d["x"], gate_up, d["idx"], v, d["gu"], xdiv=top)),
        "down": (QGemvShape(1, h, i, args.bits, args.group),
                 lambda d, v: qk.qgemv_pairs(d["gu"], down, d["idx"], v, d["y"], xdiv=1, act=act, rw=d["rw"])),
    }
    result = {"model": args.model if device.type == "cuda" else "tiny", "experts": e, "top_k": top, "hidden": h,
              "ffn": i, "act": act, "bits": args.bits, "group": args.group, "launches": {}}
    for name, (shape, run) in launches.items():
        default = unsplit(qk.OP.default(shape, dev), shape)      # quant_moe's choice
        rows, weight_bytes = [], top * (shape.n * shape.k * args.bits // 8 + 2 * 2 * shape.n * shape.k // args.group)
        for v in dict.fromkeys([default] + forms(shape, dev)):
            try:
                for d in sets:
                    run(d, v)
                if name == "gate_up":
                    err = check(d0["gu"], want_gu)
                else:
                    g, u = want_gu.bfloat16().float().chunk(2, dim=1)
                    mid = (torch.nn.functional.silu(g) if act == "silu" else
                           torch.nn.functional.gelu(g, approximate="tanh")) * u
                    want = torch.einsum("pnk,pk->pn", wdn, mid.bfloat16().float()) * d0["rw"].float()[:, None]
                    err = check(d0["y"], want)
                ms = timing.time_ms([lambda d=d: run(d, v) for d in sets], device)
                rows.append({"variant": v.name, "us": ms * 1e3, "rel_err": err, "ok": err < 2 ** -5})
            except Exception as ex:  # noqa: BLE001  (a form that fails is recorded, not fatal)
                rows.append({"variant": v.name, "error": f"{type(ex).__name__}: {str(ex)[:160]}"})
        good = [r for r in rows if r.get("ok")]
        best = min(good, key=lambda r: r["us"]) if good else None
        result["launches"][name] = {"shape": qk.OP.shape_str(shape), "default": default.name, "forms": rows,
                                    "best": best and best["variant"], "bound_us": weight_bytes / 4.27e12 * 1e6}
        dflt = next((r for r in rows if r["variant"] == default.name and "us" in r), None)
        print(f"{name} {qk.OP.shape_str(shape)} x{top}: default {default.name} "
              f"{dflt['us'] if dflt else float('nan'):.1f} us, best {best and best['variant']} "
              f"{best['us'] if best else float('nan'):.1f} us, bytes bound "
              f"{result['launches'][name]['bound_us']:.1f} us", file=sys.stderr)
    result.update(date=now_iso(), command=" ".join(sys.argv), **environment(device))
    write_atomic(args.out, lambda f: f.write(json.dumps(result, indent=1).encode()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
