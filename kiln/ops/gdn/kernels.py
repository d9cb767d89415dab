"""Gated DeltaNet: the fused decode step and the chunked prefill, rounding where the reference does
(kiln.backends.reference.ReferenceOps.gated_deltanet and the methods it calls).

State: conv [K, C] (activation dtype, the last K conv inputs, oldest first) and ssm [Hv, dk, dv] f32,
both updated in place. Model dimensions (Hk, Hv, dk, dv, K) are `tl.constexpr`; the token count T is
a runtime argument that is not specialised.

Kernels:
  conv_kernel       causal depthwise conv over [conv[1:], x] + SiLU; the program of the first token
                    block (the only one reading the state) writes the new last K inputs.
  recurrent_kernel  token by token (no tl.dot), one program per value head, gated norm fused: the
                    trusted prefill, and with conv_kernel the trusted ("unfused") decode step.
  decode_kernel     the whole decode step in one launch: conv + SiLU + l2norm of the q/k head it needs
                    (recomputed by every program that reads it), the delta rule on a [dk, BV] state
                    tile, the gated norm when BV == dv (else a second tiny norm_kernel pass).
  prep_kernel       per (value head, chunk of 64): A = strictly-lower(k_beta k^T * decay), (I + A)^-1
                    on tensor cores, w = (I + A)^-1 (k_beta * exp(cum)), u = (I + A)^-1 (v * beta).
  scan_kernel       per (value head, dv block): the chunks in order with the state tile in registers;
                    gated norm fused when BV == dv.
  state_kernel      the split form (fla's layout): per (value head, dv block) the chunks in order, storing
  output_kernel     the state before each chunk and v_new; then every (chunk, head, dv block) output at
                    once. The serial part is two small dots a chunk instead of five plus the norm.

Dot precision of prep/scan (PREC of a chunk variant): "ieee" / "tf32x3" / "tf32" multiply f32 operands;
"bf16" rounds both operands of every dot to the activation dtype (when it is 16-bit; with f32
activations it is "ieee") and accumulates in f32 on tensor cores, as flash-linear-attention does. The
state S stays f32 in registers and memory; only its copy fed to a dot is rounded. The (I + A)^-1 solve
stays f32 ("ieee"): its products feed every w and u, and it is a small share of the work.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...tune.registry import Op, Variant, register, try_unmeasured, variant
from .common import COMMON, SUPPORTED, cdiv, device_info, dot_flags, interpreting, pdl, pdl_wait, rne_flag, round_to
from .gemm import __file__ as GEMM_FILE
from .gemm import last_arrival

CHUNK = 64          # the reference's chunk (and the unit of the WY/UT solve)
CONV_BT = 16        # tokens per conv program; must be >= K - 1 (only the first block reads the state)


# -- elementwise helpers -----------------------------------------------------------------------------

@triton.jit
def silu_f32(x):
    """torch's silu: x / (1 + exp(-x))."""
    return x / (1.0 + tl.exp(-x))


@triton.jit
def softplus(x):
    """torch's softplus (threshold 20), with a log1p that keeps precision where exp(x) is tiny."""
    e = tl.exp(x)
    u = 1.0 + e
    lp = tl.where(u == 1.0, e, tl.log(u) * (e / (u - 1.0)))
    return tl.where(x > 20.0, x, lp)


@triton.jit
def decay_beta(a, b, alog, dtb, dtype: tl.constexpr, RNE: tl.constexpr):
    """g = -exp(A_log) * softplus(a + dt_bias) in f32; beta = sigmoid(b) rounded to the activation dtype."""
    g = -tl.exp(alog) * softplus(a + dtb)
    beta = round_to(tl.sigmoid(b), dtype, RNE).to(tl.float32)
    return g, beta


@triton.jit
def silu_rounded(acc, dtype: tl.constexpr, RNE: tl.constexpr):
    """The conv sum (f32) rounded to the activation dtype, then SiLU, rounded again (as F.silu on it)."""
    x = round_to(acc, dtype, RNE).to(tl.float32)
    return round_to(silu_f32(x), dtype, RNE).to(tl.float32)


@triton.jit
def l2norm_rows(x):
    """x [R, D] * rsqrt(sum x^2 + 1e-6) per row."""
    return x * tl.math.rsqrt(tl.sum(x * x, axis=1) + 1e-6)[:, None]


@triton.jit
def gated_norm(o, zf, wf, eps, D: tl.constexpr, ROUND_WN: tl.constexpr, dtype: tl.constexpr, RNE: tl.constexpr):
    """Rows o [R, D] (f32, already rounded to the activation dtype): (w * rmsnorm(o).cast) * silu(z),
    rounded; w * normed is rounded too when both are 16-bit (ROUND_WN), as torch's product is."""
    rstd = tl.math.rsqrt(tl.sum(o * o, axis=1) / D + eps)
    normed = round_to(o * rstd[:, None], dtype, RNE).to(tl.float32)
    wn = wf[None, :] * normed
    if ROUND_WN:
        wn = round_to(wn, dtype, RNE).to(tl.float32)
    return round_to(wn * silu_f32(zf), dtype, RNE)


# -- conv --------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["T"])
def conv_kernel(x_ptr, w_ptr, st_ptr, y_ptr, T, C: tl.constexpr, K: tl.constexpr, BT: tl.constexpr,
                BC: tl.constexpr, RNE: tl.constexpr):
    """y[t, c] = silu(sum_j w[c, j] * full[t + j, c]), full = [st[1:], x] ([K-1+T, C]). Program
    (tb, cb); BT >= K - 1, so only tb == 0 reads the state, and it alone writes the new state."""
    tb, cb = tl.program_id(0), tl.program_id(1)
    t = tb * BT + tl.arange(0, BT)
    c = cb * BC + tl.arange(0, BC)
    cm = (c < C)[None, :]
    tm = (t < T)[:, None]
    dtype = y_ptr.dtype.element_ty
    acc = tl.zeros((BT, BC), dtype=tl.float32)
    for j in tl.static_range(K):
        r = (t - (K - 1) + j)[:, None]                      # input row in x; < 0: state row K + r
        xv = tl.load(x_ptr + r.to(tl.int64) * C + c[None, :], mask=(r >= 0) & tm & cm, other=0.0)
        sv = tl.load(st_ptr + (K + r) * C + c[None, :], mask=(r < 0) & tm & cm, other=0.0)
        wj = tl.load(w_ptr + c * K + j, mask=c < C, other=0.0).to(tl.float32)
        acc += wj[None, :] * (xv.to(tl.float32) + sv.to(tl.float32))
    y = silu_rounded(acc, dtype, RNE)
    tl.store(y_ptr + t.to(tl.int64)[:, None] * C + c[None, :], y.to(dtype), mask=tm & cm)
    if tb == 0:
        # NOTE: every thread's state loads above come first; new row j = full[T - 1 + j], read from a
        # later state row (T + j > j) or from x, so writing rows in ascending order never clobbers
        # a row still to be read.
        tl.debug_barrier()
        for j in tl.static_range(K):
            i = T - 1 + j + tl.zeros_like(c)               # a tensor (T may arrive as a Python int)
            from_st = i < K - 1
            old = tl.load(st_ptr + (i + 1) * C + c, mask=(c < C) & from_st, other=0.0)
            new = tl.load(x_ptr + (i - (K - 1)).to(tl.int64) * C + c, mask=(c < C) & (i >= K - 1), other=0.0)
            row = tl.where(from_st, old, new)     # names unused above: Triton keeps a name's type across an if
            tl.debug_barrier()
            tl.store(st_ptr + j * C + c, row, mask=c < C)


def conv(qkv: torch.Tensor, conv_w: torch.Tensor, conv_state: torch.Tensor, bc: int = 128) -> torch.Tensor:
    """silu(causal conv) [T, C] in the activation dtype; conv_state updated in place."""
    t, c = qkv.shape
    k = conv_w.shape[-1]
    assert CONV_BT >= k - 1
    y = torch.empty_like(qkv)
    conv_kernel[(cdiv(t, CONV_BT), cdiv(c, bc))](qkv, conv_w, conv_state, y, t, C=c, K=k, BT=CONV_BT, BC=bc,
                                                  RNE=rne_flag(qkv.dtype), num_warps=4)
    return y


# -- the recurrent (trusted) form ---------------------------------------------------------------------

