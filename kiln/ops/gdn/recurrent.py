"""Gated DeltaNet's token-by-token kernels: the causal conv, the recurrent form (the trusted prefill
and, with the conv, the trusted decode step), the whole decode step in one launch, and the
elementwise helpers the chunked kernels share. Launchers and ops: kiln/ops/gdn/kernels.py."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import cdiv, pdl_wait, rne_flag, round_to
from ..gemm.helpers import last_arrival

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
                  LAST_NORM: tl.constexpr = False, PDL: tl.constexpr = False, slot_ptr=None,
                  SLOTS: tl.constexpr = False):
    """Program (value head h, dv block vb). Conv state: the program owns its v channels and shifts them
    after reading; the q/k channels of key head kh are read by READERS programs, and the last of them
    to arrive (an arrival counter, as in serial split-K) shifts them, so no program reads a shifted row.
    BV == DV: the gated norm here, else o goes to o_ptr for norm_kernel, or (LAST_NORM) the last of
    the head's DV // BV programs to arrive (counter HK + h) norms the whole row. The state block loads
    before pdl_wait: only this layer's previous step writes it.
    SLOTS: program axis 2 is the row of a batched step (rows of x, z, a, b, y, o and counters [2 * (HK +
    HV)] contiguous), whose conv and recurrent states are slot slot_ptr[row] of pools [S, K, C] and
    [S, HV, DK, DV]: the same arithmetic as one row alone, so the results are bit-identical."""
    h, vb = tl.program_id(0), tl.program_id(1)
    kh = h // (HV // HK)
    C: tl.constexpr = 2 * HK * DK + HV * DV
    if SLOTS:
        row = tl.program_id(2)
        slot = tl.load(slot_ptr + row).to(tl.int64)
        ssm_ptr += slot * (HV * DK * DV)
        cs_ptr += slot * (K * C)
        x_ptr += row * C
        z_ptr += row * (HV * DV)
        a_ptr += row * HV
        b_ptr += row * HV
        y_ptr += row * (HV * DV)
        o_ptr += row * (HV * DV)
        count_ptr += row * (HK + HV)
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
