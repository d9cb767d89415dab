"""kiln's tuned Triton GEMM against torch.matmul (cuBLAS) on the prefill projection shapes of qwen3.5-0.8b and 9b.

The grid: every projection shape of the two checkpoints (GDN in_proj_qkv/z/b/a and out_proj,
attention q/k/v/o, MLP gate/up/down: 14 (N, K) pairs) at M = 512, 2048 and 8192, 42 GEMMs. Also the
cold tune time of qwen3.5-0.8b's GEMMs (`kiln tune --ops gemm`, empty Triton and kiln caches) and
the warm-cache compile-and-tune stage of a load (all ops). With --packed the grid is instead the
GEMMs the models run: kiln merges q|k|v, gate|up and GDN's in_proj_qkv|z|b|a at load.

    python bench/gemm_vs_cublas.py --out OUT.json [--log tune.log] [--budget S]     (GPU)
    python bench/gemm_vs_cublas.py --out OUT.json --only 1024x3584 --ms 512 --no-cold --no-load-stage   (a sweep)

Both sides are timed the same way (kiln.tune.timing: CUDA-graph replays over input sets rotated
past L2, median), bf16 in and out, y = x @ w^T with w stored [N, K] as in the checkpoints.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SUMMARY = re.compile(r"\[kiln\] (\d+) kernels compiled in ([\d.]+) s, tuned in ([\d.]+) s \(cache (hit|miss): (\S+)\)")
MODELS = ("qwen3.5-0.8b", "qwen3.5-9b")
MS = (512, 2048, 8192)


def kiln_tune(args: list[str], env: dict, log) -> dict:
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "kiln.cli", "tune", *args, "--device", "cuda"], capture_output=True,
                       text=True, env=env, cwd=ROOT)
    wall = time.perf_counter() - t0
    log.write(f"$ kiln tune {' '.join(args)}  (exit {r.returncode}, {wall:.1f} s)\n{r.stderr}\n{r.stdout}\n")
    m = SUMMARY.search(r.stderr)
    if r.returncode != 0 or not m:
        return {"ok": False, "wall_s": round(wall, 2), "stderr_tail": r.stderr[-2000:]}
    return {"ok": True, "wall_s": round(wall, 2), "kernels": int(m[1]), "compile_s": float(m[2]),
            "tune_s": float(m[3]), "stage_s": round(float(m[2]) + float(m[3]), 2), "cache": m[4]}


def projections(model: str, packed: bool = False) -> dict[tuple[int, int], list[str]]:
    """(N, K) -> the projection names with that shape (LM head excluded: prefill runs it on one row).
    packed: the GEMMs the model declares it runs at prefill (projections merged at load), unnamed."""
    from kiln.models import checkpoint_shapes, model_config
    from kiln.weights.synth import synth_config

    out: dict[tuple[int, int], list[str]] = {}
    if packed:
        cls, cfg = model_config(synth_config(model))
        for ks in cls.kernel_shapes(cfg, (max(MS),), (64,)):
            dims = dict(ks.dims)
            if ks.op == "gemm" and dims["rows"] > 1:
                out[(dims["n"], dims["k"])] = ["kernel_shapes"]
        return out
    for name, shape in checkpoint_shapes(synth_config(model)).items():
        if len(shape) == 2 and "embed" not in name and name != "lm_head.weight":
            short = name.split(".")[-2]
            out.setdefault(tuple(shape), [])
            if short not in out[tuple(shape)]:
                out[tuple(shape)].append(short)
    return out


def grid(log, budget: float, device: str = "cuda", models=MODELS, ms=MS, dtype=None,
         only: set | None = None, packed: bool = False) -> tuple[list[dict], object]:
    import torch

    from kiln.ops.gemm import gemm
    from kiln.tune import timing
    from kiln.tune.cache import TuneCache
    from kiln.tune.tuner import Tuner, Workload

    rows, work, names = [], [], {}
    for model in models:
        for (n, k), projs in projections(model, packed).items():
            names.setdefault((n, k), set()).update(f"{model}:{p}" for p in projs)
    for (n, k) in names:
        if only and (n, k) not in only:
            continue
        work += [Workload(gemm.OP, gemm.GemmShape(m, n, k)) for m in ms]
    dev, dtype = torch.device(device), dtype or torch.bfloat16
    tuner = Tuner(dev, dtype, cache=TuneCache(Path(tempfile.mkdtemp()) / "tune"), budget_s=budget,
                  log=lambda line: log.write(line + "\n"))
    plan, report = tuner.tune(work)
    log.flush()
    gen = torch.Generator(device=dev).manual_seed(0)
    for w in work:
        m, n, k = w.shape.rows, w.shape.n, w.shape.k
        v = plan.choices[w.label]
        sets = []
        for _ in range(timing.set_count(2 * (m * k + n * k + m * n), dev)):
            x = torch.randn(m, k, generator=gen, device=dev).to(dtype)
            wt = (torch.randn(n, k, generator=gen, device=dev) * k ** -0.5).to(dtype)
            sets.append((x, wt, torch.empty(m, n, device=dev, dtype=dtype)))
        x, wt, y = sets[0]
        ref = torch.matmul(x.float(), wt.float().t())
        gemm.OP.run(v, {"x": x, "w": wt}, {"y": y}, plan)
        err = (y.float() - ref).abs().max().item() / ref.abs().max().item()
        kiln_ms = timing.time_ms([lambda s=s: gemm.OP.run(v, {"x": s[0], "w": s[1]}, {"y": s[2]}, plan)
                                  for s in sets], dev)
        torch_ms = timing.time_ms([lambda s=s: torch.matmul(s[0], s[1].t(), out=s[2]) for s in sets], dev)
        flops = 2 * m * n * k
        rows.append({"m": m, "n": n, "k": k, "projections": sorted(names[(n, k)]), "variant": v.name,
                     "kiln_ms": round(kiln_ms, 5), "torch_ms": round(torch_ms, 5),
                     "kiln_tflops": round(flops / kiln_ms / 1e9, 1), "torch_tflops": round(flops / torch_ms / 1e9, 1),
                     "ratio": round(torch_ms / kiln_ms, 3), "rel_err": err, "tuned_ms": plan.times.get(w.label)})
        del sets
    return rows, report


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--log", default=None)
    ap.add_argument("--budget", type=float, default=300.0)
    ap.add_argument("--no-load-stage", action="store_true",
                    help="skip the full and warm 0.8b tunes (kiln bench reports the load's tune stage too)")
    ap.add_argument("--only", default=None, help="NxK[,NxK...]: only these projection shapes (a sweep, not the grid)")
    ap.add_argument("--packed", action="store_true",
                    help="the GEMMs the models run (projections merged at load), not the checkpoints' projections")
    ap.add_argument("--ms", default=None, help="row counts, comma-separated (default 512,2048,8192)")
    ap.add_argument("--no-cold", action="store_true", help="skip the cold tune of the 0.8b GEMMs")
    ap.add_argument("--caches", default=None, help="folder for the Triton and kiln caches (default: a new temp dir)")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT))
    caches = Path(a.caches or tempfile.mkdtemp(prefix="kiln-bench-"))
    env = {**os.environ, "TRITON_CACHE_DIR": str(caches / "triton"), "KILN_CACHE_DIR": str(caches / "kiln"),
           "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    os.environ["TRITON_CACHE_DIR"] = env["TRITON_CACHE_DIR"]     # the grid reuses the kernels compiled below
    log = open(a.log or os.devnull, "w")
    t0 = time.perf_counter()
    ms = tuple(int(m) for m in a.ms.split(",")) if a.ms else MS
    only = {tuple(int(d) for d in nk.split("x")) for nk in a.only.split(",")} if a.only else None
    cold = {} if a.no_cold else kiln_tune(["synth:qwen3.5-0.8b", "--ops", "gemm"], env, log)   # empty caches
    print(f"cold tune of qwen3.5-0.8b GEMMs: {cold}", flush=True)
    full = warm = None
    if not a.no_load_stage:
        full = kiln_tune(["synth:qwen3.5-0.8b"], env, log)                         # every op, kiln cache cold
        warm = kiln_tune(["synth:qwen3.5-0.8b"], env, log)                         # warm: the load's stage
    print(f"full tune {full}\nwarm {warm}", flush=True)

    import torch

    from kiln.tools.benchutil import environment, now_iso

    rows, report = grid(log, a.budget, ms=ms, only=only, packed=a.packed)
    log.close()
    ratios = [r["ratio"] for r in rows]
    result = {
        "bench": "gemm_vs_cublas", **environment(torch.device("cuda")), "cuda": torch.version.cuda, "date": now_iso(),
        "command": "python bench/gemm_vs_cublas.py " + " ".join(sys.argv[1:]),
        "cold_tune_08b_gemms": cold, "full_tune_08b": full, "warm_load_stage_08b": warm,
        "grid_tune": {"kernels": report.compiled, "compile_s": round(report.compile_s, 1),
                      "tune_s": round(report.tune_s, 1)},
        "median_ratio": statistics.median(ratios), "min_ratio": min(ratios),
        "median_ratio_by_m": {m: statistics.median(r["ratio"] for r in rows if r["m"] == m) for m in ms},
        "rows": rows, "wall_s": round(time.perf_counter() - t0, 1),
    }
    Path(a.out).write_text(json.dumps(result, indent=1))
    print(f"{'M':>5} {'N':>6} {'K':>6} {'kiln ms':>9} {'torch ms':>9} {'kiln TF':>8} {'ratio':>6}  variant")
    for r in rows:
        print(f"{r['m']:5d} {r['n']:6d} {r['k']:6d} {r['kiln_ms']:9.4f} {r['torch_ms']:9.4f} {r['kiln_tflops']:8.1f} "
              f"{r['ratio']:6.3f}  {r['variant']}")
    print(f"median ratio {result['median_ratio']:.3f}, min {result['min_ratio']:.3f}; "
          f"by M {result['median_ratio_by_m']}; cold {cold.get('wall_s')} s (stage {cold.get('stage_s')} s), "
          f"warm stage {(warm or {}).get('stage_s')} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
