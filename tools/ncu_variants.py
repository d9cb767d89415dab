"""Nsight Compute on kiln's GEMM forms and cuBLAS at one shape (issue 4's slowest: 512 x 1024 x 3584,
kiln 14.8 us against cuBLAS 9.7): is it L2 traffic, the split-K finish, or the pipeline? Each form
runs a few times, then once inside an NVTX range "measure" that ncu selects, e.g.

    ncu --nvtx --nvtx-include "measure/" --section SpeedOfLight --section MemoryWorkloadAnalysis \
        --section LaunchStats --section Occupancy --section WarpStateStats \
        python3 bench/gemm_ncu.py 512 1024 3584 cublas bm128_bn64_bk64_w4_s4_sk2 ...

Kernels appear in the report in the order of the forms given ("ran FORM" lines say which).
"""

from __future__ import annotations

import sys

import torch

from kiln.backends.cuda import gemm as G
from kiln.backends.cuda.common import device_info


def form_runner(name: str, shape, inputs: dict, outputs: dict):
    if name == "cublas":
        x, w = inputs["x"], inputs["w"]
        return lambda: torch.matmul(x, w.t(), out=outputs["y"])
    dev = device_info(inputs["x"].device)
    v = next((v for v in G.OP.catalogue(shape, dev) if v.name == name), None)
    if v is None:
        raise SystemExit(f"no gemm form named {name} for {shape} (see the tune log for the names)")
    return lambda: G.OP.run(v, inputs, outputs)


def main(m: int, n: int, k: int, forms: list[str]) -> None:
    shape = G.GemmShape(m, n, k)
    cuda = torch.cuda.is_available()       # (CPU: a smoke run under TRITON_INTERPRET=1)
    dev = torch.device("cuda" if cuda else "cpu")
    inputs = G.OP.inputs(shape, torch.bfloat16, dev, torch.Generator(device=dev).manual_seed(0))
    outputs = G.OP.outputs(shape, inputs)
    want = inputs["x"].float() @ inputs["w"].float().t()
    for name in forms:
        run = form_runner(name, shape, inputs, outputs)
        for _ in range(3 if cuda else 1):
            run()
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("measure")
            run()
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_pop()
        err = (outputs["y"].float() - want).abs().max().item()
        print(f"ran {name} (max abs err against f32 {err:.3g})", flush=True)


if __name__ == "__main__":
    a = sys.argv[1:]
    main(int(a[0]), int(a[1]), int(a[2]), a[3:] or ["cublas", "bm128_bn64_bk64_w4_s4_sk2",
                                                    "bm128_bn128_bk64_w8_s4_sk4", "bm128_bn256_bk64_w8_s3_sk4"])
