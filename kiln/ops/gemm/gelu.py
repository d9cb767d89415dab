"""act(g) * u for GELU's tanh form (Gemma's MLP), one launch where torch takes two (the GELU, then the
product) and neither of them waits on the kernel before it (PDL) as kiln's do. The formula is the MoE
kernels' (g sigmoid(2u), kiln/ops/moe/kernels.py activate), rounded as ReferenceOps.act_mul rounds:
act(g) to the activation dtype, then the product. Apart from activation.py, which every projection
kernel compiles from: editing that file would retire every shipped GEMM choice.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import SUPPORTED, cdiv, next_pow2, pdl, pdl_wait, rne_flag, round_to
from ..moe.kernels import ACTS as MOE_ACTS
from ..moe.kernels import activate
from .activation import BLOCK, rows2d

GELU = tl.constexpr(MOE_ACTS["gelu_pytorch_tanh"])


@triton.jit(do_not_specialize=["g_stride", "u_stride"])
def gelu_mul_kernel(g_ptr, u_ptr, y_ptr, g_stride, u_stride, N: tl.constexpr, BLOCK_N: tl.constexpr,
                    RNE: tl.constexpr, PDL: tl.constexpr = False):
    """Program (row, column block): y[row] = round(round(gelu(g[row])) * u[row]), as act_mul_kernel."""
    pdl_wait(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    m = cols < N
    dtype = y_ptr.dtype.element_ty
    g = tl.load(g_ptr + row * g_stride + cols, mask=m, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_stride + cols, mask=m, other=0.0).to(tl.float32)
    a = round_to(activate(g, GELU), dtype, RNE).to(tl.float32)
    tl.store(y_ptr + row * N + cols, round_to(a * u, dtype, RNE), mask=m)


def supports(g: torch.Tensor, u: torch.Tensor, act: str) -> bool:
    return act == "gelu_pytorch_tanh" and g.dtype in SUPPORTED and g.dtype == u.dtype and g.shape == u.shape


def gelu_mul(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """gelu_tanh(g) * u in one pass, shaped like g (contiguous)."""
    g2, u2 = rows2d(g), rows2d(u)
    rows, n = g2.shape
    y = torch.empty(g.shape, dtype=g.dtype, device=g.device)
    if rows:
        bn = min(BLOCK, next_pow2(n))
        gelu_mul_kernel[(rows, cdiv(n, bn))](g2, u2, y, g2.stride(0), u2.stride(0), N=n, BLOCK_N=bn,
                                             RNE=rne_flag(g.dtype), num_warps=4, **pdl(g2))
    return y