@triton.jit(do_not_specialize=["T"])
def recurrent_kernel(xc_ptr, z_ptr, b_ptr, a_ptr, alog_ptr, dtb_ptr, nw_ptr, ssm_ptr, y_ptr, T, eps, scale,
                     HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                     ROUND_WN: tl.constexpr, RNE: tl.constexpr):
    """One program per value head; token by token over the conv output xc [T, C]: S = S*exp(g);
    u = (v - S^T k)*beta; S += k (x) u; o = S^T q; y = gated_norm(o)."""
    h = tl.program_id(0)
    kh = h // (HV // HK)
    C: tl.constexpr = 2 * HK * DK + HV * DV
    dtype = y_ptr.dtype.element_ty
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    sp = ssm_ptr + h.to(tl.int64) * DK * DV + dk[:, None] * DV + dv[None, :]
    s = tl.load(sp)                                                         # [DK, DV] f32
    alog = tl.load(alog_ptr + h).to(tl.float32)
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    wf = tl.load(nw_ptr + dv).to(tl.float32)
    row, zrow, yrow = xc_ptr, z_ptr + h * DV, y_ptr + h * DV        # pointers step a token at a time (64-bit)
    for t in range(T):
        q = tl.load(row + kh * DK + dk[None, :]).to(tl.float32)                  # [1, DK]
        k = tl.load(row + HK * DK + kh * DK + dk[None, :]).to(tl.float32)
        v = tl.load(row + 2 * HK * DK + h * DV + dv).to(tl.float32)
        q = l2norm_rows(q) * scale
        k = l2norm_rows(k)
        a = tl.load(a_ptr + t * HV + h).to(tl.float32)
        b = tl.load(b_ptr + t * HV + h).to(tl.float32)
        g, beta = decay_beta(a, b, alog, dtb, dtype, RNE)
        s = s * tl.exp(g)
        u = (v - tl.sum(s * tl.trans(k), axis=0)) * beta
        s = s + tl.trans(k) * u[None, :]
        o = round_to(tl.sum(s * tl.trans(q), axis=0), dtype, RNE).to(tl.float32)
        zf = tl.load(zrow + dv[None, :]).to(tl.float32)
        tl.store(yrow + dv[None, :], gated_norm(o[None, :], zf, wf, eps, DV, ROUND_WN, dtype, RNE))
        row += C
        zrow += HV * DV
        yrow += HV * DV
    tl.store(sp, s)


# -- the decode step in one launch --------------------------------------------------------------------

@triton.jit
def conv_prefetch(cs_ptr, w_ptr, c, C: tl.constexpr, K: tl.constexpr):
    """Channels c's conv state rows 1..3 (stored dtype) and the K = 4 weight columns (f32), each its
    own vector (no tile to take rows out of). Neither depends on the kernel before (PDL: loaded
    before pdl_wait)."""
    tl.static_assert(K == 4, "the fused GDN decode takes a conv kernel of 4 (Qwen3.5's)")
    r1 = tl.load(cs_ptr + C + c)
    r2 = tl.load(cs_ptr + 2 * C + c)
    r3 = tl.load(cs_ptr + 3 * C + c)
    w0 = tl.load(w_ptr + c * K).to(tl.float32)
    w1 = tl.load(w_ptr + c * K + 1).to(tl.float32)
    w2 = tl.load(w_ptr + c * K + 2).to(tl.float32)
    w3 = tl.load(w_ptr + c * K + 3).to(tl.float32)
    return r1, r2, r3, w0, w1, w2, w3


@triton.jit
def decode_conv(x, r1, r2, r3, w0, w1, w2, w3, dtype: tl.constexpr, RNE: tl.constexpr):
    """silu(conv) at the new token x; the sum runs as the unfused conv's: the newest input first,
    then the oldest to the newest."""
    acc = w3 * x.to(tl.float32)
    acc += w0 * r1.to(tl.float32)
    acc += w1 * r2.to(tl.float32)
    acc += w2 * r3.to(tl.float32)
    return silu_rounded(acc, dtype, RNE)


@triton.jit
def store_state(cs_ptr, x, r1, r2, r3, c, C: tl.constexpr):
    """conv state of channels c <- [cs[1:], x]; every read of cs by this program is done."""
    tl.store(cs_ptr + c, r1)
    tl.store(cs_ptr + C + c, r2)
    tl.store(cs_ptr + 2 * C + c, r3)
    tl.store(cs_ptr + 3 * C + c, x)


