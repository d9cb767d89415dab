"""kiln's routed-experts kernels against torch._grouped_mm and the reference op, at qwen3.5-35b-a3b's shapes
(or gemma4-26b-a4b's).

The peers: torch._grouped_mm (two grouped GEMMs over rows sorted by expert, where this torch has it)
and the reference backend's op (a Python loop over the hit experts, cuBLAS GEMMs). Shapes: E=256,
k=8, H=2048, I=512 (the expert FFN), silu, bf16, at T = 1, 512 and 8192 tokens.

    PYTHONPATH=. python3 bench/moe_gpu.py OUT.json [MODEL] [TOKENS]   (GPU; about two minutes)

MODEL: qwen3.5-35b-a3b (default) or gemma4-26b-a4b (E=128, k=8, H=2816, I=704, gelu_pytorch_tanh);
TOKENS: a comma list (default 1,512,8192).

Each kiln variant is first checked against the reference (max error, bit-equal fraction), then
timed with kiln.tune.timing (CUDA-graph replays, median) over input sets whose routing differs, so
that decode reads its experts from DRAM and not from L2. The reference is timed eagerly (its
torch.unique syncs the host). Prefill reports TFLOP/s (6 T k H I flops); T = 1 reports the GB/s of
expert weights read (k experts of 3 H I bf16 values). A case that fails is recorded, not fatal.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback

import torch

from kiln.backends.reference import ReferenceOps
from kiln.fsutil import write_atomic
from kiln.ops.moe import kernels as moe
from kiln.tools.benchutil import environment, now_iso
from kiln.tune import timing
from kiln.tune.device import device_info

SHAPES = {"qwen3.5-35b-a3b": (256, 8, 2048, 512, "silu"),       # experts, top-k, hidden, expert FFN, act
          "gemma4-26b-a4b": (128, 8, 2816, 704, "gelu_pytorch_tanh")}
E, K, H, FFN, ACT = SHAPES["qwen3.5-35b-a3b"]
TOKENS = (1, 512, 8192)
SETS = 16                  # routings rotated through at T = 1: 16 x 8 distinct experts (768 MB) pass L2
# (prefill reads every expert each call: two sets are enough)
BUDGET_S = 100.0           # stop adding variants here, so the whole run stays near two minutes
DEV = torch.device("cuda")


def routings(t: int, gen: torch.Generator) -> list[dict]:
    """Input sets (x, idx, weights); at T = 1 each set's experts differ from the others'."""
    out = []
    perm = torch.randperm(E, generator=gen, device=DEV)
    for s in range(SETS if t == 1 else 2):
        if t == 1:
            idx = perm.roll(-s * K)[:K][None]
        else:
            idx = torch.rand(t, E, generator=gen, device=DEV).argsort(dim=1)[:, :K]
        w = torch.rand(t, K, generator=gen, device=DEV) + 0.1
        out.append({"x": torch.randn(t, H, generator=gen, device=DEV).bfloat16(), "idx": idx,
                    "weights": (w / w.sum(1, keepdim=True)).bfloat16()})
    return out


def events_ms(fn, reps: int = 10) -> float:
    """Eager timing (the reference syncs the host): warm-up, then the median of `reps` calls."""
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def grouped_mm_moe(x, idx, weights, gate_up, down):
    """A torch baseline with the same layout: rows sorted by expert, two grouped GEMMs
    (torch._grouped_mm), act * up and the weighting in torch, an index_add combine."""
    order, starts = moe.sort_pairs(idx, E)
    offs = starts[1:].to(torch.int32)
    rows = x[order // K]
    gu = torch._grouped_mm(rows, gate_up.transpose(1, 2), offs=offs)
    g, u = gu.chunk(2, dim=-1)
    h = (torch.nn.functional.silu(g) if ACT == "silu" else torch.nn.functional.gelu(g, approximate="tanh")) * u
    y = torch._grouped_mm(h, down.transpose(1, 2), offs=offs) * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, order // K, y)


def flops_or_bytes(t: int, ms: float) -> dict:
    if t == 1:
        return {"gb_s": round(K * 3 * H * FFN * 2 / ms / 1e6, 1)}
    return {"tflops": round(6 * t * K * H * FFN / ms / 1e9, 1)}


def accuracy(got: torch.Tensor, want: torch.Tensor) -> dict:
    err = (got.float() - want.float()).abs().max().item()
    equal = round(float((got == want).float().mean()), 5)
    return {"max_err": err, "scale": want.abs().max().item(), "bit_equal": equal}


def bench_kiln(t, sets, gate_up, down, want, t_start) -> list[dict]:
    shape = moe.MoeShape(t, E, K, H, FFN, ACT)
    dev = device_info(DEV)
    forms = list(dict.fromkeys([moe.OP.default(shape, dev)] + moe.OP.candidates(shape, dev)))
    rows = []
    for v in forms:
        row = {"impl": "kiln", "variant": v.name, "default": v == moe.OP.default(shape, dev)}
        if time.perf_counter() - t_start > BUDGET_S:
            rows.append({**row, "skipped": "time budget"})
            continue
        try:
            s0 = sets[0]
            got = moe.moe_experts(s0["x"], s0["idx"], s0["weights"], gate_up, down, ACT, v)
            row.update(accuracy(got, want))
            outs = [torch.empty_like(s["x"]) for s in sets]
            runs = [lambda s=s, o=o: moe.moe_experts(s["x"], s["idx"], s["weights"], gate_up, down, ACT, v, o)
                    for s, o in zip(sets, outs)]
            ms = timing.time_ms(runs, DEV)
            row.update({"ms": round(ms, 5), **flops_or_bytes(t, ms)})
        except Exception as e:  # noqa: BLE001  (one failing variant must not lose the others)
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    return rows


def bench_peers(t, sets, gate_up, down, want) -> list[dict]:
    ref = ReferenceOps(DEV)
    rows = []
    peers = {"reference": lambda s: ref.moe_experts(s["x"], s["idx"], s["weights"], gate_up, down, ACT),
             "torch_grouped_mm": lambda s: grouped_mm_moe(s["x"], s["idx"], s["weights"], gate_up, down)}
    for name, fn in peers.items():
        row = {"impl": name}
        try:
            row.update(accuracy(fn(sets[0]), want))
            n = [0]

            def call():
                fn(sets[n[0] % len(sets)])
                n[0] += 1
            ms = events_ms(call, reps=5 if t >= 8192 else 10)
            row.update({"ms": round(ms, 5), **flops_or_bytes(t, ms)})
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        rows.append(row)
    return rows


def main() -> int:
    global E, K, H, FFN, ACT, TOKENS
    out_path = sys.argv[1] if len(sys.argv) > 1 else "moe_gpu.json"
    model = sys.argv[2] if len(sys.argv) > 2 else "qwen3.5-35b-a3b"
    E, K, H, FFN, ACT = SHAPES[model]
    if len(sys.argv) > 3:
        TOKENS = tuple(int(t) for t in sys.argv[3].split(","))
    t_start = time.perf_counter()
    gen = torch.Generator(device=DEV).manual_seed(0)
    gate_up = (torch.randn(E, 2 * FFN, H, generator=gen, device=DEV) * 0.02).bfloat16()
    down = (torch.randn(E, H, FFN, generator=gen, device=DEV) * 0.02).bfloat16()
    result = {"date": now_iso(), "command": " ".join(sys.argv), **environment(DEV),
              "model": model, "shape": {"E": E, "k": K, "H": H, "I": FFN, "act": ACT, "dtype": "bf16"}, "cases": []}
    for t in TOKENS:
        case = {"tokens": t, "rows": []}
        try:
            sets = routings(t, gen)
            s0 = sets[0]
            want = ReferenceOps(DEV).moe_experts(s0["x"], s0["idx"], s0["weights"], gate_up, down, ACT)
            case["rows"] += bench_peers(t, sets, gate_up, down, want)
            case["rows"] += bench_kiln(t, sets, gate_up, down, want, t_start)
        except Exception as e:  # noqa: BLE001
            case["error"] = f"{type(e).__name__}: {e}\n{traceback.format_exc()[-1500:]}"
        result["cases"].append(case)
        for r in case["rows"]:
            print(t, r, flush=True)
        torch.cuda.empty_cache()
    result["wall_s"] = round(time.perf_counter() - t_start, 1)
    write_atomic(out_path, lambda f: f.write(json.dumps(result, indent=1).encode()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
