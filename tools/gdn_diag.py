"""Every Gated DeltaNet prefill form on the GPU, each in its own process: its error, faults, time and kernels.

An illegal memory access poisons the CUDA context, so one crashing form must not take the others down.

    PYTHONPATH=. python3 tools/gdn_diag.py OUT.json
    GDN_DIAG_FORMS=name,... GDN_DIAG_STEPS=check,time,profile   (defaults: every form, every step)

Per form: a check run at T = 8192, 16 heads, with CUDA_LAUNCH_BLOCKING=1 (a crash names the kernel
launch that faulted; then compute-sanitizer at T = 200 names the kernel and address), its error
against the ieee chunk form (y and final state), then a timing run over SHAPES (kiln.tune.timing,
CUDA-graph replays).
flash-linear-attention 0.6.0's chunk_gated_delta_rule (q/k l2norm in its kernel, gated norm after)
is timed on the same inputs for comparison.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

HK, DK, DV, K = 16, 128, 128, 4
SHAPES = [(8192, 16), (8192, 32), (32768, 16)]


PROFILED = ("split_h16w4_o128w8_pw8_bf16_inv-tf32_p2", "split_h16w4_o64w8_pw8_tf32x3_p2", "fla")


def forms() -> list[str]:
    """The split forms (the tuner's GPU candidates and the catalogue-only ones) and fla. Any other
    form of the catalogue runs when GDN_DIAG_FORMS names it (the scans are far slower: bench/NOTES.md)."""
    from kiln.ops.gdn import kernels as gdn
    return [v.name for v in gdn.split_next_forms(DV) + gdn.split_forms(DV)] + ["fla"]


def variant(name: str):
    from kiln.ops.gdn import kernels as gdn
    by_name = {v.name: v for v in gdn.PREFILL.catalogue(gdn.GdnShape(1, HK, 16, DK, DV, K), _dev())}
    by_name.update({v.name: v for v in gdn.split_forms(DV) + gdn.split_next_forms(DV)})
    return by_name[name]


def _dev():
    import torch

    from kiln.tune.device import device_info
    return device_info(torch.device("cuda"))


def child(mode: str, names: str) -> dict:
    """One form, or (time, profile: forms that passed their check) several in one process."""
    if mode == "check":
        return one(mode, names, *SHAPES[0])
    if mode == "profile":
        return {n: one(mode, n, *SHAPES[0]) for n in names.split(",")}
    return {n: {f"T{t}_hv{hv}": one("time", n, t, hv) for t, hv in SHAPES} for n in names.split(",")}


def one(mode: str, name: str, t: int, hv: int) -> dict:
    import torch

    from kiln.backends.reference import ReferenceOps
    from kiln.ops.gdn import kernels as gdn
    from kiln.tune.timing import time_ms

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(t + hv)
    inp = gdn.gdn_inputs(gdn.GdnShape(t, HK, hv, DK, DV, K), torch.bfloat16, dev, gen)
    dims = inp["dims"]
    xc = gdn.conv(inp["qkv"], inp["conv_w"], inp["conv_state"].clone())
    args = [inp[n] for n in ("z", "b", "a", "A_log", "dt_bias", "norm_w")]
    if name == "fla":
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla
        rep = hv // HK
        q, k, v = xc.split([HK * DK, HK * DK, hv * DV], dim=-1)
        q, k = (x.view(1, t, HK, DK).repeat_interleave(rep, dim=2).contiguous() for x in (q, k))
        v = v.reshape(1, t, hv, DV).contiguous()
        decay = torch.nn.functional.softplus(inp["a"].float() + inp["dt_bias"].float())
        g = (-inp["A_log"].float().exp() * decay)[None]
        beta = torch.sigmoid(inp["b"])[None].contiguous()
        s0 = inp["ssm"].clone()[None]

        def run():
            o, _ = fla(q, k, v, g, beta, scale=DK ** -0.5, initial_state=s0, output_final_state=True,
                       use_qk_l2norm_in_kernel=True)
            o16 = o[0].to(torch.bfloat16)
            return ReferenceOps(dev).gated_rmsnorm(o16, inp["z"].view(t, hv, DV), inp["norm_w"], 1e-6)
        run()
        return kernels(run) if mode == "profile" else {"ms": time_ms([run], dev)}
    v = gdn.TORCH if name == "torch_chunked" else variant(name)
    y, s = torch.empty((t, hv * DV), dtype=torch.bfloat16, device=dev), inp["ssm"].clone()

    def run():
        s.copy_(inp["ssm"])
        gdn.mix(xc, *args, s, dims, v, y)
    run()
    torch.cuda.synchronize()
    if mode == "profile":
        return kernels(run)
    if mode == "time":
        return {"ms": time_ms([run], dev)}
    ry, rs = torch.empty_like(y), inp["ssm"].clone()
    gdn.chunked(xc, *args, rs, dims, ry, gdn.chunk_variant(32, 8, "ieee", 8).p)
    rel = lambda a, b: (a.float() - b.float()).abs().max().item() / b.float().abs().max().item()  # noqa: E731
    return {"y_rel_err_vs_ieee": rel(y, ry), "ssm_rel_err_vs_ieee": rel(s, rs), "nan": bool(torch.isnan(y).any())}


def kernels(run, reps: int = 10) -> dict:
    """GPU time per kernel name (us per call of run), from torch.profiler over `reps` calls."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            run()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if us:
            out[e.key[:80]] = round(us / reps, 1)
    return dict(sorted(out.items(), key=lambda kv: -kv[1])[:12])


def spawn(mode: str, name: str, timeout: int, prefix=()) -> dict:
    env = dict(os.environ)
    if mode != "time":
        env["CUDA_LAUNCH_BLOCKING"] = "1"
    cmd = [*prefix, sys.executable, __file__, "--child", mode, name]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": f"timeout {timeout} s"}
    for line in reversed(r.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = [x for x in (r.stderr + r.stdout).splitlines() if x.strip()]
    keep = [x for x in tail if "File \"" in x and "kiln" in x] + tail[-6:]
    return {"error": "\n".join(keep)[-2500:], "rc": r.returncode}


def batched(mode: str, names: list[str], per_form_s: int) -> dict:
    """Run MODE for NAMES in one process; if it dies, one process per form so the rest still report."""
    if not names:
        return {}
    r = spawn(mode, ",".join(names), 60 + per_form_s * len(names))
    if "error" not in r:
        return r
    return {n: spawn(mode, n, 60 + per_form_s).get(n, r) for n in names}


def sanitize(name: str) -> str:
    exe = shutil.which("compute-sanitizer") or "/usr/local/cuda/bin/compute-sanitizer"
    if not os.path.exists(exe):
        return "compute-sanitizer not found"
    r = spawn("small", name, 150, prefix=(exe, "--tool", "memcheck", "--print-limit", "4"))
    return r.get("error", json.dumps(r))


def main(out: str) -> None:
    import torch

    from kiln.tools.benchutil import environment, now_iso
    res = {"date": now_iso(), **environment(torch.device("cuda")), "command": " ".join(sys.argv),
           "hk": HK, "dk": DK, "dv": DV, "cases": []}
    t0 = time.time()
    only = [f for f in os.environ.get("GDN_DIAG_FORMS", "").split(",") if f]
    steps = os.environ.get("GDN_DIAG_STEPS", "check,time,profile").split(",")
    names = only or forms()
    rows = {n: {"form": n} for n in names}
    checked = [n for n in names if n != "fla"] if "check" in steps else []
    # checks in parallel (correctness only; each compiles for tens of seconds), timings one at a time
    with ThreadPoolExecutor(int(os.environ.get("GDN_DIAG_JOBS", "4"))) as pool:
        for n, r in zip(checked, pool.map(lambda n: spawn("check", n, 240), checked)):
            rows[n]["check"] = r
            if "error" in r:
                rows[n]["sanitizer"] = sanitize(n)
            print(n, json.dumps(r)[:300], flush=True)
    save(out, res, rows, names)
    ok = [n for n in names if "sanitizer" not in rows[n]]
    if "time" in steps:
        for n, r in batched("time", ok, 90).items():
            rows[n]["time_ms"] = r
        save(out, res, rows, names)
    if "profile" in steps:
        for n, r in batched("profile", [n for n in ok if n in PROFILED or only], 60).items():
            rows[n]["kernels_us_T8192_hv16"] = r
    res["wall_s"] = round(time.time() - t0, 1)
    save(out, res, rows, names)
    for row in res["cases"]:
        print(json.dumps(row)[:700], flush=True)


def save(out: str, res: dict, rows: dict, names: list[str]) -> None:
    """Written after each phase, so a step cut by its timeout still leaves what it measured."""
    res["cases"] = [rows[n] for n in names]
    with open(out + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(out + ".tmp", out)


if __name__ == "__main__":
    if sys.argv[1] == "--child":
        mode, name = sys.argv[2], sys.argv[3]
        out = one("check", name, 200, 16) if mode == "small" else child(mode, name)
        print("RESULT " + json.dumps(out), flush=True)
    else:
        main(sys.argv[1])
