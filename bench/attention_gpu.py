"""kiln's attention kernels against torch's scaled_dot_product_attention (flash), prefill and decode.

Shapes: qwen3.5-0.8b (H=8, KV=2) and qwen3.5-9b (H=16, KV=4) full-attention layers, head_dim 256, bf16:

  prefill: one causal chunk from position 0 at T = 8192, 32768 (and 81920 while time is left);
           kiln prefill_attention (a few variants) vs SDPA under the flash backend
           (is_causal=True, enable_gqa=True), the backend actually used recorded.
           TFLOP/s = 2 * 2 * H * D * T * T / 2 / time (the causal half of QK^T and PV).
  decode:  one query at context 512, 8192, 32768, 81920; kiln decode_attention (a few split sizes)
           vs SDPA on the one query. GB/s = K and V bytes read / time.

Each case first checks kiln against SDPA (max abs error), then times with CUDA events (warm-up,
median of repeats; decode inside a CUDA graph over K/V sets rotated past L2). A failing case is
recorded and the rest go on.

    PYTHONPATH=. python3 bench/attention_gpu.py OUT.json     (GPU; about two minutes)
"""

from __future__ import annotations

import json
import math
import statistics
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from kiln.ops.attention import kernels as attention
from kiln.tools.benchutil import environment, now_iso

MODELS = {"qwen3.5-0.8b": (8, 2), "qwen3.5-9b": (16, 4)}
D = 256
DEV = "cuda"
PREFILL_T = (8192, 32768, 81920)
DECODE_CTX = (512, 8192, 32768, 81920)
PREFILL_FORMS = [attention.tile_variant(128, 64, 8, 2), attention.tile_variant(128, 64, 8, 2, pack=True),
                 attention.tile_variant(64, 64, 4, 2), attention.tile_variant(128, 32, 8, 2)]
DECODE_FORMS = [attention.decode_variant(64, 64, 4), attention.decode_variant(256, 64, 4),
                attention.decode_variant(512, 64, 8), attention.decode_variant(1024, 128, 8)]
BUDGET_S = 110.0          # stop starting new cases past this (the run must end within ~2 minutes)
T0 = time.perf_counter()


def elapsed() -> float:
    return time.perf_counter() - T0


def time_ms(fn, target_ms: float = 200.0, max_reps: int = 50) -> float:
    """Median ms of fn() with CUDA events, after a warm-up."""
    fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    torch.cuda.synchronize()
    reps = max(3, min(max_reps, int(target_ms / max(a.elapsed_time(b), 1e-3))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in events:
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in events)


def run_sdpa(q4, k4, v4, causal: bool, flash: bool):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    gqa = k4.shape[1] != q4.shape[1]
    if flash:
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, enable_gqa=gqa)
    return F.scaled_dot_product_attention(q4, k4, v4, is_causal=causal, enable_gqa=gqa)


def pick_sdpa(q4, k4, v4, causal: bool):
    """(flash?, backend name, output, k4, v4): flash with GQA when supported here, else flash on K/V
    repeated per query head, else the default backend."""
    try:
        return True, "flash", run_sdpa(q4, k4, v4, causal, True), k4, v4
    except RuntimeError as e:
        why = str(e).splitlines()[0][:120] if str(e) else ""
    group = q4.shape[1] // k4.shape[1]
    kr, vr = (x.repeat_interleave(group, dim=1) for x in (k4, v4))
    try:
        return True, f"flash on repeated K/V (enable_gqa refused: {why})", run_sdpa(q4, kr, vr, causal, True), kr, vr
    except RuntimeError as e:
        why2 = str(e).splitlines()[0][:120] if str(e) else ""
    return False, f"default (flash refused: {why}; {why2})", run_sdpa(q4, k4, v4, causal, False), k4, v4


