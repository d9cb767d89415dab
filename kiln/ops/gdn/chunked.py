"""Gated DeltaNet's chunked prefill kernels (the WY/UT form, chunks of 64): prep (or solve + wu), then
scan, or the split form (state, output). Launchers and ops: kiln/ops/gdn/kernels.py."""

from __future__ import annotations

import triton
import triton.language as tl

from ..common import round_to
from .recurrent import decay_beta, gated_norm, l2norm_rows

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
