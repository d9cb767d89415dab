"""Nsight Compute on the GDN decode kernel (qwen3.5-0.8b's shape unless told): why does one step take
~10 us whatever the block size (bench/NOTES.md)? Runs the given fused forms a few times each; run it
under ncu, e.g.

    ncu --kernel-name regex:decode_kernel --launch-skip 3 --launch-count 2 --section SpeedOfLight \
        --section WarpStateStats --section LaunchStats --section Occupancy python3 bench/gdn_decode_ncu.py
"""

from __future__ import annotations

import re
import sys

import torch

from kiln.backends.cuda import gdn as D


def main(forms: list[str], hk: int = 16, hv: int = 16, dk: int = 128, dv: int = 128) -> None:
    shape = D.GdnShape(1, hk, hv, dk, dv, 4)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")    # (cpu: under TRITON_INTERPRET=1)
    gen = torch.Generator(device=dev).manual_seed(0)
    inputs = D.DECODE.inputs(shape, torch.bfloat16, dev, gen)
    for name in forms:
        bv, w = (int(x) for x in re.match(r"fused_bv(\d+)_w(\d+)", name).groups())
        v = D.fused_variant(bv, w, last=name.endswith("_last"))
        for _ in range(5):
            D.DECODE.run(v, inputs, D.DECODE.outputs(shape, inputs))
        if dev.type == "cuda":
            torch.cuda.synchronize()
        print(f"ran {v.name}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["fused_bv128_w4", "fused_bv16_w4"])
