"""Where a short prompt's prefill goes on the GPU: wall time against kernel time, launches, host syncs.

    PYTHONPATH=. python3 bench/prefill_trace.py OUT.json [--model synth:qwen3.5-0.8b] [--lengths 1000,4096]

For each prompt length: the prefill's wall time (median of 5 after a warm-up that tunes), then one
prefill under torch.profiler: the kernels it launched and their summed GPU time, the host calls
that wait for the device (stream/device synchronize, device-to-host copies), and the Python-side ops
that took the most host time. Wall time far above kernel time says the host bounds the prefill.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import Counter

import torch

import kiln
from kiln.tools.benchutil import environment, now_iso

SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync", "cudaMemcpy")


def prefill_s(eng, ids) -> float:
    state = eng.new_state(len(ids) + 8)
    torch.cuda.synchronize()
    t = time.perf_counter()
    eng.prefill(ids, state)
    torch.cuda.synchronize()
    return time.perf_counter() - t


def trace(eng, ids) -> dict:
    from torch.profiler import ProfilerActivity, profile
    state = eng.new_state(len(ids) + 8)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as p:
        eng.prefill(ids, state)
        torch.cuda.synchronize()
    kernels, syncs, host, kernel_us = Counter(), Counter(), Counter(), Counter()
    gpu_us = 0.0
    for e in p.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name[:60]] += 1
            us = e.device_time if hasattr(e, "device_time") else e.cuda_time
            kernel_us[e.name[:60]] += us
            gpu_us += us
        elif e.name in SYNCS:
            syncs[e.name] += 1
    for e in p.key_averages():
        if e.device_type == torch.autograd.DeviceType.CPU and not e.key.startswith("cuda"):
            host[e.key[:60]] = round(e.self_cpu_time_total / 1e3, 3)
    return {"launches": sum(kernels.values()), "kernel_ms": round(gpu_us / 1e3, 3),
            "syncs": dict(syncs), "top_kernels": kernels.most_common(25),
            "top_kernel_ms": [(k, round(v / 1e3, 3)) for k, v in kernel_us.most_common(25)],
            "top_host_ms": sorted(host.items(), key=lambda kv: -kv[1])[:30]}


def host_profile(eng, ids, top: int = 45) -> str:
    """cProfile of three prefills: the Python functions whose own time bounds a host-bound prefill."""
    import cProfile
    import io
    import pstats
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(3):
        prefill_s(eng, ids)
    pr.disable()
    out = io.StringIO()
    pstats.Stats(pr, stream=out).sort_stats("tottime").print_stats(top)
    return out.getvalue()


def launch_cost_us(n: int = 2000) -> float:
    """Wall time of one launch of an empty Triton kernel (its Python launcher), the GPU idle."""
    import triton
    import triton.language as tl

    @triton.jit
    def noop(x_ptr, n, B: tl.constexpr):
        i = tl.arange(0, B)
        tl.store(x_ptr + i, tl.load(x_ptr + i, mask=i < n), mask=i < n)

    x = torch.zeros(16, device="cuda")
    noop[(1,)](x, 16, B=16)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        noop[(1,)](x, 16, B=16)
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--model", default="synth:qwen3.5-0.8b")
    ap.add_argument("--lengths", default="1000,4096")
    a = ap.parse_args()
    llm = kiln.load(a.model, dtype="bf16", quiet=False)
    eng = llm.engine
    vocab = llm.model.cfg.vocab_size
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in map(int, a.lengths.split(",")):
        ids = torch.randint(0, vocab, (n,), generator=g).tolist()
        t0 = time.perf_counter()
        prefill_s(eng, ids)                     # warm-up: tunes this length's shapes
        warm = time.perf_counter() - t0
        times = [prefill_s(eng, ids) for _ in range(5)]
        med = statistics.median(times)
        row = {"prompt_tokens": n, "warmup_s": round(warm, 3), "prefill_ms": round(med * 1e3, 3),
               "prefill_tok_s": round(n / med, 1), "trace": trace(eng, ids)}
        print(json.dumps({k: v for k, v in row.items() if k != "trace"}), row["trace"]["launches"],
              row["trace"]["kernel_ms"], row["trace"]["syncs"], flush=True)
        if n == min(map(int, a.lengths.split(","))):
            row["host_profile"] = host_profile(eng, ids)
            print(row["host_profile"][:6000], flush=True)
        rows.append(row)
    launch = launch_cost_us()
    print(f"empty Triton kernel: {launch:.1f} us a launch", flush=True)
    report = {"model": a.model, "triton_launch_us": round(launch, 2),
              "dtype": "bf16", **environment(torch.device("cuda")), "date": now_iso(),
              "command": "python3 bench/prefill_trace.py " + " ".join(f"{k}={v}" for k, v in vars(a).items()),
              "results": rows}
    with open(a.out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