@triton.jit
def decode_kernel(x_ptr, z_ptr, b_ptr, a_ptr, cw_ptr, alog_ptr, dtb_ptr, nw_ptr, cs_ptr, ssm_ptr, y_ptr, o_ptr,
                  count_ptr, eps, scale, HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                  K: tl.constexpr, BV: tl.constexpr, ROUND_WN: tl.constexpr, RNE: tl.constexpr,
                  LAST_NORM: tl.constexpr = False, PDL: tl.constexpr = False):
    """Program (value head h, dv block vb). Conv state: the program owns its v channels and shifts them
    after reading; the q/k channels of key head kh are read by READERS programs, and the last of them
    to arrive (an arrival counter, as in serial split-K) shifts them, so no program reads a shifted row.
    BV == DV: the gated norm here, else o goes to o_ptr for norm_kernel, or (LAST_NORM) the last of
    the head's DV // BV programs to arrive (counter HK + h) norms the whole row. The state block loads
    before pdl_wait: only this layer's previous step writes it."""
    h, vb = tl.program_id(0), tl.program_id(1)
    kh = h // (HV // HK)
    C: tl.constexpr = 2 * HK * DK + HV * DV
    READERS: tl.constexpr = (HV // HK) * (DV // BV)
    dtype = y_ptr.dtype.element_ty
    dk = tl.arange(0, DK)
    cols = vb * BV + tl.arange(0, BV)
    sp = ssm_ptr + h.to(tl.int64) * DK * DV + dk[:, None] * DV + cols[None, :]
    # Loaded before pdl_wait: the state, the conv state and the weights (only this layer's previous
    # step writes the states); after it only what the kernel before wrote (x, z, a, b).
    s = tl.load(sp)                                                           # [DK, BV] f32
    qc, kc, vc = kh * DK + dk, HK * DK + kh * DK + dk, 2 * HK * DK + h * DV + cols
    q1, q2, q3, qw0, qw1, qw2, qw3 = conv_prefetch(cs_ptr, cw_ptr, qc, C, K)
    k1, k2, k3, kw0, kw1, kw2, kw3 = conv_prefetch(cs_ptr, cw_ptr, kc, C, K)
    v1, v2, v3, vw0, vw1, vw2, vw3 = conv_prefetch(cs_ptr, cw_ptr, vc, C, K)
    alog = tl.load(alog_ptr + h).to(tl.float32)
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    if BV == DV:
        wf = tl.load(nw_ptr + cols).to(tl.float32)
    pdl_wait(PDL)
    # Everything the kernel before wrote, in one round trip: each load after the first math waits
    # a whole memory latency more (ncu: the step is a latency chain, not a bandwidth one).
    qx, kx, vx = tl.load(x_ptr + qc), tl.load(x_ptr + kc), tl.load(x_ptr + vc)
    a = tl.load(a_ptr + h).to(tl.float32)
    b = tl.load(b_ptr + h).to(tl.float32)
    if BV == DV:
        zf = tl.load(z_ptr + h * DV + cols[None, :]).to(tl.float32)
    q = decode_conv(qx, q1, q2, q3, qw0, qw1, qw2, qw3, dtype, RNE)
    k = decode_conv(kx, k1, k2, k3, kw0, kw1, kw2, kw3, dtype, RNE)
    v = decode_conv(vx, v1, v2, v3, vw0, vw1, vw2, vw3, dtype, RNE)
    q = q * tl.math.rsqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k * tl.math.rsqrt(tl.sum(k * k, axis=0) + 1e-6)
    g, beta = decay_beta(a, b, alog, dtb, dtype, RNE)
    s = s * tl.exp(g)
    u = (v - tl.sum(s * k[:, None], axis=0)) * beta
    s = s + k[:, None] * u[None, :]
    o = round_to(tl.sum(s * q[:, None], axis=0), dtype, RNE).to(tl.float32)
    tl.store(sp, s)
    if BV == DV:
        tl.store(y_ptr + h * DV + cols[None, :], gated_norm(o[None, :], zf, wf, eps, DV, ROUND_WN, dtype, RNE))
    else:
        tl.store(o_ptr + h * DV + cols, o.to(dtype))
    # The conv-state shift last, so its barrier and arrival atomic wait on nothing but the end.
    tl.debug_barrier()      # every thread's reads of the conv state are done before any row is rewritten
    store_state(cs_ptr, vx, v1, v2, v3, vc, C)
    if READERS == 1:
        store_state(cs_ptr, qx, q1, q2, q3, qc, C)
        store_state(cs_ptr, kx, k1, k2, k3, kc, C)
    else:
        # NOTE: release after this program's reads; the last arrival's acquire orders its writes after
        # every reader's loads. It resets the counter for the next step (graph replays included).
        arrived = tl.atomic_add(count_ptr + kh, 1, sem="acq_rel", scope="gpu")
        if arrived == READERS - 1:
            store_state(cs_ptr, qx, q1, q2, q3, qc, C)
            store_state(cs_ptr, kx, k1, k2, k3, kc, C)
            tl.atomic_xchg(count_ptr + kh, 0)
    if BV != DV:
        if LAST_NORM:
            if last_arrival(count_ptr, HK + h, DV // BV):
                allc = tl.arange(0, DV)
                of = tl.load(o_ptr + h * DV + allc[None, :], cache_modifier=".cg").to(tl.float32)
                zf = tl.load(z_ptr + h * DV + allc[None, :]).to(tl.float32)
                wf = tl.load(nw_ptr + allc).to(tl.float32)
                tl.store(y_ptr + h * DV + allc[None, :], gated_norm(of, zf, wf, eps, DV, ROUND_WN, dtype, RNE))
                tl.atomic_xchg(count_ptr + HK + h, 0)


@triton.jit(do_not_specialize=["R"])
def norm_kernel(o_ptr, z_ptr, nw_ptr, y_ptr, R, eps, DV: tl.constexpr, ROWS: tl.constexpr, ROUND_WN: tl.constexpr,
                RNE: tl.constexpr, PDL: tl.constexpr = False):
    """The gated norm as its own pass: o, z, y [R, DV] (R = tokens x value heads)."""
    pdl_wait(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, DV)
    inside = (r < R)[:, None]
    off = r.to(tl.int64)[:, None] * DV + cols[None, :]
    o = tl.load(o_ptr + off, mask=inside, other=0.0).to(tl.float32)
    zf = tl.load(z_ptr + off, mask=inside, other=0.0).to(tl.float32)
    wf = tl.load(nw_ptr + cols).to(tl.float32)
    tl.store(y_ptr + off, gated_norm(o, zf, wf, eps, DV, ROUND_WN, y_ptr.dtype.element_ty, RNE), mask=inside)


# -- the chunked prefill --------------------------------------------------------------------------------

@triton.jit
def mm(a, b, PREC: tl.constexpr, DOT16: tl.constexpr, UPCAST: tl.constexpr, dtype: tl.constexpr,
       RNE: tl.constexpr):
    """a @ b with f32 accumulation. DOT16 (precision "bf16" with 16-bit activations): both operands
    rounded to the activation dtype first (tensor-core MMA, as flash-linear-attention does); the
    f32 values themselves (the state S included) stay f32. UPCAST: under the interpreter the rounded
    operands multiply as f32 (exact: a product of two 16-bit floats fits f32's mantissa)."""
    if DOT16:
        a16 = round_to(a, dtype, RNE)
        b16 = round_to(b, dtype, RNE)
        if UPCAST:
            c = tl.dot(a16.to(tl.float32), b16.to(tl.float32), input_precision="ieee")
        else:
            c = tl.dot(a16, b16)
    else:
        c = tl.dot(a, b, input_precision=PREC)
    return c


@triton.jit
def unit_lower_inverse_dots(A, BT: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 as unit_lower_inverse, with the 16x16 diagonal blocks inverted by forward
    substitution written as dots (no 3-D tiles): X [BT, 16] holds every block's inverse as a strip;
    step i sets row i of each block to e_i - (blockdiag(A) @ X) (rows not yet solved hold e_j, which
    meet zero coefficients), 15 [BT, BT] x [BT, 16] dots; then X is spread to the block diagonal by an
    exact 0/1 dot and the blocks below it are folded in as in unit_lower_inverse."""
    r = tl.arange(0, BT)
    c = tl.arange(0, 16)
    same = (r[:, None] // 16) == (r[None, :] // 16)
    ad = tl.where(same, A, 0.0)
    eye = tl.where((r % 16)[:, None] == c[None, :], 1.0, 0.0)                     # [BT, 16]
    x = eye
    for i in tl.static_range(1, 16):
        p = tl.dot(ad, x, input_precision=PREC)
        x = tl.where((r % 16 == i)[:, None], eye - p, x)
    spread = tl.where(c[:, None] == (r % 16)[None, :], 1.0, 0.0)                  # [16, BT]
    d = tl.where(same, tl.dot(x, spread, input_precision="ieee"), 0.0)
    m = tl.dot(d, tl.where(same, 0.0, A), input_precision=PREC)
    m2 = tl.dot(m, m, input_precision=PREC)
    pp = d + tl.dot(m2, d, input_precision=PREC)
    return pp - tl.dot(m, pp, input_precision=PREC)


@triton.jit
def unit_lower_inverse(A, BT: tl.constexpr, PREC: tl.constexpr):
    """(I + A)^-1 for A [BT, BT] strictly lower, BT <= 64. The 16x16 diagonal blocks are inverted by
    forward substitution (all blocks at once, row by row); with D their inverse and N the blocks below
    the diagonal, (I + A)^-1 = (I + D N)^-1 D = (I - M)(I + M^2) D, M = D N (nilpotent: <= 4 block rows).
    That is blockwise forward substitution written as products, with no Neumann cancellation inside
    a block."""
    NB: tl.constexpr = BT // 16
    r = tl.arange(0, BT)
    same = (r[:, None] // 16) == (r[None, :] // 16)
    ad = tl.sum(tl.reshape(tl.where(same, A, 0.0), (BT, NB, 16)), axis=1)       # [BT, 16]: own block's row
    ad = tl.reshape(ad, (NB, 16, 16))
    ii = tl.arange(0, 16)
    x = tl.broadcast_to(tl.where(ii[:, None] == ii[None, :], 1.0, 0.0)[None, :, :], (NB, 16, 16))
    for i in tl.static_range(1, 16):
        sel = (ii == i)[None, :, None]
        a_i = tl.sum(tl.where(sel, ad, 0.0), axis=1)                             # [NB, 16]: row i of each block
        new = tl.where((ii == i)[None, :], 1.0, 0.0) - tl.sum(a_i[:, :, None] * x, axis=1)
        x = tl.where(sel, new[:, None, :], x)
    d = tl.reshape(tl.broadcast_to(tl.reshape(x, (BT, 16))[:, None, :], (BT, NB, 16)), (BT, BT))
    d = tl.where(same, d, 0.0)
    m = tl.dot(d, tl.where(same, 0.0, A), input_precision=PREC)
    m2 = tl.dot(m, m, input_precision=PREC)
    p = d + tl.dot(m2, d, input_precision=PREC)
    return p - tl.dot(m, p, input_precision=PREC)


@triton.jit
def chunk_decays(a_ptr, b_ptr, alog_ptr, dtb_ptr, h, t, tm, HV: tl.constexpr, dtype: tl.constexpr,
                 RNE: tl.constexpr):
    """beta [BT] and the running sum of the log-decay, cum [BT], of value head h at tokens t (padded
    tokens, tm false: g = beta = 0, as the reference pads)."""
    a = tl.load(a_ptr + t * HV + h, mask=tm, other=0.0).to(tl.float32)
    b = tl.load(b_ptr + t * HV + h, mask=tm, other=0.0).to(tl.float32)
    g, beta = decay_beta(a, b, tl.load(alog_ptr + h).to(tl.float32), tl.load(dtb_ptr + h).to(tl.float32), dtype, RNE)
    return tl.where(tm, beta, 0.0), tl.cumsum(tl.where(tm, g, 0.0), axis=0)


@triton.jit(do_not_specialize=["T"])
def prep_kernel(xc_ptr, b_ptr, a_ptr, alog_ptr, dtb_ptr, w_ptr, u_ptr, cum_ptr, kd_ptr, T, HK: tl.constexpr,
                HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr,
                DOT16: tl.constexpr, UPCAST: tl.constexpr, RNE: tl.constexpr, KD: tl.constexpr, INV: tl.constexpr,
                SOLVE_DOTS: tl.constexpr = False):
    """Program (value head h, chunk n): w, u [BT, dk | dv] and cum [BT] (rows padded to whole chunks;
    padded tokens have g = beta = 0, k = v = 0, as the reference pads). u and cum are f32; w (and with
    KD, kd = k exp(g_last - cum) for the split form's state kernel) in w_ptr's dtype: the dot operand
    dtype (a 16-bit w is what mm() would round it to). INV: the f32 dot precision of the solve."""
    h, n = tl.program_id(0), tl.program_id(1)
    kh = h // (HV // HK)
    C: tl.constexpr = 2 * HK * DK + HV * DV
    dtype = xc_ptr.dtype.element_ty
    i = tl.arange(0, BT)
    t = n * BT + i
    tm = t < T
    dk = tl.arange(0, DK)
    dv = tl.arange(0, DV)
    rows = xc_ptr + t.to(tl.int64)[:, None] * C
    k = l2norm_rows(tl.load(rows + HK * DK + kh * DK + dk[None, :], mask=tm[:, None], other=0.0).to(tl.float32))
    v = tl.load(rows + 2 * HK * DK + h * DV + dv[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
    beta, cum = chunk_decays(a_ptr, b_ptr, alog_ptr, dtb_ptr, h, t, tm, HV, dtype, RNE)
    kb = k * beta[:, None]
    lower = i[:, None] > i[None, :]
    decay = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], 0.0))
    A = tl.where(lower, mm(kb, tl.trans(k), PREC, DOT16, UPCAST, dtype, RNE) * decay, 0.0)
    if SOLVE_DOTS:                                  # f32 (INV) even under DOT16: see the module doc
        inv = unit_lower_inverse_dots(A, BT, INV)
    else:
        inv = unit_lower_inverse(A, BT, INV)
    u = mm(inv, v * beta[:, None], PREC, DOT16, UPCAST, dtype, RNE)
    w = mm(inv, kb * tl.exp(cum)[:, None], PREC, DOT16, UPCAST, dtype, RNE)
    hrow = h.to(tl.int64) * (tl.cdiv(T, BT) * BT) + t                       # row in the padded buffers
    wdt = w_ptr.dtype.element_ty
    tl.store(u_ptr + hrow[:, None] * DV + dv[None, :], u)
    tl.store(w_ptr + hrow[:, None] * DK + dk[None, :], round_to(w, wdt, RNE))
    tl.store(cum_ptr + hrow, cum)
    if KD:
        glast = tl.sum(tl.where(i == BT - 1, cum, 0.0), axis=0)
        tl.store(kd_ptr + hrow[:, None] * DK + dk[None, :], round_to(k * tl.exp(glast - cum)[:, None], wdt, RNE))


@triton.jit(do_not_specialize=["T"])
def solve_kernel(xc_ptr, b_ptr, a_ptr, alog_ptr, dtb_ptr, inv_ptr, cum_ptr, T, HK: tl.constexpr, HV: tl.constexpr,
                 DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr, DOT16: tl.constexpr,
                 UPCAST: tl.constexpr, RNE: tl.constexpr, INV: tl.constexpr, SOLVE_DOTS: tl.constexpr):
    """prep_kernel's first half, for fewer live tiles a program: (I + A)^-1 [BT, BT] (stored in
    inv_ptr's dtype: 16-bit where it only feeds 16-bit dots) and cum."""
    h, n = tl.program_id(0), tl.program_id(1)
    kh = h // (HV // HK)
    C: tl.constexpr = 2 * HK * DK + HV * DV
    dtype = xc_ptr.dtype.element_ty
    i = tl.arange(0, BT)
    t = n * BT + i
    tm = t < T
    dk = tl.arange(0, DK)
    rows = xc_ptr + t.to(tl.int64)[:, None] * C
    k = l2norm_rows(tl.load(rows + HK * DK + kh * DK + dk[None, :], mask=tm[:, None], other=0.0).to(tl.float32))
    beta, cum = chunk_decays(a_ptr, b_ptr, alog_ptr, dtb_ptr, h, t, tm, HV, dtype, RNE)
    lower = i[:, None] > i[None, :]
    decay = tl.exp(tl.where(lower, cum[:, None] - cum[None, :], 0.0))
    A = tl.where(lower, mm(k * beta[:, None], tl.trans(k), PREC, DOT16, UPCAST, dtype, RNE) * decay, 0.0)
    if SOLVE_DOTS:
        inv = unit_lower_inverse_dots(A, BT, INV)
    else:
        inv = unit_lower_inverse(A, BT, INV)
    hrow = h.to(tl.int64) * (tl.cdiv(T, BT) * BT) + t
    tl.store(inv_ptr + hrow[:, None] * BT + i[None, :], round_to(inv, inv_ptr.dtype.element_ty, RNE))
    tl.store(cum_ptr + hrow, cum)


@triton.jit(do_not_specialize=["T"])
def wu_kernel(xc_ptr, b_ptr, inv_ptr, cum_ptr, w_ptr, u_ptr, kd_ptr, T, HK: tl.constexpr, HV: tl.constexpr,
              DK: tl.constexpr, DV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr, DOT16: tl.constexpr,
              UPCAST: tl.constexpr, RNE: tl.constexpr):
    """prep_kernel's second half. Program (value head h, chunk n, part): part 0 writes w and kd,
    part 1 writes u (half the live tiles of one program doing both)."""
    h, n, part = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kh = h // (HV // HK)
    C: tl.constexpr = 2 * HK * DK + HV * DV
    dtype = xc_ptr.dtype.element_ty
    i = tl.arange(0, BT)
    t = n * BT + i
    tm = t < T
    rows = xc_ptr + t.to(tl.int64)[:, None] * C
    hrow = h.to(tl.int64) * (tl.cdiv(T, BT) * BT) + t
    b = tl.load(b_ptr + t * HV + h, mask=tm, other=0.0).to(tl.float32)
    beta = tl.where(tm, round_to(tl.sigmoid(b), dtype, RNE).to(tl.float32), 0.0)     # as decay_beta
    inv = tl.load(inv_ptr + hrow[:, None] * BT + i[None, :])
    wdt = w_ptr.dtype.element_ty
    if part == 0:
        dk = tl.arange(0, DK)
        k = l2norm_rows(tl.load(rows + HK * DK + kh * DK + dk[None, :], mask=tm[:, None], other=0.0).to(tl.float32))
        cum = tl.load(cum_ptr + hrow)
        w = mm(inv, k * beta[:, None] * tl.exp(cum)[:, None], PREC, DOT16, UPCAST, dtype, RNE)
        tl.store(w_ptr + hrow[:, None] * DK + dk[None, :], round_to(w, wdt, RNE))
        glast = tl.sum(tl.where(i == BT - 1, cum, 0.0), axis=0)
        tl.store(kd_ptr + hrow[:, None] * DK + dk[None, :], round_to(k * tl.exp(glast - cum)[:, None], wdt, RNE))
    else:
        dv = tl.arange(0, DV)
        v = tl.load(rows + 2 * HK * DK + h * DV + dv[None, :], mask=tm[:, None], other=0.0).to(tl.float32)
        u = mm(inv, v * beta[:, None], PREC, DOT16, UPCAST, dtype, RNE)
        tl.store(u_ptr + hrow[:, None] * DV + dv[None, :], u)


@triton.jit(do_not_specialize=["T"])
def scan_kernel(xc_ptr, z_ptr, nw_ptr, w_ptr, u_ptr, cum_ptr, ssm_ptr, y_ptr, o_ptr, T, eps, scale,
                HK: tl.constexpr, HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr,
                BT: tl.constexpr, PREC: tl.constexpr, DOT16: tl.constexpr, UPCAST: tl.constexpr,
                ROUND_WN: tl.constexpr, RNE: tl.constexpr):
    """Program (value head h, dv block vb) scans the chunks in order, state tile S [dk, BV] in registers:
    v_new = u - w S; o = (q exp(cum)) S + (causal q k^T * decay) v_new; S = S exp(g_last) +
    (k exp(g_last - cum))^T v_new. q and k are re-normalised from xc (cheaper than storing them)."""
    h, vb = tl.program_id(0), tl.program_id(1)
    kh = h // (HV // HK)
    C: tl.constexpr = 2 * HK * DK + HV * DV
    dtype = y_ptr.dtype.element_ty
    npad = tl.cdiv(T, BT) * BT
    i = tl.arange(0, BT)
    dk = tl.arange(0, DK)
    cols = vb * BV + tl.arange(0, BV)
    causal = i[:, None] >= i[None, :]
    sp = ssm_ptr + h.to(tl.int64) * DK * DV + dk[:, None] * DV + cols[None, :]
    s = tl.load(sp)
    wf = tl.load(nw_ptr + cols).to(tl.float32)
    for n in range(0, tl.cdiv(T, BT)):
        t = n * BT + i
        tm = (t < T)[:, None]
        rows = xc_ptr + t.to(tl.int64)[:, None] * C
        q = l2norm_rows(tl.load(rows + kh * DK + dk[None, :], mask=tm, other=0.0).to(tl.float32)) * scale
        k = l2norm_rows(tl.load(rows + HK * DK + kh * DK + dk[None, :], mask=tm, other=0.0).to(tl.float32))
        hrow = h.to(tl.int64) * npad + t
        cum = tl.load(cum_ptr + hrow)
        glast = tl.load(cum_ptr + h.to(tl.int64) * npad + n * BT + BT - 1)
        w = tl.load(w_ptr + hrow[:, None] * DK + dk[None, :])
        u = tl.load(u_ptr + hrow[:, None] * DV + cols[None, :])
        v_new = u - mm(w, s, PREC, DOT16, UPCAST, dtype, RNE)
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0))
        intra = tl.where(causal, mm(q, tl.trans(k), PREC, DOT16, UPCAST, dtype, RNE) * decay, 0.0)
        o = mm(q * tl.exp(cum)[:, None], s, PREC, DOT16, UPCAST, dtype, RNE)
        o = o + mm(intra, v_new, PREC, DOT16, UPCAST, dtype, RNE)
        kd = k * tl.exp(glast - cum)[:, None]
        s = s * tl.exp(glast) + mm(tl.trans(kd), v_new, PREC, DOT16, UPCAST, dtype, RNE)
        o = round_to(o, dtype, RNE).to(tl.float32)
        out = t.to(tl.int64)[:, None] * (HV * DV) + h * DV + cols[None, :]
        if BV == DV:
            zf = tl.load(z_ptr + out, mask=tm, other=0.0).to(tl.float32)
            tl.store(y_ptr + out, gated_norm(o, zf, wf, eps, DV, ROUND_WN, dtype, RNE), mask=tm)
        else:
            tl.store(o_ptr + out, o.to(dtype), mask=tm)
    tl.store(sp, s)


@triton.jit(do_not_specialize=["T"])
def state_kernel(w_ptr, u_ptr, kd_ptr, cum_ptr, ssm_ptr, h_ptr, vn_ptr, T, HV: tl.constexpr, DK: tl.constexpr,
                 DV: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr, PREC: tl.constexpr, DOT16: tl.constexpr,
                 UPCAST: tl.constexpr, RNE: tl.constexpr):
    """The split form's serial part. Program (value head h, dv block vb): for each chunk n in order,
    h[n] = S (the state before it), v_new = u - w S, S = S exp(g_last) + kd^T v_new; the scan_kernel's
    arithmetic without the outputs, whose chunks then run in parallel (output_kernel). h and v_new are
    stored in h_ptr's / vn_ptr's dtype: 16-bit only where they feed nothing but dots (DOT16)."""
    h, vb = tl.program_id(0), tl.program_id(1)
    dtype = h_ptr.dtype.element_ty
    nch = tl.cdiv(T, BT)
    npad = nch * BT
    i = tl.arange(0, BT)
    dk = tl.arange(0, DK)
    cols = vb * BV + tl.arange(0, BV)
    sp = ssm_ptr + h.to(tl.int64) * DK * DV + dk[:, None] * DV + cols[None, :]
    s = tl.load(sp)
    for n in range(0, nch):
        hrow = h.to(tl.int64) * npad + n * BT + i
        hp = h_ptr + (h.to(tl.int64) * nch + n) * DK * DV + dk[:, None] * DV + cols[None, :]
        tl.store(hp, round_to(s, dtype, RNE))
        w = tl.load(w_ptr + hrow[:, None] * DK + dk[None, :])        # 16-bit under DOT16: mm's operand as is
        kd = tl.load(kd_ptr + hrow[:, None] * DK + dk[None, :])
        u = tl.load(u_ptr + hrow[:, None] * DV + cols[None, :])
        glast = tl.load(cum_ptr + h.to(tl.int64) * npad + n * BT + BT - 1)
        v_new = u - mm(w, s, PREC, DOT16, UPCAST, dtype, RNE)
        tl.store(vn_ptr + hrow[:, None] * DV + cols[None, :], round_to(v_new, vn_ptr.dtype.element_ty, RNE))
        s = s * tl.exp(glast) + mm(tl.trans(kd), v_new, PREC, DOT16, UPCAST, dtype, RNE)
    tl.store(sp, s)


@triton.jit(do_not_specialize=["T"])
def output_kernel(xc_ptr, z_ptr, nw_ptr, cum_ptr, h_ptr, vn_ptr, y_ptr, o_ptr, T, eps, scale, HK: tl.constexpr,
                  HV: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BV: tl.constexpr, BT: tl.constexpr,
                  PREC: tl.constexpr, DOT16: tl.constexpr, UPCAST: tl.constexpr, ROUND_WN: tl.constexpr,
                  RNE: tl.constexpr):
    """The split form's parallel part. Program (chunk n, value head h, dv block vb):
    o = (q exp(cum)) h[n] + (causal q k^T * decay) v_new, as scan_kernel computes it; gated norm fused
    when BV == dv."""
    n, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kh = h // (HV // HK)
    C: tl.constexpr = 2 * HK * DK + HV * DV
    dtype = y_ptr.dtype.element_ty
    nch = tl.cdiv(T, BT)
    npad = nch * BT
    i = tl.arange(0, BT)
    dk = tl.arange(0, DK)
    cols = vb * BV + tl.arange(0, BV)
    t = n * BT + i
    tm = (t < T)[:, None]
    rows = xc_ptr + t.to(tl.int64)[:, None] * C
    q = l2norm_rows(tl.load(rows + kh * DK + dk[None, :], mask=tm, other=0.0).to(tl.float32)) * scale
    k = l2norm_rows(tl.load(rows + HK * DK + kh * DK + dk[None, :], mask=tm, other=0.0).to(tl.float32))
    hrow = h.to(tl.int64) * npad + t
    cum = tl.load(cum_ptr + hrow)
    s = tl.load(h_ptr + (h.to(tl.int64) * nch + n) * DK * DV + dk[:, None] * DV + cols[None, :])   # dot operands
    v_new = tl.load(vn_ptr + hrow[:, None] * DV + cols[None, :])
    causal = i[:, None] >= i[None, :]
    decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], 0.0))
    intra = tl.where(causal, mm(q, tl.trans(k), PREC, DOT16, UPCAST, dtype, RNE) * decay, 0.0)
    o = mm(q * tl.exp(cum)[:, None], s, PREC, DOT16, UPCAST, dtype, RNE)
    o = o + mm(intra, v_new, PREC, DOT16, UPCAST, dtype, RNE)
    o = round_to(o, dtype, RNE).to(tl.float32)
    out = t.to(tl.int64)[:, None] * (HV * DV) + h * DV + cols[None, :]
    if BV == DV:
        zf = tl.load(z_ptr + out, mask=tm, other=0.0).to(tl.float32)
        wf = tl.load(nw_ptr + cols).to(tl.float32)
        tl.store(y_ptr + out, gated_norm(o, zf, wf, eps, DV, ROUND_WN, dtype, RNE), mask=tm)
    else:
        tl.store(o_ptr + out, o.to(dtype), mask=tm)


