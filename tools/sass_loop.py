"""A Triton kernel's SASS for Hopper, built on a machine without a GPU, and the instruction mix of
its innermost loop: how many instructions a weight a variant costs before any device time is spent.

    .venv/bin/python tools/sass_loop.py qgemv_fma BN BW WARPS SPLIT_K PF X3 [N K BITS G]
    .venv/bin/python tools/sass_loop.py qgemv_mma BN SUB WARPS SPLIT_K [STAGES N K BITS G ASM]

Triton compiles for a named target (sm_90) without a device, and its wheel carries ptxas and
cuobjdump. Pointers are declared 16-byte aligned, as Triton specialises them at launch (without that
the words load as 32-bit scalars, not 128-bit vectors). The CI stack's Triton may differ from the GPU
machine's: the counts are a guide, the GPU's timings the judge.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def build(fn, sig: dict, consts: dict, warps: int, stages: int = 3):
    """Compile fn for sm_90 with the given signature (pointer arguments 16-byte aligned)."""
    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n, t in sig.items() if t.startswith("*")}
    src = ASTSource(fn=fn, signature=sig, constexprs=consts, attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})


def sass(kernel) -> str:
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        return subprocess.run([str(tool), "-sass", f.name], capture_output=True, text=True, check=True).stdout


def innermost_loop(text: str) -> tuple[int, int, Counter]:
    """(start, end, opcode counts) of the shortest backward branch's body over 1 KiB of code."""
    ins = []
    for line in text.splitlines():
        m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(@!?U?P[0-9T]\s+)?([A-Z0-9_.]+)(.*);", line)
        if m:
            ins.append((int(m.group(1), 16), m.group(3), m.group(4)))
    loops = []
    for addr, op, rest in ins:
        t = re.search(r"0x([0-9a-f]+)", rest)
        if op == "BRA" and t and 0x400 < addr - int(t.group(1), 16):
            loops.append((addr - int(t.group(1), 16), int(t.group(1), 16), addr))
    if not loops:
        return 0, 0, Counter()
    _, start, end = min(loops)
    return start, end, Counter(op.split(".")[0] for a, op, _ in ins if start <= a <= end)


def qgemv_fma(bn, bw, warps, sk, pf, x3, n=12288, k=4096, bits=4, g=64):
    from kiln.ops.quant import kernels

    sig = {"x_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16",
           "ws_ptr": "*fp32", "count_ptr": "*i32", "M": "i32"}
    consts = {"N": n, "K": k, "BITS": bits, "G": g, "BN": bn, "BW": bw, "SPLIT_K": sk, "RNE": False,
              "PF": bool(pf), "X3": bool(x3), "ACT": -1, "NORM": 0, "STYLE": 0, "KP": 16, "XDIV": 0, "PDL": False,
              # the plain GEMV: no prologue, no routed experts (their pointers absent, as a launch passes None)
              "nw_ptr": None, "r_ptr": None, "sum_ptr": None, "idx_ptr": None, "rw_ptr": None}
    sig.update({c: "constexpr" for c in consts})
    sig["eps"] = "fp32"
    per_thread = bn * bw // (32 * warps) * (32 // bits)       # values a thread a step
    return build(kernels.qgemv_fma_kernel, sig, consts, warps), per_thread


def qgemv_mma(bn, sub, warps, sk, stages=3, n=12288, k=4096, bits=4, g=64, asm=1):
    from kiln.ops.quant import mma

    sig = {"x_ptr": "*bf16", "q_ptr": "*i32", "s_ptr": "*bf16", "b_ptr": "*bf16", "y_ptr": "*bf16",
           "ws_ptr": "*fp32", "count_ptr": "*i32", "M": "i32"}
    consts = {"N": n, "K": k, "BITS": bits, "G": g, "BN": bn, "SUB": sub, "SPLIT_K": sk, "RNE": False,
              "ASM": bool(asm), "PDL": False}
    sig.update({c: "constexpr" for c in consts})
    per_thread = bn * 16 * g // (32 * warps)       # values a thread a chunk (16 groups)
    return build(mma.qgemv_mma_kernel, sig, consts, warps, stages), per_thread


KERNELS = {"qgemv_fma": qgemv_fma, "qgemv_mma": qgemv_mma}


def main() -> None:
    if len(sys.argv) < 2 or sys.argv[1] not in KERNELS:
        sys.exit(f"usage: sass_loop.py {{{','.join(KERNELS)}}} ARGS... (see the docstring)")
    kernel, values = KERNELS[sys.argv[1]](*[int(a) for a in sys.argv[2:]])
    start, end, mix = innermost_loop(sass(kernel))
    total = sum(mix.values())
    print(f"loop {start:#x}-{end:#x}: {total} instructions, {values} values a thread a step, "
          f"{total / max(values, 1):.2f} a value; {kernel.metadata.shared} B shared")
    print("  " + ", ".join(f"{op} {c}" for op, c in mix.most_common(16)))


if __name__ == "__main__":
    main()
