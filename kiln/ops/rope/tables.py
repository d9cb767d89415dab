"""The RoPE cos/sin tables of a step in one launch, the same values as the reference's torch ops.

Why: RopeReference.rope_tables is nine small torch kernels (the positions as f32, the product with
inv_freq, a cat, cos, sin, two products by the scaling and two casts); on the 0.8b's decode graph they
are 9 of ~211 launches (bench/NOTES.md, 2026-12-06). Here each program computes ROWS positions by
COLS frequencies: f = f32(position) * inv_freq[j], then cos(f) and sin(f) (libdevice's, the CUDA math
library that torch's own kernels call), times the scaling where it is not 1 (x * 1 == x), rounded to
the table's dtype, and stored at column j and j + R/2 (torch.cat([freqs, freqs])).

Whether libdevice's cos and sin give torch's bits is not assumed: the cuda backend (rope/cuda.py)
compares this kernel's tables with the reference's at the first call over 2^18 positions, once per
inverse-frequency tensor and dtype, and keeps the torch ops where one value differs. The interpreter
has no libdevice: there the kernel takes tl.cos and tl.sin (numpy's), for tests of its indexing.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from ...tune.device import interpreting
from ..common import EXACT_ROUNDING, cdiv, rne_flag, round_to

ROWS = 4        # positions a program (a decode step has one: the rest of its rows are masked work)
COLS = 32       # frequencies a program (the widths are a runtime value: one compile a dtype, not a model)



@triton.jit(do_not_specialize=["T", "HALF"])
def rope_tables_kernel(pos_ptr, inv_ptr, cos_ptr, sin_ptr, T, HALF, scaling, ROWS: tl.constexpr,
                       COLS: tl.constexpr, SCALE: tl.constexpr, LIBDEVICE: tl.constexpr, RNE: tl.constexpr):
    t = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    j = tl.program_id(1) * COLS + tl.arange(0, COLS)
    ok_t, ok_j = t < T, j < HALF
    pos = tl.load(pos_ptr + t, mask=ok_t, other=0).to(tl.float32)
    inv = tl.load(inv_ptr + j, mask=ok_j, other=0.0)
    f = pos[:, None] * inv[None, :]
    if LIBDEVICE:
        c = libdevice.cos(f)
        s = libdevice.sin(f)
    else:
        c = tl.cos(f)
        s = tl.sin(f)
    if SCALE:
        c = c * scaling
        s = s * scaling
    dtype = cos_ptr.dtype.element_ty
    c = round_to(c, dtype, RNE)
    s = round_to(s, dtype, RNE)
    ok = ok_t[:, None] & ok_j[None, :]
    at = t.to(tl.int64)[:, None] * (2 * HALF) + j[None, :]
    tl.store(cos_ptr + at, c, mask=ok)
    tl.store(cos_ptr + at + HALF, c, mask=ok)
    tl.store(sin_ptr + at, s, mask=ok)
    tl.store(sin_ptr + at + HALF, s, mask=ok)


def tables_on() -> bool:
    """KILN_ROPE_TABLES=1 turns the kernel on (off by default until its GPU test and an A/B have run on a GPU:
    built on 2026-12-06 without device time left; tools/README's rope tables line)."""
    return os.environ.get("KILN_ROPE_TABLES", "0") == "1"


def takes(positions: torch.Tensor, inv_freq: torch.Tensor) -> bool:
    """int64 positions [T] and f32 inverse frequencies [R/2], contiguous (the reference's .float() of
    another dtype is a conversion this kernel does not make)."""
    return (positions.dtype == torch.int64 and positions.dim() == 1 and positions.is_contiguous()
            and inv_freq.dtype == torch.float32 and inv_freq.dim() == 1 and inv_freq.is_contiguous())


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor, dtype: torch.dtype, scaling: float = 1.0):
    """(cos, sin) [T, R] in `dtype`, R = 2 len(inv_freq), as RopeReference.rope_tables computes them."""
    t, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty((t, 2 * half), dtype=dtype, device=positions.device)
    sin = torch.empty_like(cos)
    if t:
        rope_tables_kernel[(cdiv(t, ROWS), cdiv(half, COLS))](
            positions, inv_freq, cos, sin, t, half, float(scaling), ROWS=ROWS, COLS=COLS, SCALE=scaling != 1.0,
            LIBDEVICE=not interpreting(), RNE=rne_flag(dtype), num_warps=1, **EXACT_ROUNDING)
    return cos, sin


def differing(inv_freq: torch.Tensor, dtype: torch.dtype, scaling: float = 1.0, positions: int = 1 << 18,
              chunk: int = 1 << 14) -> tuple[int, int]:
    """(values that differ, values compared): this kernel's tables against RopeReference's, bit for bit,
    at positions [0, `positions`): past about 10^5 radians (inv_freq 1 from position 105,615) CUDA's cosf and
    sinf take their large-argument reduction, so the range holds both paths."""
    from .reference import RopeReference

    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[torch.empty((), dtype=dtype).element_size()]
    bad = total = 0
    for start in range(0, positions, chunk):
        pos = torch.arange(start, min(positions, start + chunk), device=inv_freq.device)
        got = rope_tables(pos, inv_freq, dtype, scaling)
        want = RopeReference().rope_tables(pos, inv_freq, dtype, scaling)
        for g, w in zip(got, want):
            bad += int((g.view(bits) != w.view(bits)).sum())
            total += g.numel()
    return bad, total
