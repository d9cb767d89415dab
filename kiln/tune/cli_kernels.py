"""`kiln kernels MODEL --dump DIR`: the source, Triton IR and PTX of every chosen kernel, each file
named after its op, shape and variant (e.g. gemm_512x1024x3584_bm128_bn128_bk64_w8_s4.ptx).
The choices come from the tune cache (or are measured first, as `kiln tune` would)."""

from __future__ import annotations

import inspect
import sys
from pathlib import Path

from ..errors import KilnError

IR = ("ttir", "ttgir", "llir", "ptx")


def add_parser(sub) -> None:
    from ..cli import add_runtime_flags
    from .cli import add_tune_flags

    p = sub.add_parser("kernels", help="dump the source, Triton IR and PTX of every kernel chosen for a model")
    add_runtime_flags(p)
    p.add_argument("--dump", required=True, metavar="DIR", help="folder to write the files into")
    add_tune_flags(p)


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


def main(a) -> int:
    from ..backends.cuda.common import interpreting
    from .cli import setup

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