# -- launching -------------------------------------------------------------------------------------------

def round_wn(qkv: torch.Tensor, norm_w: torch.Tensor) -> bool:
    """Whether torch rounds w * normed (both 16-bit: the product stays 16-bit)."""
    return torch.promote_types(norm_w.dtype, qkv.dtype) != torch.float32


def gated_norm_pass(o, z, norm_w, y, eps, dv: int) -> None:
    rows = o.numel() // dv
    norm_kernel[(cdiv(rows, 4),)](o, z, norm_w, y, rows, eps, DV=dv, ROWS=4, ROUND_WN=round_wn(o, norm_w),
                                  RNE=rne_flag(o.dtype), num_warps=4, **pdl(o))


def recurrent(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, y, warps: int = 4) -> None:
    hk, hv, dk, dv, eps = dims
    recurrent_kernel[(hv,)](xc, z, b, a, A_log, dt_bias, norm_w, ssm, y, xc.shape[0], eps, dk ** -0.5, HK=hk, HV=hv,
                            DK=dk, DV=dv, ROUND_WN=round_wn(xc, norm_w), RNE=rne_flag(xc.dtype), num_warps=warps)


def dot_precision(prec: str, dtype: torch.dtype) -> tuple[str, bool, bool]:
    """(PREC for the f32 dots, DOT16, UPCAST) of the kernels. "bf16": 16-bit operands (the activation
    dtype) with f32 accumulation; with f32 activations it is "ieee" (f32 stays exact for the tests)."""
    if prec != "bf16":
        return prec, False, False
    dot16 = dtype != torch.float32
    return "ieee", dot16, dot16 and dot_flags(dtype)["UPCAST"]


