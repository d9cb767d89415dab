"""Gemma 4's residual step around its sandwich norms in one launch (NormReference.residual_norms):

  u = norm(a, a_w) + norm(b, b_w)   (TWO: the dense MLP's and the experts' outputs)   else  u = a
  s = x + norm(u, post_w);  s = s * scalar   (SCALAR: layer_scalar)
  y1 = norm(s, w1);  y2 = norm(s, w2);  r = (norm_noscale(s) * router_scale) * H^-0.5   (each optional)

where the reference runs five to twelve torch ops and launches. Every intermediate is rounded to the
activation dtype where the reference's own op rounds it, so the result is the reference's to the
order of the f32 sums of squares. Each program takes ROWS rows whole (the rmsnorm op's tuned choice).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import SUPPORTED, cdiv, next_pow2, pdl, pdl_wait, rne_flag, round_to
from .kernels import STYLES, scale_normed


@triton.jit
def normed(xf, wf, eps, D: tl.constexpr, STYLE: tl.constexpr, dtype: tl.constexpr, RNE: tl.constexpr):
    """rmsnorm of rows xf [R, C] (f32, zero past D) by wf [C], rounded to dtype, back in f32."""
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
    return scale_normed(xf, rstd, wf, STYLE, dtype, RNE).to(tl.float32)


@triton.jit
def weight(w_ptr, cols, live):
    return tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["rows"])
def sandwich_kernel(x_ptr, a_ptr, b_ptr, aw_ptr, bw_ptr, pw_ptr, sc_ptr, w1_ptr, w2_ptr, rw_ptr,
                    s_ptr, y1_ptr, y2_ptr, r_ptr, rows, eps, rscale,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, STYLE: tl.constexpr,
                    RNE: tl.constexpr, TWO: tl.constexpr, SCALAR: tl.constexpr, Y1: tl.constexpr,
                    Y2: tl.constexpr, ROUTER: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    live = cols < D
    inside = (row < rows)[:, None] & live[None, :]
    offs = row.to(tl.int64)[:, None] * D + cols[None, :]
    dtype = s_ptr.dtype.element_ty
    pdl_wait(PDL)
    u = tl.load(a_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    if TWO:
        bf = tl.load(b_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        u = normed(u, weight(aw_ptr, cols, live), eps, D, STYLE, dtype, RNE)
        u = round_to(u + normed(bf, weight(bw_ptr, cols, live), eps, D, STYLE, dtype, RNE), dtype, RNE)
        u = u.to(tl.float32)
    xf = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    s = round_to(xf + normed(u, weight(pw_ptr, cols, live), eps, D, STYLE, dtype, RNE), dtype, RNE).to(tl.float32)
    if SCALAR:
        s = round_to(s * tl.load(sc_ptr).to(tl.float32), dtype, RNE).to(tl.float32)
    tl.store(s_ptr + offs, s.to(dtype), mask=inside)
    rstd = tl.math.rsqrt(tl.sum(s * s, axis=1) / D + eps)
    if Y1:
        tl.store(y1_ptr + offs, scale_normed(s, rstd, weight(w1_ptr, cols, live), STYLE, dtype, RNE), mask=inside)
    if Y2:
        tl.store(y2_ptr + offs, scale_normed(s, rstd, weight(w2_ptr, cols, live), STYLE, dtype, RNE), mask=inside)
    if ROUTER:
        n = round_to(s * rstd[:, None], dtype, RNE).to(tl.float32)
        n = round_to(n * weight(rw_ptr, cols, live)[None, :], dtype, RNE).to(tl.float32)
        tl.store(r_ptr + offs, round_to(n * rscale, dtype, RNE), mask=inside)


def supports(x, a, b, weights) -> bool:
    """One dtype, rows of one width D, every weight [D]."""
    d = x.shape[-1]
    tensors = [t for t in (a, b) if t is not None]
    return (x.dtype in SUPPORTED and all(t.shape == x.shape and t.dtype == x.dtype for t in tensors)
            and all(w.dtype == x.dtype and w.shape[-1] == d and w.numel() == d for w in weights))


def residual_norms(x, a, eps, style, post_w, rows_per_program: int, warps: int, a_w=None, b=None, b_w=None,
                   scalar=None, outs=(), router=None):
    """NormReference.residual_norms in one launch: (s, [norm(s, w) for w in outs] + [router input])."""
    d = x.shape[-1]
    x, a = x.reshape(-1, d).contiguous(), a.reshape(-1, d).contiguous()
    b = None if b is None else b.reshape(-1, d).contiguous()
    assert len(outs) <= 2, "at most two normed outputs besides the router's input"
    rows = x.shape[0]
    s = torch.empty_like(x)
    ys = [torch.empty_like(x) for _ in range(len(outs) + (router is not None))]
    if rows:
        y1 = ys[0] if outs else s      # an output never written where its flag is off
        y2 = ys[1] if len(outs) > 1 else s
        r = ys[-1] if router is not None else s
        any_w = post_w                 # likewise a weight never read
        args = (x, a, x if b is None else b, any_w if a_w is None else a_w, any_w if b_w is None else b_w, post_w,
                any_w if scalar is None else scalar, outs[0] if outs else any_w,
                outs[1] if len(outs) > 1 else any_w, any_w if router is None else router)
        sandwich_kernel[(cdiv(rows, rows_per_program),)](
            *args, s, y1, y2, r, rows, eps, d ** -0.5, D=d, BLOCK_D=next_pow2(d), ROWS=rows_per_program,
            STYLE=STYLES[style], RNE=rne_flag(x.dtype), TWO=b is not None, SCALAR=scalar is not None,
            Y1=len(outs) > 0, Y2=len(outs) > 1, ROUTER=router is not None, num_warps=warps, **pdl(x))
    return s, ys
