"""Elementwise kernels that save a launch or two per layer at decode, rounding where torch does
(kiln/ops/gemm/reference.py, act_mul): act(g) rounded to the activation dtype, then the
product with u rounded. Not tuned: one row (or a BLOCK of it) per program, bandwidth-bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import SUPPORTED, cdiv, next_pow2, pdl, pdl_wait, rne_flag, round_to

ACTS = {"silu": 0, "sigmoid": 1}     # torch's formulas in f32 (tanh-based GELU stays in torch)
BLOCK = 1024


@triton.jit
def act_f32(x, ACT: tl.constexpr):
    """torch's CUDA formulas: silu x / (1 + exp(-x)); sigmoid 1 / (1 + exp(-x))."""
    if ACT == 0:
        y = x / (1.0 + tl.exp(-x))
    else:
        y = 1.0 / (1.0 + tl.exp(-x))
    return y


@triton.jit(do_not_specialize=["g_stride", "u_stride"])
def act_mul_kernel(g_ptr, u_ptr, y_ptr, g_stride, u_stride, N: tl.constexpr, BLOCK_N: tl.constexpr,
                   ACT: tl.constexpr, RNE: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, column block): y[row] = round(round(act(g[row])) * u[row]); g and u have row
    strides (views of a concatenated projection), y is contiguous."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = cols < N
    dtype = y_ptr.dtype.element_ty
    g = tl.load(g_ptr + row * g_stride + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + cols, mask=m, other=0.0).to(tl.float32)
    a = round_to(act_f32(g, ACT), dtype, RNE).to(tl.float32)
    tl.store(y_ptr + row * N + cols, round_to(a * u, dtype, RNE), mask=m)


def rows2d(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, last] with a contiguous last dim: a view where the strides allow it."""
    x2 = x.reshape(-1, x.shape[-1])
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def supports(g: torch.Tensor, u: torch.Tensor, act: str) -> bool:
    return act in ACTS and g.dtype in SUPPORTED and g.dtype == u.dtype and g.shape == u.shape


def act_mul(g: torch.Tensor, u: torch.Tensor, act: str, y: torch.Tensor | None = None) -> torch.Tensor:
    """act(g) * u in one pass; y (given: contiguous) shaped like g."""
    g2, u2 = rows2d(g), rows2d(u)
    rows, n = g2.shape
    y = torch.empty(g.shape, dtype=g.dtype, device=g.device) if y is None else y
    if rows == 0:
        return y
    bn = min(BLOCK, next_pow2(n))
    act_mul_kernel[(rows, cdiv(n, bn))](g2, u2, y, g2.stride(0), u2.stride(0), N=n, BLOCK_N=bn, ACT=ACTS[act],
                                        RNE=rne_flag(g.dtype), num_warps=4, **pdl(g2))
    return y