def prefill_case(model: str, t: int) -> dict:
    h, kv = MODELS[model]
    g = torch.Generator(device=DEV).manual_seed(t)
    q = torch.randn(t, h, D, device=DEV, generator=g, dtype=torch.bfloat16)
    k = torch.randn(t, kv, D, device=DEV, generator=g, dtype=torch.bfloat16)
    v = torch.randn(t, kv, D, device=DEV, generator=g, dtype=torch.bfloat16)
    q4, k4, v4 = (x.transpose(0, 1)[None].contiguous() for x in (q, k, v))     # [1, heads, T, D]
    flash, backend, want, k4, v4 = pick_sdpa(q4, k4, v4, True)
    want = want[0].transpose(0, 1)                                          # [T, H, D]
    flops = 2 * 2 * h * D * t * t / 2
    row = {"kind": "prefill", "model": model, "H": h, "KV": kv, "D": D, "T": t, "q_start": 0,
           "sdpa_backend": backend}
    row["sdpa_ms"] = time_ms(lambda: run_sdpa(q4, k4, v4, True, flash))
    row["sdpa_tflops"] = flops / row["sdpa_ms"] / 1e9
    row["kiln"] = {}
    for form in PREFILL_FORMS:
        try:
            got = attention.prefill_attention(q, k, v, 0, t, D ** -0.5, None, None, form)
            err = (got.float() - want.float()).abs().max().item()
            ms = time_ms(lambda: attention.prefill_attention(q, k, v, 0, t, D ** -0.5, None, None, form))
            row["kiln"][form.name] = {"ms": ms, "tflops": flops / ms / 1e9, "max_abs_err_vs_sdpa": err}
        except Exception as e:  # noqa: BLE001  (one variant that cannot run does not lose the rest)
            row["kiln"][form.name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    ok = {n: r for n, r in row["kiln"].items() if "ms" in r}
    if ok:
        best = min(ok, key=lambda n: ok[n]["ms"])
        row["kiln_best"] = best
        row["kiln_best_ms"] = ok[best]["ms"]
        row["kiln_vs_sdpa"] = row["sdpa_ms"] / ok[best]["ms"]
    return row


def graph_ms(calls, target_ms: float = 100.0) -> tuple[float, str]:
    """Per-call ms of the calls replayed in one CUDA graph (each call on its own K/V set), or
    timed eagerly if capture fails."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for c in calls:
            c()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for c in calls:
                c()
        return time_ms(graph.replay, target_ms) / len(calls), "cuda_graph"
    except RuntimeError as e:
        torch.cuda.synchronize()
        def eager():
            for c in calls:
                c()
        return time_ms(eager, target_ms) / len(calls), f"eager (capture failed: {str(e).splitlines()[0][:100]})"


def decode_case(model: str, ctx: int) -> dict:
    h, kv = MODELS[model]
    kv_bytes = 2 * ctx * kv * D * 2
    sets = max(1, min(128, math.ceil(200e6 / kv_bytes)))    # rotate K/V past the L2
    g = torch.Generator(device=DEV).manual_seed(ctx)
    q = torch.randn(1, h, D, device=DEV, generator=g, dtype=torch.bfloat16)
    bufs = [(torch.randn(ctx, kv, D, device=DEV, generator=g, dtype=torch.bfloat16),
             torch.randn(ctx, kv, D, device=DEV, generator=g, dtype=torch.bfloat16)) for _ in range(sets)]
    pos = torch.tensor([ctx - 1], dtype=torch.int64, device=DEV)
    q4 = q.transpose(0, 1)[None].contiguous()
    kv4 = [tuple(x.transpose(0, 1)[None].contiguous() for x in b) for b in bufs]
    flash, backend, want, *_ = pick_sdpa(q4, *kv4[0], False)
    if backend.startswith("flash on repeated"):
        kv4 = [tuple(x.repeat_interleave(h // kv, dim=1) for x in b) for b in kv4]
    want = want[0].transpose(0, 1)
    row = {"kind": "decode", "model": model, "H": h, "KV": kv, "D": D, "context": ctx, "kv_sets_rotated": sets,
           "sdpa_backend": backend, "kv_bytes": kv_bytes}
    row["sdpa_ms"], row["sdpa_timing"] = graph_ms([lambda k4=k4, v4=v4: run_sdpa(q4, k4, v4, False, flash)
                                                   for k4, v4 in kv4])
    row["sdpa_gbs"] = kv_bytes / row["sdpa_ms"] / 1e6
    row["kiln"] = {}
    for form in DECODE_FORMS:
        try:
            got = attention.decode_attention(q, *bufs[0], pos, D ** -0.5, None, None, form)
            err = (got.float() - want.float()).abs().max().item()
            ms, how = graph_ms([lambda k=k, v=v: attention.decode_attention(q, k, v, pos, D ** -0.5, None, None, form)
                                for k, v in bufs])
            row["kiln"][form.name] = {"ms": ms, "gbs": kv_bytes / ms / 1e6, "timing": how, "max_abs_err_vs_sdpa": err}
        except Exception as e:  # noqa: BLE001
            row["kiln"][form.name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
    ok = {n: r for n, r in row["kiln"].items() if "ms" in r}
    if ok:
        best = min(ok, key=lambda n: ok[n]["ms"])
        row["kiln_best"], row["kiln_best_ms"] = best, ok[best]["ms"]
        row["kiln_vs_sdpa"] = row["sdpa_ms"] / ok[best]["ms"]
    return row


def run_case(fn, *args) -> dict:
    t0 = time.perf_counter()
    try:
        row = fn(*args)
    except Exception as e:  # noqa: BLE001  (recorded; the other cases still run)
        row = {"case": f"{fn.__name__}{args}", "error": f"{type(e).__name__}: {str(e)[:500]}",
               "traceback": traceback.format_exc()[-2000:]}
    row["wall_s"] = round(time.perf_counter() - t0, 2)
    torch.cuda.empty_cache()
    print(json.dumps({k: v for k, v in row.items() if k != "traceback"}), flush=True)
    return row


def main() -> None:
    out = sys.argv[1] if len(sys.argv) > 1 else "attention_gpu.json"
    result = {"date": now_iso(), "command": " ".join(sys.argv), **environment(torch.device(DEV)),
              "cuda": torch.version.cuda, "dtype": "bf16", "cases": [], "skipped": []}
    # prefill 8k and 32k, every decode context, then prefill 81920 only while time is left
    plan = ([(prefill_case, m, t) for t in PREFILL_T[:2] for m in MODELS] + [(decode_case, m, c) for c in DECODE_CTX
            for m in MODELS] + [(prefill_case, m, t) for t in PREFILL_T[2:] for m in MODELS])
    for fn, *args in plan:
        if elapsed() > BUDGET_S or (fn is prefill_case and args[1] > 32768 and elapsed() > 80):
            result["skipped"].append(f"{fn.__name__}{tuple(args)}: time budget")
            continue
        result["cases"].append(run_case(fn, *args))
        with open(out, "w") as f:          # written after every case: a killed run keeps what it has
            json.dump(result, f, indent=1)
    result["wall_s"] = round(elapsed(), 1)
    with open(out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
