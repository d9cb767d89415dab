"""Compile every GPU candidate of a model's tuned ops for a CUDA target, on a machine without a GPU.

    PYTHONPATH=/tmp/triton36:. python3 tools/cross_compile.py synth:qwen3.5-0.8b [--arch 90] [--ops gemm,act_gemm]

Why: the interpreter (CI) never runs Triton's compiler, and the GPU machine's Triton (3.6) is older
than CI's; a candidate that fails to compile there is only seen as "cannot run" lines in a device
run, and the tuner then falls back to slower forms without failing. This runs each candidate's
real launch path (op.run on the gate's full and partial blocks) with CPU tensors, but every Triton
launch only compiles, through a stand-in driver that reports an sm_ARCH GPU. Install the GPU
machine's Triton into a folder of its own (pip install --no-deps --target DIR triton==3.6.0) and
put it first on PYTHONPATH. Prints one line per failure and a summary; exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import re
import sys
import time

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.runtime.driver import driver  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402


class CrossDriver:
    """What JITFunction.run asks the driver for, answered for a GPU that is not here."""

    def __init__(self, arch: int):
        self.target = GPUTarget("cuda", arch, 32)

    def get_current_device(self):
        return 0

    def get_current_stream(self, device=None):
        return 0

    def get_current_target(self):
        return self.target

    def get_active_torch_device(self):
        return torch.device("cpu")


FMA16 = re.compile(r"\bfma\.rn(?:\.ftz)?(?:\.sat)?\.(?:bf16|f16)(?:x2)?\b")
fused_16bit: dict[str, int] = {}   # kernel name -> 16-bit FMAs in its PTX


def compile_only() -> None:
    """Every kernel[grid](...) launch compiles and returns (nothing runs). Each compiled kernel's PTX
    is searched for 16-bit FMAs: the compiler narrows `round16(a * b)` then `+ c` to 16-bit ops and
    contracts them into one FMA, dropping a rounding the source (and the reference) does."""
    run = JITFunction.run

    def run_compile_only(self, *args, grid, warmup, **kwargs):
        kernel = run(self, *args, grid=grid, warmup=True, **kwargs)
        n = len(FMA16.findall(getattr(kernel, "asm", {}).get("ptx", "")))
        if n:
            fused_16bit[self.fn.__name__] = max(n, fused_16bit.get(self.fn.__name__, 0))
        return kernel
    JITFunction.run = run_compile_only


def pretend_gpu(arch: int, sms: int) -> None:
    """kiln's kernel families see an sm_ARCH device with SMS SMs (the GPU catalogue, PDL on): every
    module of kiln.ops, kiln.tune and the cuda backend that holds device_info or pdl gets the fakes."""
    import kiln.ops
    from kiln.tune import device

    info = device.DeviceInfo(f"cross-compile sm_{arch}", sms, (arch // 10, arch % 10), torch.device("cpu"))
    pdl_on = os.environ.get("KILN_PDL", "1") != "0" and arch >= 90

    def device_info(device=None):
        return info

    def pdl(t):
        return {"PDL": True, "launch_pdl": True} if pdl_on else {"PDL": False}
    importlib.import_module("kiln.backends.cuda")      # imports every kernel family (each registers its ops)
    for m in pkgutil.walk_packages(kiln.ops.__path__, "kiln.ops."):
        importlib.import_module(m.name)
    prefixes = ("kiln.ops.", "kiln.tune.", "kiln.backends.cuda")
    for mod in [sys.modules[n] for n in list(sys.modules) if n.startswith(prefixes)]:
        for name, fake in (("device_info", device_info), ("pdl", pdl)):
            if hasattr(mod, name):
                setattr(mod, name, fake)


def attention_workloads(specs: list[str], m_values) -> list:
    """Prefill (each m > 1) and decode (a 4096-token context) attention workloads for H:KV:D[:WINDOW]."""
    from kiln.ops.attention import kernels as attention
    from kiln.tune.tuner import Workload
    out = []
    for spec in specs:
        h, kv, d, *w = (int(x) for x in spec.split(":"))
        window = w[0] if w else None
        out += [Workload(attention.PREFILL_OP, attention.PrefillShape(m, h, kv, d, window)) for m in m_values if m > 1]
        out.append(Workload(attention.DECODE_OP, attention.DecodeShape(4096, h, kv, d, window)))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("model", help="a synth:NAME spec or a model folder with config.json")
    ap.add_argument("--arch", type=int, default=90, help="compute capability as one number (default 90)")
    ap.add_argument("--sms", type=int, default=132)
    ap.add_argument("--dtype", default="bf16", choices=("bf16", "f16"))
    ap.add_argument("--ops", default=None, help="comma-separated ops (default: all the model runs)")
    ap.add_argument("--m", type=int, action="append", default=None, help="rows to compile for (default 512 and 1)")
    ap.add_argument("--attention", action="append", default=[], metavar="H:KV:D[:WINDOW]",
                    help="also the attention ops at this head shape (models whose attention is not a tuned op, "
                         "e.g. Gemma 4's 16:2:512 global and 16:8:256:1024 sliding layers)")
    a = ap.parse_args()

    driver.set_active(CrossDriver(a.arch))
    compile_only()
    pretend_gpu(a.arch, a.sms)
    from kiln.backends.cuda import DECODE_ROWS, PREFILL_CHUNK, workloads
    from kiln.models import model_config
    from kiln.tune.device import device_info
    from kiln.tune.registry import candidates
    from kiln.weights.synth import synth_config

    if a.model.startswith("synth:"):
        config = synth_config(a.model.split(":", 1)[1])
    else:
        import json
        with open(os.path.join(a.model, "config.json")) as f:
            config = json.load(f)
        config = config.get("text_config", config) | {"model_type": config.get("text_config", config)["model_type"]}
    dtype = {"bf16": torch.bfloat16, "f16": torch.float16}[a.dtype]
    ops = tuple(a.ops.split(",")) if a.ops else None
    m_values = tuple(a.m) if a.m else (PREFILL_CHUNK, DECODE_ROWS)
    cls, cfg = model_config(config)
    work = workloads(cls, cfg, m_values, ops) if ops else workloads(cls, cfg, m_values)
    work += attention_workloads(a.attention, m_values)
    dev = device_info("cpu")      # the fake above: the sm_ARCH device
    gen = torch.Generator().manual_seed(0)
    seen, failed, t0 = set(), [], time.perf_counter()
    for w in work:
        op, shape = w.op, w.shape
        forms = list(dict.fromkeys([op.trusted(shape, dev)] + candidates(op, shape, dev)))
        for v in forms:
            if v.run is not None or (op.name, shape.key, v.name) in seen:
                continue
            seen.add((op.name, shape.key, v.name))
            try:
                for rows in op.blocks(shape):
                    block = op.with_rows(shape, rows)
                    inputs = op.inputs(block, dtype, torch.device("cpu"), gen)
                    op.run(v, inputs, op.outputs(block, inputs), None)
            except Exception as e:  # noqa: BLE001  (every failure is reported, none stops the sweep)
                why = " | ".join(line.strip() for line in str(e).strip().splitlines()[-3:])[:300]
                failed.append(f"{w.label}: {v.name}: {type(e).__name__}: {why}")
                print(f"[cross] FAIL {failed[-1]}", flush=True)
    from kiln.ops.plain import plain_kernels
    for name, launch in plain_kernels(cfg, dtype, torch.device("cpu")):    # the kernels outside the tuner
        if ops is not None and name not in ops:
            continue
        seen.add(("untuned", name, name))
        try:
            launch()
        except Exception as e:  # noqa: BLE001
            failed.append(f"{name}: {type(e).__name__}: {str(e).strip().splitlines()[-1][:300]}")
            print(f"[cross] FAIL {failed[-1]}", flush=True)
    for name, n in sorted(fused_16bit.items()):
        failed.append(f"{name}: {n} 16-bit FMA(s) in its PTX (a product's rounding contracted away)")
        print(f"[cross] FAIL {failed[-1]}", flush=True)
    print(f"[cross] triton {triton.__version__} sm_{a.arch}: {len(seen)} candidates of {len(work)} workloads, "
          f"{len(failed)} failed, {time.perf_counter() - t0:.0f} s", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
