"""`kiln tune MODEL`: compile and tune the kernels for a model's shapes, fill the cache, print the
table of choices (stdout; the [autotune] lines and the [kiln] summary go to stderr).
`kiln kernels MODEL --dump DIR`: the source, Triton IR and PTX of every chosen kernel, each file
named after its op, shape and variant (e.g. gemm_512x1024x3584_bm128_bn128_bk64_w8_s4.ptx); the
choices come from the tune cache (or are measured first, as `kiln tune` would)."""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path

import torch

from ..api import pick_device, pick_dtype, resolve_model
from ..errors import KilnError
from ..models import model_config
from ..tune.device import interpreting
from ..tune.registry import REGISTRY, get_op
from ..tune.tuner import Tuner
from ..weights import open_checkpoint
from .flags import add_runtime_flags, parse_pins, positive_int

IR = ("ttir", "ttgir", "llir", "ptx")


def add_parser(sub) -> None:
    p = sub.add_parser("tune", help="compile and tune the kernels for a model's shapes; print the choices")
    add_runtime_flags(p)
    add_tune_flags(p)
    p.set_defaults(main=cmd_tune)
    p = sub.add_parser("kernels", help="dump the source, Triton IR and PTX of every kernel chosen for a model")
    add_runtime_flags(p)
    p.add_argument("--dump", required=True, metavar="DIR", help="folder to write the files into")
    add_tune_flags(p)
    p.set_defaults(main=cmd_kernels)


def add_tune_flags(p: argparse.ArgumentParser) -> None:
    # --retune and --tune OP=VARIANT come with the runtime flags.
    p.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                   help="stop measuring after this long; the rest take each op's default (default 600)")
    p.add_argument("--m", type=positive_int, action="append", default=None, metavar="ROWS",
                   help="token counts to tune for (repeatable; default: the rows a load tunes: the prefill chunks "
                        "512 and 4096, the routed experts' 1024 and 2048, and decode 1)")
    p.add_argument("--ops", default=None, help="comma-separated ops to tune (default: every op the model runs)")


def setup(a):
    """(device, dtype, workloads, tuner) from the flags shared by `kiln tune` and `kiln kernels`."""
    from ..backends import cuda  # Triton: its kernel families register their ops as it imports them

    if a.budget is not None and not a.budget > 0:
        raise KilnError(f"--budget must be a positive number of seconds, got {a.budget}")
    dev = pick_device(a.device)
    if dev.type != "cuda" and not interpreting():
        raise KilnError("kernels run on a CUDA GPU; on CPU set TRITON_INTERPRET=1 (slow; timings mean nothing)")
    dtype = pick_dtype(a.dtype, dev)
    if dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise KilnError(f"no kernels for dtype {dtype}")
    ops = cuda.OPS
    if a.ops:
        ops = tuple(o.strip() for o in a.ops.split(",") if o.strip())
        for op in ops:
            get_op(op)
    ckpt = open_checkpoint(resolve_model(a.model, quiet=a.quiet))
    cls, cfg = model_config(ckpt.config)
    ops = tuple(o for o in ops if o in REGISTRY)
    if a.m:
        workloads = cuda.workloads(cls, cfg, tuple(a.m), ops, cuda.families_off())
    else:   # the shapes a load tunes (both prefill chunks, the MoE's graph buckets, decode): a later run hits
        workloads = [w for w in cuda.CudaOps(dev).dense_workloads(cls, cfg) if w.op.name in ops]
    if not workloads:
        raise KilnError(f"this model runs none of the ops {', '.join(ops)}")
    if quantised(ckpt) and not a.quiet:
        print("[kiln] quantised weights: their GEMVs' shapes (op qgemv) come from the loaded weights, so "
              "`kiln tune` measures only the config's shapes; `kiln bench` (or a first `kiln run`) tunes them",
              file=sys.stderr)
    tuner = Tuner(dev, dtype, retune=a.retune, pins=parse_pins(a.tune), budget_s=a.budget, quiet=a.quiet)
    return dev, dtype, workloads, tuner


def quantised(ckpt) -> bool:
    """The checkpoint holds quantised weights, as far as its description says without loading them: a
    synthesized quantised draw (bits=B) or a config's quantisation entry (mlx-lm's); a GGUF file's tensor
    types are not looked at (an F16 file holds none)."""
    if ckpt.format == "synth":
        from ..weights.synth import parse_spec
        return parse_spec(str(ckpt.path)).bits is not None
    cfg = ckpt.config if isinstance(ckpt.config, dict) else {}
    return "quantization" in cfg or "quantization_config" in cfg


def table(rows: list) -> str:
    lines = ["| op | shape | variant | ms | how |", "|---|---|---|---:|---|"]
    for label, name, ms, how in rows:
        op, shape = label.split(" ", 1)
        lines.append(f"| {op} | {shape} | {name} | {'-' if ms is None else f'{ms:.4f}'} | {how} |")
    return "\n".join(lines)


def cmd_tune(a) -> int:
    _, _, workloads, tuner = setup(a)
    _, report = tuner.tune(workloads)
    print(table(report.rows))
    return 0


def source_text(fns: list, header: str) -> str:
    parts = [f"# {header}"]
    for fn in dict.fromkeys(fns):
        raw = getattr(fn, "fn", fn)   # the Python function under a Triton JIT/interpreter wrapper
        parts.append(inspect.getsource(raw))
    return "\n\n".join(parts)


def dump(plan, workloads, dtype, device, out: Path) -> list[Path]:
    written = []
    for w in workloads:
        v = plan.choices[w.label]
        stem = f"{w.op.name}_{w.op.shape_str(w.shape)}_{v.name}"
        fns = w.op.kernel_sources(v)
        if isinstance(fns, str):      # CUDA C (NVRTC): its source with the constants it was built with
            (out / f"{stem}.cu").write_text(f"// {w.label} -> {v.name} {dict(v.params)}; dtype {dtype}\n{fns}")
            written.append(out / f"{stem}.cu")
            continue
        if not fns:   # a composite variant: it runs other ops' chosen kernels
            (out / f"{stem}.txt").write_text(f"{w.label}: {v.name} runs other ops' chosen kernels (see their files)\n")
            written.append(out / f"{stem}.txt")
            continue
        header = f"{w.label} -> {v.name} {dict(v.params)}; dtype {dtype}"
        (out / f"{stem}.py").write_text(source_text(fns, header))
        written.append(out / f"{stem}.py")
        for i, kernel in enumerate(w.op.compile(v, w.shape, dtype, device)):
            suffix = "" if i == 0 else "." + kernel.name
            for ir in IR:
                if ir in kernel.asm:
                    path = out / f"{stem}{suffix}.{ir}"
                    path.write_text(kernel.asm[ir])
                    written.append(path)
    return written


def cmd_kernels(a) -> int:
    out = Path(a.dump)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KilnError(f"cannot create {out}: {e}") from None
    device, dtype, workloads, tuner = setup(a)
    plan, _ = tuner.tune(workloads)
    written = dump(plan, workloads, dtype, device, out)
    if interpreting() and not a.quiet:
        print("kiln: under TRITON_INTERPRET nothing is compiled: only the sources were written", file=sys.stderr)
    print(f"{len(written)} files in {out}")
    return 0