def chunked(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, y, p: dict) -> None:
    hk, hv, dk, dv, eps = dims
    t, bv, rne = xc.shape[0], p["bv"], rne_flag(xc.dtype)
    prec, dot16, upcast = dot_precision(p["prec"], xc.dtype)
    w, u, cum = prep(xc, b, a, A_log, dt_bias, dims, p["pw"], prec, dot16, upcast, rne, None)
    o = y if bv == dv else torch.empty_like(y)
    scan_kernel[(hv, dv // bv)](xc, z, norm_w, w, u, cum, ssm, y, o, t, eps, dk ** -0.5, HK=hk, HV=hv, DK=dk, DV=dv,
                                BV=bv, BT=CHUNK, PREC=prec, DOT16=dot16, UPCAST=upcast, ROUND_WN=round_wn(xc, norm_w), RNE=rne,
                                num_warps=p["w"])
    if bv != dv:
        gated_norm_pass(o, z, norm_w, y, eps, dv)


def prep(xc, b, a, A_log, dt_bias, dims, warps, prec, dot16, upcast, rne, kd_dtype, inv=None, solve_dots=False):
    """w, u, cum (and kd when kd_dtype is given: w and kd in that dtype) of every chunk: prep_kernel."""
    hk, hv, dk, dv, _ = dims
    npad = cdiv(xc.shape[0], CHUNK) * CHUNK
    wdt = kd_dtype or torch.float32
    w = torch.empty((hv, npad, dk), dtype=wdt, device=xc.device)
    u = torch.empty((hv, npad, dv), dtype=torch.float32, device=xc.device)
    cum = torch.empty((hv, npad), dtype=torch.float32, device=xc.device)
    kd = torch.empty_like(w) if kd_dtype is not None else w
    prep_kernel[(hv, npad // CHUNK)](xc, b, a, A_log, dt_bias, w, u, cum, kd, xc.shape[0], HK=hk, HV=hv, DK=dk, DV=dv,
                                     BT=CHUNK, PREC=prec, DOT16=dot16, UPCAST=upcast, RNE=rne, KD=kd_dtype is not None,
                                     INV=inv or prec, SOLVE_DOTS=solve_dots, num_warps=warps)
    return (w, u, cum, kd) if kd_dtype is not None else (w, u, cum)


def prep_in_two(xc, b, a, A_log, dt_bias, dims, warps, prec, dot16, upcast, rne, buf, inv, solve_dots):
    """prep() as two kernels (solve_kernel, then wu_kernel over two parts): w, u, cum, kd."""
    hk, hv, dk, dv, _ = dims
    t = xc.shape[0]
    npad = cdiv(t, CHUNK) * CHUNK
    flags = dict(HK=hk, HV=hv, DK=dk, DV=dv, BT=CHUNK, PREC=prec, DOT16=dot16, UPCAST=upcast, RNE=rne, num_warps=warps)
    ainv = torch.empty((hv, npad, CHUNK), dtype=buf, device=xc.device)
    cum = torch.empty((hv, npad), dtype=torch.float32, device=xc.device)
    solve_kernel[(hv, npad // CHUNK)](xc, b, a, A_log, dt_bias, ainv, cum, t, INV=inv or prec, SOLVE_DOTS=solve_dots,
                                      **flags)
    w = torch.empty((hv, npad, dk), dtype=buf, device=xc.device)
    kd = torch.empty_like(w)
    u = torch.empty((hv, npad, dv), dtype=torch.float32, device=xc.device)
    wu_kernel[(hv, npad // CHUNK, 2)](xc, b, ainv, cum, w, u, kd, t, **flags)
    return w, u, cum, kd


def split(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, y, p: dict) -> None:
    """The chunked rule as fla lays it out: prep (parallel), the state before every chunk (serial over
    chunks, parallel over heads and dv blocks), then every chunk's output at once. Same arithmetic as
    chunked(); under DOT16 the buffers that only feed dots (w, kd, h, v_new) are 16-bit."""
    hk, hv, dk, dv, eps = dims
    t, rne = xc.shape[0], rne_flag(xc.dtype)
    nch = cdiv(t, CHUNK)
    prec, dot16, upcast = dot_precision(p["prec"], xc.dtype)
    buf = xc.dtype if dot16 else torch.float32
    inv = p.get("inv") if xc.dtype != torch.float32 else None      # f32 activations stay exact (tests)
    if p.get("prep2"):
        w, u, cum, kd = prep_in_two(xc, b, a, A_log, dt_bias, dims, p["pw"], prec, dot16, upcast, rne, buf, inv,
                                    p.get("solve") == "dots")
    else:
        w, u, cum, kd = prep(xc, b, a, A_log, dt_bias, dims, p["pw"], prec, dot16, upcast, rne, buf, inv,
                             p.get("solve") == "dots")
    hs = torch.empty((hv, nch, dk, dv), dtype=buf, device=xc.device)
    vn = torch.empty((hv, nch * CHUNK, dv), dtype=buf, device=xc.device)
    state_kernel[(hv, dv // p["hbv"])](w, u, kd, cum, ssm, hs, vn, t, HV=hv, DK=dk, DV=dv, BV=p["hbv"], BT=CHUNK,
                                       PREC=prec, DOT16=dot16, UPCAST=upcast, RNE=rne, num_warps=p["hw"],
                                       **({"num_stages": p["hs"]} if p.get("hs") else {}))
    bv = p["obv"]
    o = y if bv == dv else torch.empty_like(y)
    output_kernel[(nch, hv, dv // bv)](xc, z, norm_w, cum, hs, vn, y, o, t, eps, dk ** -0.5, HK=hk, HV=hv, DK=dk,
                                       DV=dv, BV=bv, BT=CHUNK, PREC=prec, DOT16=dot16, UPCAST=upcast,
                                       ROUND_WN=round_wn(xc, norm_w), RNE=rne, num_warps=p["ow"])
    if bv != dv:
        gated_norm_pass(o, z, norm_w, y, eps, dv)


def torch_chunked(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, y) -> None:
    """The reference's chunked WY/UT form in torch ops (cuBLAS batched matmuls, one small step per
    chunk): a measured alternative to the Triton scan, whose f32 dots are slow on Hopper."""
    from types import SimpleNamespace

    import torch.nn.functional as F

    from ..reference import ReferenceOps

    hk, hv, dk, dv, eps = dims
    t, ref = xc.shape[0], ReferenceOps(xc.device)
    q, k, v = xc.split([hk * dk, hk * dk, hv * dv], dim=-1)
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    state = SimpleNamespace(ssm=ssm)
    o = ref.gdn_chunked(q.view(t, hk, dk), k.view(t, hk, dk), v.view(t, hv, dv), g, torch.sigmoid(b), state)
    ssm.copy_(state.ssm)
    y.copy_(ref.gated_rmsnorm(o, z.view(t, hv, dv), norm_w, eps).reshape(t, hv * dv))


def prefill_into(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_state, ssm, dims, v: Variant, y) -> None:
    mix(conv(qkv, conv_w, conv_state), z, b, a, A_log, dt_bias, norm_w, ssm, dims, v, y)


def mix(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, v: Variant, y) -> None:
    """The delta rule and the gated norm over the conv output xc, in variant v's form."""
    if v.p["form"] == "torch":
        torch_chunked(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, y)
    elif v.p["form"] == "recurrent":
        recurrent(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, y, v.p["w"])
    elif v.p["form"] == "split":
        split(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, y, v.p)
    else:
        chunked(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, y, v.p)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """Per-key-head arrival counters of the decode kernel, zero between launches (the last arrival
    resets its own). NOTE: allocate (run once) before capturing a CUDA graph that uses them."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[device] = torch.zeros(max(n, 256), dtype=torch.int32, device=device)
    return buf


def decode_into(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_state, ssm, dims, v: Variant, y) -> None:
    hk, hv, dk, dv, eps = dims
    p = v.p
    if p["form"] == "unfused":
        xc = conv(qkv, conv_w, conv_state)
        recurrent(xc, z, b, a, A_log, dt_bias, norm_w, ssm, dims, y, p["w"])
        return
    bv, last = p["bv"], p.get("last", False) and p["bv"] != dv
    o = y if bv == dv else torch.empty_like(y)
    counts = arrival_counters(qkv.device, hk + hv)
    decode_kernel[(hv, dv // bv)](qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_state, ssm, y, o, counts, eps,
                                  dk ** -0.5, HK=hk, HV=hv, DK=dk, DV=dv, K=conv_w.shape[-1], BV=bv,
                                  ROUND_WN=round_wn(qkv, norm_w), RNE=rne_flag(qkv.dtype), num_warps=p["w"],
                                  LAST_NORM=last, **pdl(qkv))
    if bv != dv and not last:
        gated_norm_pass(o, z, norm_w, y, eps, dv)


def _shape(qkv, conv_w, ssm, dims) -> GdnShape:
    hk, hv, dk, dv, _ = dims
    return GdnShape(qkv.shape[0], hk, hv, dk, dv, conv_w.shape[-1])


def gdn_prefill(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_state, ssm, dims, v: Variant | None = None):
    """The GDN mixer over T >= 1 tokens (ReferenceOps.gated_deltanet without the length bookkeeping):
    y [T, Hv*dv]; conv_state and ssm updated in place."""
    assert conv_state.is_contiguous() and ssm.is_contiguous() and conv_w.is_contiguous()   # updated in place
    v = v or PREFILL.default(_shape(qkv, conv_w, ssm, dims), device_info(qkv.device))
    y = torch.empty((qkv.shape[0], dims[1] * dims[3]), dtype=qkv.dtype, device=qkv.device)
    prefill_into(qkv.contiguous(), z.contiguous(), b.contiguous(), a.contiguous(), conv_w, A_log, dt_bias, norm_w,
                 conv_state, ssm, dims, v, y)
    return y


def gdn_decode(qkv, z, b, a, conv_w, A_log, dt_bias, norm_w, conv_state, ssm, dims, v: Variant | None = None):
    """One token (T == 1): y [1, Hv*dv]; conv_state and ssm updated in place. CUDA-graph capturable."""
    assert conv_state.is_contiguous() and ssm.is_contiguous() and conv_w.is_contiguous()   # updated in place
    v = v or DECODE.default(_shape(qkv, conv_w, ssm, dims), device_info(qkv.device))
    y = torch.empty((1, dims[1] * dims[3]), dtype=qkv.dtype, device=qkv.device)
    decode_into(qkv.contiguous(), z.contiguous(), b.contiguous(), a.contiguous(), conv_w, A_log, dt_bias, norm_w,
                conv_state, ssm, dims, v, y)
    return y


# -- the ops: variants, inputs, outputs --------------------------------------------------------------

@dataclass(frozen=True)
class GdnShape:
    rows: int     # tokens (runtime; 1 for decode)
    hk: int
    hv: int
    dk: int
    dv: int
    k: int        # conv kernel

    @property
    def key(self) -> tuple:
        return (self.hk, self.hv, self.dk, self.dv, self.k)

    @property
    def conv_dim(self) -> int:
        return 2 * self.hk * self.dk + self.hv * self.dv


def chunk_variant(bv: int, w: int, prec: str, pw: int | None = None) -> Variant:
    pw = pw or w
    return variant(f"chunk_bv{bv}_w{w}_pw{pw}_{prec}", form="chunk", bv=bv, w=w, pw=pw, prec=prec)


def split_variant(hbv: int, hw: int, obv: int, ow: int, prec: str, pw: int = 4, inv: str | None = None,
                  hs: int | None = None, solve: str | None = None, prep2: bool = False) -> Variant:
    """inv: the (I + A)^-1 solve's f32 dot precision with 16-bit activations (default ieee); hs: the
    state kernel's pipeline stages (default Triton's); solve "dots": unit_lower_inverse_dots; prep2:
    the prep as two kernels (solve_kernel, wu_kernel) with fewer live tiles each."""
    extra = (f"_inv-{inv}" if inv else "") + (f"_s{hs}" if hs else "") + (f"_{solve}" if solve else "")
    extra += "_p2" if prep2 else ""
    return variant(f"split_h{hbv}w{hw}_o{obv}w{ow}_pw{pw}_{prec}{extra}", form="split", hbv=hbv, hw=hw, obv=obv,
                   ow=ow, pw=pw, prec=prec, inv=inv, hs=hs, solve=solve, prep2=prep2)


def fused_variant(bv: int, w: int, last: bool = False) -> Variant:
    """The decode step in one kernel; BV < DV: the gated norm in norm_kernel, or (last) done by the
    head's last-arriving program."""
    return variant(f"fused_bv{bv}_w{w}" + ("_last" if last else ""), form="fused", bv=bv, w=w, last=last)


RECURRENT = variant("recurrent", form="recurrent", w=4)        # trusted prefill: token by token, no tl.dot
TORCH = variant("torch_chunked", form="torch")                  # the reference's chunked form in torch ops
UNFUSED = variant("unfused", form="unfused", w=4)              # trusted decode: conv kernel + recurrent step
GPU_PREC = ("tf32x3", "ieee")      # "tf32" alone (10-bit mantissa) only when pinned: the state is f32 by contract


def bf16_forms(dv: int) -> list[Variant]:
    """The 16-bit-operand forms that fit sm_90's 232448 bytes of shared memory (cross-compiled with
    Triton 3.9 at dk = dv = 128, BT = 64: scan 124-198 KB, prep 32 KB); 8 warps spill 3-5x less
    than 4 (scan bv 32: ~1.3 KB against ~5 KB; the ieee scan it replaces: ~22 KB)."""
    return [chunk_variant(bv, 8, "bf16", 8) for bv in (32, 64, 128) if bv <= dv]


def split_forms(dv: int) -> list[Variant]:
    """The split (fla-layout) forms on 16-bit dot operands measured clean on the H200
    (bench/results/h200_gdn_forms_2d09da6.json, dk = dv = 128, 8192 tokens x 16 heads): the prep in two
    kernels with the (I + A)^-1 solve in tf32 0.67 ms (fla 0.6.0: 0.77), tf32x3 1.13, f32 0.90; the
    one-kernel prep (spills 7-10 KB a thread) 1.28. tf32 leaves ~2^-11 relative error in the inverse
    before its bf16 rounding at 2^-9; the outputs matched the other forms' error to the digit."""
    hbv = min(16, dv)
    return [split_variant(hbv, 4, dv, 8, "bf16", pw=8, inv=inv, prep2=True) for inv in ("tf32", "tf32x3", None)] + [
        split_variant(hbv, 4, dv, 8, "bf16")]


def split_next_forms(dv: int) -> list[Variant]:
    """Split forms offered only with KILN_TRY_UNMEASURED=1. Every dot in tf32x3 (~f32: the reference's
    chunked rule rounds nowhere to 16 bits), buffers f32: the numeric contract's form, clean on the
    H200 but 2.4 ms per 8192 tokens x 16 heads (state kernel 742 us, solve 896), 3.6x the bf16 form.
    The dots-form solve (unit_lower_inverse_dots) faulted there (illegal address, Triton 3.6) in
    every precision: never offered on a GPU."""
    hbv, half = min(16, dv), max(16, dv // 2)
    return [split_variant(hbv, 4, half, 8, "tf32x3", pw=8, prep2=True), split_variant(hbv, 4, dv, 8, "tf32x3", pw=8, prep2=True)]


def gdn_inputs(s: GdnShape, dtype, device, gen) -> dict:
    """Random inputs shaped like the model's (never zeros): decays from HF's A_log / dt_bias init ranges,
    a non-zero prior conv window and state."""
    r = lambda *shape, scale=1.0: torch.randn(*shape, generator=gen, device=device) * scale  # noqa: E731
    u = lambda n, lo, hi: lo + (hi - lo) * torch.rand(n, generator=gen, device=device)  # noqa: E731
    t, c = s.rows, s.conv_dim
    dt = torch.exp(u(s.hv, -6.9, -2.3))                                   # dt in [1e-3, 0.1]
    return {"qkv": r(t, c).to(dtype), "z": r(t, s.hv * s.dv).to(dtype), "b": r(t, s.hv).to(dtype),
            "a": r(t, s.hv).to(dtype), "conv_w": r(c, 1, s.k, scale=0.5).to(dtype),
            "A_log": torch.log(u(s.hv, 1.0, 16.0)).to(dtype), "dt_bias": (dt + torch.log(-torch.expm1(-dt))).to(dtype),
            "norm_w": r(s.dv, scale=0.1).add(1.0).to(dtype), "conv_state": r(s.k, c).to(dtype),
            "ssm": r(s.hv, s.dk, s.dv, scale=0.1), "dims": (s.hk, s.hv, s.dk, s.dv, 1e-6)}


ARGS = ("qkv", "z", "b", "a", "conv_w", "A_log", "dt_bias", "norm_w")


class GdnOp(Op):
    """Outputs y and copies of the state: launch() copies the input state into them and updates the
    copies in place, so the gate can run every variant on the same inputs and compare the state too."""
    sources = (__file__, COMMON, GEMM_FILE)   # last_arrival comes from gemm.py
    into = None

    def shape_str(self, s: GdnShape) -> str:
        return f"{s.rows}_h{s.hk}-{s.hv}_d{s.dk}-{s.dv}_k{s.k}"

    def with_rows(self, s: GdnShape, rows: int) -> GdnShape:
        return GdnShape(rows, s.hk, s.hv, s.dk, s.dv, s.k)

    def inputs(self, s: GdnShape, dtype, device, gen) -> dict:
        return gdn_inputs(s, dtype, device, gen)

    def outputs(self, s: GdnShape, inputs: dict) -> dict:
        q = inputs["qkv"]
        return {"y": torch.empty((q.shape[0], s.hv * s.dv), dtype=q.dtype, device=q.device),
                "conv": torch.empty_like(inputs["conv_state"]), "ssm": torch.empty_like(inputs["ssm"])}

    def launch(self, v: Variant, inputs: dict, outputs: dict, plan=None) -> None:
        outputs["conv"].copy_(inputs["conv_state"])
        outputs["ssm"].copy_(inputs["ssm"])
        type(self).into(*(inputs[k] for k in ARGS), outputs["conv"], outputs["ssm"], inputs["dims"], v, outputs["y"])

    def compile(self, v: Variant, s: GdnShape, dtype, device) -> list:
        """Runs the variant once on a small block (a full and a ragged chunk): T is not specialised, so
        that compiles every kernel it launches for this shape."""
        if interpreting() or v.run is not None:
            return []
        block = self.with_rows(s, 1 if self.name == "gdn_decode" else CHUNK + 1)
        gen = torch.Generator(device=device).manual_seed(0)
        inputs = self.inputs(block, dtype, device, gen)
        self.run(v, inputs, self.outputs(block, inputs))
        return []

    def supports(self, qkv, conv_w, ssm, dims) -> bool:
        hk, hv, dk, dv, _ = dims
        pow2 = lambda n: n >= 16 and n & (n - 1) == 0  # noqa: E731
        return (qkv.dtype in SUPPORTED and conv_w.dtype == qkv.dtype and ssm.dtype == torch.float32
                and pow2(dk) and pow2(dv) and hv % hk == 0 and conv_w.shape[-1] - 1 <= CONV_BT)


class GdnPrefillOp(GdnOp):
    name = "gdn_prefill"
    into = staticmethod(prefill_into)

    def catalogue(self, s: GdnShape, dev) -> list[Variant]:
        bvs = [bv for bv in (16, 32, 64, 128) if bv <= s.dv]
        if dev.capability is None:
            small = [chunk_variant(16, 4, "ieee"), split_variant(16, 4, 16, 4, "ieee")] if s.dv > 16 else []
            return [RECURRENT, TORCH, chunk_variant(s.dv, 4, "ieee"), split_variant(s.dv, 4, s.dv, 4, "ieee")] + small
        forms = [RECURRENT, TORCH] + [chunk_variant(bv, w, prec) for prec in GPU_PREC + ("tf32",) for bv in bvs[1:]
                               for w in (4, 8)]
        forms += [chunk_variant(bv, w, "bf16", 8) for bv in bvs[1:] for w in (4, 8)]
        forms += [chunk_variant(bv, 4, prec, 8) for prec in GPU_PREC for bv in bvs[1:]]
        return forms + split_forms(s.dv) + split_next_forms(s.dv)

    def candidates(self, s: GdnShape, dev) -> list[Variant]:
        """A few forms only: every form compiles for seconds, and a cold load compiles them all."""
        forms = [v for v in self.catalogue(s, dev) if v.p.get("prec") != "tf32"]
        if dev.capability is None:
            return forms
        # On the H200 (Triton 3.6) only the ieee scans at bv 32 compiled within 232 KB of shared memory
        # (tf32x3 needs 247-395 KB cross-compiled for sm_90), and 8 warps won by 2-3x: keep that one.
        # The 16-bit-operand scans (bf16_forms) fault with an illegal address there: never run them.
        keep = [RECURRENT, TORCH, chunk_variant(32, 8, "ieee", 8)] + split_forms(s.dv)
        if try_unmeasured():
            keep += split_next_forms(s.dv)
        return [v for v in forms if v in keep]

    def trusted(self, s, dev) -> Variant:
        return RECURRENT

    def default(self, s: GdnShape, dev) -> Variant:
        if dev.capability is None:
            return chunk_variant(s.dv, 4, "ieee")
        return split_forms(s.dv)[0]   # fastest measured on the H200

    def kernel_sources(self, v: Variant) -> list:
        if v.p["form"] == "recurrent":
            return [conv_kernel, recurrent_kernel]
        if v.p["form"] == "torch":
            return [conv_kernel]
        if v.p["form"] == "split":
            return [conv_kernel, prep_kernel, chunk_decays, solve_kernel, wu_kernel, unit_lower_inverse,
                    unit_lower_inverse_dots, state_kernel, output_kernel, norm_kernel]
        return [conv_kernel, prep_kernel, chunk_decays, unit_lower_inverse, scan_kernel] + [norm_kernel]


class GdnDecodeOp(GdnOp):
    name = "gdn_decode"
    into = staticmethod(decode_into)

    def blocks(self, s) -> tuple[int, int]:
        return 1, 1

    def catalogue(self, s: GdnShape, dev) -> list[Variant]:
        bvs = [bv for bv in (16, 32, 64, 128) if bv <= s.dv]
        if s.k != 4:                # the fused kernel holds the conv state as 3 rows (Qwen3.5's kernel of 4)
            return [UNFUSED]
        if dev.capability is None:
            small = [fused_variant(16, 4), fused_variant(16, 4, last=True)] if s.dv > 16 else []
            return [UNFUSED, fused_variant(s.dv, 4)] + small
        # at most 128 state floats a thread: more only spills
        forms = [fused_variant(bv, w) for bv in bvs for w in (1, 2, 4, 8) if bv * s.dk <= 128 * 32 * w]
        # the gated norm by the head's last arrival instead of norm_kernel: one launch fewer a layer
        # where BV < dv wins (9B and up: fused_bv32_w1); measured clean on the H200 (NOTES, efbe234)
        forms += [fused_variant(bv, w, last=True) for bv in bvs[:-1] for w in (1, 2, 4) if bv * s.dk <= 128 * 32 * w]
        return [UNFUSED] + forms

    def trusted(self, s, dev) -> Variant:
        return UNFUSED

    def default(self, s: GdnShape, dev) -> Variant:
        if s.k != 4:
            return UNFUSED
        return fused_variant(s.dv, 4 if dev.capability is None else 8)

    def kernel_sources(self, v: Variant) -> list:
        if v.p["form"] == "unfused":
            return [conv_kernel, recurrent_kernel]
        return [decode_kernel, conv_prefetch, decode_conv, store_state, pdl_wait, last_arrival, gated_norm] + (
            [] if v.p.get("last") else [norm_kernel])


PREFILL = register(GdnPrefillOp())
DECODE = register(GdnDecodeOp())
