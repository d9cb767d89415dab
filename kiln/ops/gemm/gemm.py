"""Tensor-core GEMM, y[M, N] = x[M, K] @ w[N, K]^T (F.linear without bias): bf16/f16 in, f32
accumulate, output in the input dtype. N and K are the model's dimensions (`tl.constexpr`); M, the
token count, is a runtime argument that Triton does not specialise on, so one compiled kernel
serves every chunk length.

Forms: a tiled kernel (tile shape, warps, pipeline stages, grouped tile order), its split-K form
(each split writes f32 partial sums, a second kernel adds them), and on Hopper the TMA forms
(tensor descriptors; one tile per program, or a persistent grid of one program per SM).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...tune.device import device_info, interpreting
from ...tune.registry import Op, Variant, register, try_unmeasured, variant
from .. import cuda_common, nvrtc
from ..common import COMMON, SUPPORTED, cdiv, dot_flags, next_pow2, pdl, pdl_wait, rne_flag, round_to
from ..norm import kernels as norm_kernels
from ..norm.kernels import scale_normed
from . import helpers, hgemv
from .activation import ACTS, act_f32
from .activation import __file__ as ACTS_FILE
from .helpers import last_arrival, mma

GROUP_M = 8


@triton.jit
def tile_of(pid, M, BM: tl.constexpr, N: tl.constexpr, BN: tl.constexpr, GROUP_M: tl.constexpr):
    """Program -> (tile row, tile column), walking GROUP_M tile rows per column so that the
    w tiles a group reads stay in L2."""
    grid_m = tl.cdiv(M, BM)
    grid_n: tl.constexpr = (N + BN - 1) // BN
    per_group = GROUP_M * grid_n
    first_m = (pid // per_group) * GROUP_M
    rows = tl.minimum(grid_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % rows, (pid % per_group) // rows


@triton.jit(do_not_specialize=["M"])
def gemm_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, count_ptr, M, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, SPLIT_K: tl.constexpr,
                SERIAL: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, RNE: tl.constexpr,
                PDL: tl.constexpr = False):
    """One BM x BN tile of y per program (axis 0), one K range per program (axis 1). With SPLIT_K > 1
    each program writes its f32 partial sums to the workspace ws [SPLIT_K, M, N]; with SERIAL the
    last program of a tile to finish (a per-tile arrival counter) adds the partials in split order
    and writes y, else a second kernel (splitk_sum_kernel) does."""
    pid_m, pid_n = tile_of(tl.program_id(0), M, BM, N, BN, GROUP_M)
    split = tl.program_id(1)
    SPAN: tl.constexpr = (K + SPLIT_K * BK - 1) // (SPLIT_K * BK) * BK      # K per split, in whole BK steps
    EVEN: tl.constexpr = SPAN * SPLIT_K == K
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = split * SPAN + tl.arange(0, BK)
    # Rows past M and columns past N read row M-1 / column N-1 (valid memory); they are never stored.
    xs = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * K + rk[None, :]
    ws = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[None, :] * K + rk[:, None]       # [BK, BN] of w^T
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    pdl_wait(PDL)
    for k in range(0, SPAN, BK):
        if EVEN:
            a = tl.load(xs)
            b = tl.load(ws)
        else:
            inside = rk + k < K
            a = tl.load(xs, mask=inside[None, :], other=0.0)
            b = tl.load(ws, mask=inside[:, None], other=0.0)
        acc = mma(acc, a, b, UPCAST, IEEE)
        xs += BK
        ws += BK
    keep = (rm < M)[:, None] & (rn < N)[None, :]
    out = y_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :]
    if SPLIT_K == 1:
        tl.store(out, round_to(acc, y_ptr.dtype.element_ty, RNE), mask=keep)
    else:
        if SERIAL:
            splitk_finish(acc, ws_ptr, y_ptr, count_ptr, tl.program_id(0), split, M, rm, rn, keep, N, SPLIT_K, RNE)
        else:
            tl.store(ws_ptr + (split * M + rm).to(tl.int64)[:, None] * N + rn[None, :], acc, mask=keep)


@triton.jit
def splitk_finish(acc, ws_ptr, y_ptr, count_ptr, idx, split, M, rm, rn, keep, N: tl.constexpr,
                  SPLIT_K: tl.constexpr, RNE: tl.constexpr):
    """A tile's serial split-K finish: this split's f32 partial to ws [SPLIT_K, M, N]; the last to
    arrive adds the partials in split order (the same sum whoever is last), rounds once, stores y and
    resets the counter for the next launch."""
    tl.store(ws_ptr + (split * M + rm).to(tl.int64)[:, None] * N + rn[None, :], acc, mask=keep)
    if last_arrival(count_ptr, idx, SPLIT_K):
        total = tl.zeros_like(acc)
        for s in tl.static_range(SPLIT_K):
            part = ws_ptr + (s * M + rm).to(tl.int64)[:, None] * N + rn[None, :]
            total += tl.load(part, mask=keep, other=0.0, cache_modifier=".cg")
        tl.store(y_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], round_to(total, y_ptr.dtype.element_ty, RNE),
                 mask=keep)
        tl.atomic_xchg(count_ptr + idx, 0)


@triton.jit(do_not_specialize=["MN"])
def splitk_sum_kernel(ws_ptr, y_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, RNE: tl.constexpr):
    """y = sum over splits of the f32 partials, rounded once to y's dtype."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < MN
    acc = tl.load(ws_ptr + offs, mask=inside, other=0.0)
    for s in tl.static_range(1, SPLIT_K):
        acc += tl.load(ws_ptr + s * MN + offs, mask=inside, other=0.0)
    tl.store(y_ptr + offs, round_to(acc, y_ptr.dtype.element_ty, RNE), mask=inside)


@triton.jit
def tma_tile(x_desc, w_desc, y_desc, t, M, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr,
             BK: tl.constexpr, GROUP_M: tl.constexpr, UPCAST: tl.constexpr, RNE: tl.constexpr):
    pid_m, pid_n = tile_of(t, M, BM, N, BN, GROUP_M)
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):          # the copy engine zero-fills past M, N and K: no masks
        a = x_desc.load([pid_m * BM, k])
        b = w_desc.load([pid_n * BN, k])
        acc = mma(acc, a, b.T, UPCAST, False)
    y_desc.store([pid_m * BM, pid_n * BN], round_to(acc, y_desc.dtype, RNE))


@triton.jit(do_not_specialize=["M"])
def gemm_tma_kernel(x_desc, w_desc, y_desc, M, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
                    BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr,
                    UPCAST: tl.constexpr, RNE: tl.constexpr):
    """PROGRAMS == 0: one tile per program. Otherwise a persistent grid of PROGRAMS programs (one per
    SM), each walking the tiles pid, pid + PROGRAMS, ..."""
    if PROGRAMS == 0:
        tma_tile(x_desc, w_desc, y_desc, tl.program_id(0), M, N, K, BM, BN, BK, GROUP_M, UPCAST, RNE)
    else:
        tiles = tl.cdiv(M, BM) * ((N + BN - 1) // BN)
        for t in tl.range(tl.program_id(0), tiles, PROGRAMS):
            tma_tile(x_desc, w_desc, y_desc, t, M, N, K, BM, BN, BK, GROUP_M, UPCAST, RNE)


@triton.jit(do_not_specialize=["M"])
def gemm_tma_sk_kernel(x_desc, w_desc, y_ptr, ws_ptr, count_ptr, M, N: tl.constexpr, K: tl.constexpr,
                       BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr,
                       SPLIT_K: tl.constexpr, UPCAST: tl.constexpr, RNE: tl.constexpr):
    """TMA tiles with split-K (few tiles, long K: M=512 x N=1024 fills 32 of 132 SMs with 128x128
    tiles): program (tile, split) runs its K range through the copy engine (zero-filled past K) and
    writes f32 partials; the last arrival adds them in split order, as gemm_kernel's SERIAL form."""
    pid_m, pid_n = tile_of(tl.program_id(0), M, BM, N, BN, GROUP_M)
    split = tl.program_id(1)
    SPAN: tl.constexpr = (K + SPLIT_K * BK - 1) // (SPLIT_K * BK) * BK
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(split * SPAN, split * SPAN + SPAN, BK):
        a = x_desc.load([pid_m * BM, k])
        b = w_desc.load([pid_n * BN, k])
        acc = mma(acc, a, b.T, UPCAST, False)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    keep = (rm < M)[:, None] & (rn < N)[None, :]
    splitk_finish(acc, ws_ptr, y_ptr, count_ptr, tl.program_id(0), split, M, rm, rn, keep, N, SPLIT_K, RNE)


@triton.jit
def masked_k(ptr, rk, K: tl.constexpr, EVEN: tl.constexpr, ROWS: tl.constexpr):
    """ptr's [BN, BK] tile (ROWS) or [BK] slice, zeros past K (EVEN: no K edge, no mask)."""
    if EVEN:
        return tl.load(ptr)
    if ROWS:
        return tl.load(ptr, mask=(rk < K)[None, :], other=0.0)
    return tl.load(ptr, mask=rk < K, other=0.0)


@triton.jit
def x_slice(x_ptr, m, rk, K: tl.constexpr, EVEN: tl.constexpr, ACT: tl.constexpr, RNE: tl.constexpr,
            NORM: tl.constexpr, STYLE: tl.constexpr, r_ptr, nw_ptr, rstd):
    """Row m's x at columns rk in f32. ACT >= 0: rows are [g | u] (2K wide) and x = act(g) * u,
    each rounded to x's dtype as act_mul rounds (activation.py). NORM: x is
    rmsnorm(x) (1) or rmsnorm(x + r) (2) with the row's rstd, rounded as the rmsnorm kernel rounds."""
    # NOTE: one return at the end: Triton builds the code after a constexpr-taken `return` too (with
    # r_ptr/nw_ptr None there, that fails to compile).
    dtype = x_ptr.dtype.element_ty
    if ACT >= 0:
        g = masked_k(x_ptr + m * (2 * K) + rk, rk, K, EVEN, False).to(tl.float32)
        u = masked_k(x_ptr + m * (2 * K) + K + rk, rk, K, EVEN, False).to(tl.float32)
        a = round_to(act_f32(g, ACT), dtype, RNE).to(tl.float32)
        xv = round_to(a * u, dtype, RNE).to(tl.float32)
    else:
        xv = masked_k(x_ptr + m * K + rk, rk, K, EVEN, False).to(tl.float32)
        if NORM == 2:
            rv = masked_k(r_ptr + m * K + rk, rk, K, EVEN, False).to(tl.float32)
            xv = round_to(xv + rv, dtype, RNE).to(tl.float32)
        if NORM > 0:
            wv = masked_k(nw_ptr + rk, rk, K, EVEN, False).to(tl.float32)
            # [1, BK] through the rmsnorm kernel's own rounding, back to [BK] (a sum of one term is exact)
            xv = tl.sum(scale_normed(xv[None, :], rstd, wv, STYLE, dtype, RNE).to(tl.float32), axis=0)
    return xv


@triton.jit
def norm_source(x_ptr, r_ptr, s_ptr, m, c, K: tl.constexpr, NORM: tl.constexpr, STORE, RNE: tl.constexpr):
    """Row m's x (NORM 1) or s = round(x + r) (NORM 2; STORE: this program writes s) at columns c,
    in f32, zeros past K."""
    inside = c < K
    xf = tl.load(x_ptr + m * K + c, mask=inside, other=0.0).to(tl.float32)
    if NORM == 2:
        sv = round_to(xf + tl.load(r_ptr + m * K + c, mask=inside, other=0.0).to(tl.float32), s_ptr.dtype.element_ty,
                      RNE)
        if STORE:
            tl.store(s_ptr + m * K + c, sv, mask=inside)
        xf = sv.to(tl.float32)
    return xf


@triton.jit
def norm_rstd(x_ptr, r_ptr, s_ptr, m, eps, K: tl.constexpr, KP: tl.constexpr, NORM: tl.constexpr, STORE,
              RNE: tl.constexpr):
    """rstd [1] of row m's x (NORM 1) or of s = round(x + r) (NORM 2; STORE: this program writes s)."""
    xf = norm_source(x_ptr, r_ptr, s_ptr, m, tl.arange(0, KP), K, NORM, STORE, RNE)
    return tl.math.rsqrt(tl.sum(xf[None, :] * xf[None, :], axis=1) / K + eps)


@triton.jit
def x_normed_row(x_ptr, r_ptr, s_ptr, nw_ptr, m, c, eps, K: tl.constexpr, EVEN: tl.constexpr, NORM: tl.constexpr,
                 STYLE: tl.constexpr, STORE, RNE: tl.constexpr):
    """Row m's rmsnorm(x) (NORM 1) or rmsnorm(x + r) (NORM 2; STORE: this program writes s) at
    columns c, which cover the whole row (padded to a power of two): norm_rstd and x_slice in one
    pass over x, with the same sums and roundings."""
    xf = norm_source(x_ptr, r_ptr, s_ptr, m, c, K, NORM, STORE, RNE)
    rstd = tl.math.rsqrt(tl.sum(xf[None, :] * xf[None, :], axis=1) / K + eps)
    wv = masked_k(nw_ptr + c, c, K, EVEN, False).to(tl.float32)
    return tl.sum(scale_normed(xf[None, :], rstd, wv, STYLE, x_ptr.dtype.element_ty, RNE).to(tl.float32), axis=0)


@triton.jit(do_not_specialize=["M"])
def gemv_kernel(x_ptr, w_ptr, y_ptr, ws_ptr, count_ptr, M, N: tl.constexpr, K: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, SPLIT_K: tl.constexpr, RNE: tl.constexpr, WHOLE: tl.constexpr = False,
                ACT: tl.constexpr = -1, nw_ptr=None, r_ptr=None, s_ptr=None, eps=1e-6, NORM: tl.constexpr = 0,
                STYLE: tl.constexpr = 0, KP: tl.constexpr = 16, PDL: tl.constexpr = False):
    """Decode's projections without tensor cores: program (column block, split) streams a [BN, SPAN]
    slab of w with wide loads (K is contiguous) and multiplies it by x's row in f32, for each of the
    M rows in turn (M is 1 where this form is chosen; more rows only re-read the slab). With
    SPLIT_K > 1 the last arrival adds the f32 partials in split order, as gemm_kernel's SERIAL form."""
    pid_n, split = tl.program_id(0), tl.program_id(1)
    SPAN: tl.constexpr = (K + SPLIT_K * BK - 1) // (SPLIT_K * BK) * BK
    EVEN: tl.constexpr = SPAN * SPLIT_K == K
    rn = pid_n * BN + tl.arange(0, BN)
    nmask = rn < N
    rk = split * SPAN + tl.arange(0, BK)
    # Rows past N read row N-1 (never stored) and whole-K spans need no mask: unmasked, contiguous
    # loads along K that the compiler can widen to 16 bytes.
    wrow = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * K + rk[None, :]
    # The weights are never written: they stream in while the kernel before finishes (PDL), the
    # whole [BN, SPAN] slab at once with WHOLE (SPAN a power of two), else the first tile.
    if WHOLE:
        rs = split * SPAN + tl.arange(0, SPAN)
        w0 = masked_k(w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * K + rs[None, :], rs, K, EVEN, True)
    else:
        w0 = masked_k(wrow, rk, K, EVEN, True)
    pdl_wait(PDL)
    # A whole-slab program whose span is the whole row norms it in one pass (x read once, not twice)
    ONE_PASS: tl.constexpr = NORM > 0 and WHOLE and SPLIT_K == 1 and SPAN == KP
    for m32 in range(0, M):
        m = tl.cast(m32, tl.int64)   # row offsets m * N pass 2^31 on a 262,144-wide LM head past 8,192 rows
        rstd = tl.zeros([1], dtype=tl.float32)
        if NORM > 0 and not ONE_PASS:   # every program norms the whole row (from L2); program (0, 0) stores s
            rstd = norm_rstd(x_ptr, r_ptr, s_ptr, m, eps, K, KP, NORM, (pid_n == 0) & (split == 0), RNE)
        if ONE_PASS:
            xv = x_normed_row(x_ptr, r_ptr, s_ptr, nw_ptr, m, rs, eps, K, EVEN, NORM, STYLE, pid_n == 0, RNE)
            total = tl.sum(w0.to(tl.float32) * xv[None, :], axis=1)
        elif WHOLE:
            xv = x_slice(x_ptr, m, rs, K, EVEN, ACT, RNE, NORM, STYLE, r_ptr, nw_ptr, rstd)
            total = tl.sum(w0.to(tl.float32) * xv[None, :], axis=1)
        else:
            xv = x_slice(x_ptr, m, rk, K, EVEN, ACT, RNE, NORM, STYLE, r_ptr, nw_ptr, rstd)
            acc = w0.to(tl.float32) * xv[None, :]
            for k in range(BK, SPAN, BK):
                wv = masked_k(wrow + k, rk + k, K, EVEN, True)
                xv = x_slice(x_ptr, m, rk + k, K, EVEN, ACT, RNE, NORM, STYLE, r_ptr, nw_ptr, rstd)
                acc += wv.to(tl.float32) * xv[None, :]
            total = tl.sum(acc, axis=1)
        if SPLIT_K == 1:
            tl.store(y_ptr + m * N + rn, round_to(total, y_ptr.dtype.element_ty, RNE), mask=nmask)
        else:
            tl.store(ws_ptr + (split * M + m).to(tl.int64) * N + rn, total, mask=nmask)
    if SPLIT_K > 1:
        gemv_splitk_finish(ws_ptr, y_ptr, count_ptr, pid_n, rn, M, N, BN, SPLIT_K, RNE)


@triton.jit
def gemv_splitk_finish(ws_ptr, y_ptr, count_ptr, idx, rn, M, N: tl.constexpr, BN: tl.constexpr,
                       SPLIT_K: tl.constexpr, RNE: tl.constexpr):
    """A GEMV column block's serial split-K finish, after every split stored its f32 partials of the M
    rows to ws [SPLIT_K, M, N]: the last to arrive adds them in split order, rounds once, stores y and
    resets counter idx for the next launch."""
    if last_arrival(count_ptr, idx, SPLIT_K):
        for m32 in range(0, M):
            m = tl.cast(m32, tl.int64)
            total = tl.zeros((BN,), dtype=tl.float32)
            for sp in tl.static_range(SPLIT_K):
                total += tl.load(ws_ptr + (sp * M + m) * N + rn, mask=rn < N, other=0.0, cache_modifier=".cg")
            tl.store(y_ptr + m * N + rn, round_to(total, y_ptr.dtype.element_ty, RNE), mask=rn < N)
        tl.atomic_xchg(count_ptr + idx, 0)


# -- launching -------------------------------------------------------------------------------------

def p_gemv(v: Variant) -> bool:
    return bool(v.p.get("gemv"))


def norm_args(norm: dict | None, k: int) -> dict:
    """gemv_kernel's RMSNorm prologue arguments (none without a norm)."""
    if norm is None:
        return {}
    add = norm.get("r") is not None
    return {"nw_ptr": norm["w"], "r_ptr": norm.get("r"), "s_ptr": norm.get("s"), "eps": norm["eps"],
            "NORM": 2 if add else 1, "STYLE": norm_kernels.STYLES[norm["style"]], "KP": next_pow2(k)}


def tiles(m: int, n: int, p: dict) -> int:
    return cdiv(m, p["bm"]) * cdiv(n, p["bn"])


def gemm(x: torch.Tensor, w: torch.Tensor, v: Variant, y: torch.Tensor | None = None, sms: int = 132,
         act: str | None = None, norm: dict | None = None) -> torch.Tensor:
    """y = x @ w^T with variant `v`; x [M, K] and w [N, K] contiguous. GEMV forms only: with act, x is
    [M, 2K] = [g | u] and y = (act(g) * u) @ w^T; with norm {w, eps, style[, r, s]}, y =
    rmsnorm(x [+ r]) @ w^T, and s = x + r (rounded) is written."""
    m, k, n = x.shape[0], w.shape[1], w.shape[0]
    assert act is None or ((p_gemv(v) or v.p.get("hgemv")) and x.shape[1] == 2 * k), \
        "act needs a GEMV form and [g | u] rows"
    assert norm is None or (p_gemv(v) and act is None), "norm needs a GEMV form"
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if y is None else y
    if m == 0:
        return y
    p = v.p
    if p.get("hgemv"):
        if not hgemv.takes(x, w):       # f32, or a view off 16-byte alignment: a Triton form instead
            fallback = gemv_variant(16, 256, 1, 4) if act is not None else OP.default(GemmShape(m, n, k),
                                                                                      device_info(x.device))
            return gemm(x, w, fallback, y, sms, act=act)
        counts = arrival_counters(x.device, cdiv(n, p["bn"])) if p["sk"] > 1 else None
        return hgemv.run(x, w, y, p["bn"], p["w"], p["r"], p["sk"], counts, act=-1 if act is None else ACTS[act])
    flags, rne = dot_flags(x.dtype), rne_flag(x.dtype)
    opts = dict(num_warps=p["w"], num_stages=p["s"])
    if p.get("gemv"):
        sk, blocks = p["sk"], cdiv(n, p["bn"])
        ws = y if sk == 1 else torch.empty((sk, m, n), dtype=torch.float32, device=x.device)
        counts = arrival_counters(x.device, blocks) if sk > 1 else y
        gemv_kernel[(blocks, sk)](x, w, y, ws, counts, m, N=n, K=k, BN=p["bn"], BK=p["bk"], SPLIT_K=sk, RNE=rne,
                                  WHOLE=p.get("whole", False), ACT=-1 if act is None else ACTS[act],
                                  **norm_args(norm, k), **opts, **pdl(x))
        return y
    if p.get("tma"):
        from triton.tools.tensor_descriptor import TensorDescriptor

        xd = TensorDescriptor(x, [m, k], [k, 1], [p["bm"], p["bk"]])
        wd = TensorDescriptor(w, [n, k], [k, 1], [p["bn"], p["bk"]])
        if p.get("sk", 1) > 1:
            sk = p["sk"]
            ws = torch.empty((sk, m, n), dtype=torch.float32, device=x.device)
            gemm_tma_sk_kernel[(tiles(m, n, p), sk)](xd, wd, y, ws, arrival_counters(x.device, tiles(m, n, p)), m, N=n,
                                                     K=k, BM=p["bm"], BN=p["bn"], BK=p["bk"], GROUP_M=GROUP_M,
                                                     SPLIT_K=sk, UPCAST=flags["UPCAST"], RNE=rne, **opts)
            return y
        yd = TensorDescriptor(y, [m, n], [n, 1], [p["bm"], p["bn"]])
        programs = min(sms, tiles(m, n, p)) if p.get("persistent") else tiles(m, n, p)
        gemm_tma_kernel[(programs,)](xd, wd, yd, m, N=n, K=k, BM=p["bm"], BN=p["bn"], BK=p["bk"], GROUP_M=GROUP_M,
                                     PROGRAMS=sms if p.get("persistent") else 0, UPCAST=flags["UPCAST"], RNE=rne,
                                     **opts)
        return y
    sk, serial = p.get("sk", 1), not p.get("sum", False)
    ws = y if sk == 1 else torch.empty((sk, m, n), dtype=torch.float32, device=x.device)
    counts = arrival_counters(x.device, tiles(m, n, p)) if sk > 1 and serial else y
    gemm_kernel[(tiles(m, n, p), sk)](x, w, y, ws, counts, m, N=n, K=k, BM=p["bm"], BN=p["bn"], BK=p["bk"],
                                      GROUP_M=GROUP_M, SPLIT_K=sk, SERIAL=serial, RNE=rne, **flags, **opts, **pdl(x))
    if sk > 1 and not serial:
        splitk_sum_kernel[(cdiv(m * n, 1024),)](ws, y, m * n, SPLIT_K=sk, BLOCK=1024, RNE=rne, num_warps=4)
    return y


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def arrival_counters(device: torch.device, n: int) -> torch.Tensor:
    """Per-tile arrival counters for serial split-K, zero between launches (the last arrival resets
    its own). One buffer per device, grown as needed; kernels on one stream never share it at once.
    NOTE: allocate (run once) before capturing a CUDA graph that uses it."""
    buf = _COUNTERS.get(device)
    if buf is None or buf.numel() < n:
        buf = _COUNTERS[device] = torch.zeros(max(n, 4096), dtype=torch.int32, device=device)
    return buf


def tma_ok(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor) -> bool:
    """The copy engine needs 16-byte aligned bases and row strides."""
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (x, w, y))


# -- the op: variants, inputs, outputs --------------------------------------------------------------

@dataclass(frozen=True)
class GemmShape:
    rows: int     # M, tokens (runtime)
    n: int        # output features (constexpr)
    k: int        # input features (constexpr)

    @property
    def key(self) -> tuple:
        return (self.n, self.k)


def tile_variant(bm, bn, bk, w, s, sk=1, tma=False, persistent=False, sum_kernel=False) -> Variant:
    """Names spell the form: [tma_|tma_pers_]bm.._bn.._bk.._w(arps).._s(tages)..[_sk(splits)..[_sum]];
    _sum: the split partials are added by a second kernel instead of the last arriving program."""
    prefix = ("tma_pers_" if persistent else "tma_") if tma else ""
    name = f"{prefix}bm{bm}_bn{bn}_bk{bk}_w{w}_s{s}" + (f"_sk{sk}" if sk > 1 else "")
    extra = dict(tma=True, persistent=persistent) if tma else dict(sk=sk)
    if tma and sk > 1:                  # gemm_tma_sk_kernel (never persistent)
        extra["sk"] = sk
    if sk > 1 and sum_kernel:
        name, extra["sum"] = name + "_sum", True
    return variant(name, bm=bm, bn=bn, bk=bk, w=w, s=s, **extra)


def gemv_variant(bn, bk, sk, w, s=2, whole=False) -> Variant:
    """gemv_kernel: BN output features a program, BK-wide loads, SPLIT_K ranges of K; whole: the
    program's whole weight slab loaded at once, before it waits for the kernel before (PDL)."""
    return variant(f"gemv_bn{bn}_bk{bk}_sk{sk}_w{w}_s{s}" + ("_whole" if whole else ""), gemv=True, bn=bn, bk=bk,
                   sk=sk, w=w, s=s, bm=1, whole=whole)


def gemv_span(k: int, p: dict) -> int:
    """K per split, in whole BK steps (gemv_kernel's SPAN)."""
    return cdiv(k, p["sk"] * p["bk"]) * p["bk"]


def whole_fits(s, p: dict) -> bool:
    """A whole slab is one tile: SPAN a power of two, at most 128 weights a thread in registers."""
    span = gemv_span(s.k, p)
    return span == next_pow2(span) and p["bn"] * span <= 128 * 32 * p["w"]


TRUSTED = tile_variant(128, 128, 32, 4, 1)   # plain tiles, no split, no pipelining, no TMA
# (bm, bn, bk, warps, stages): large tiles for long prompts, narrow ones for few tokens or few columns.
GPU_TILES = [(128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 4, 4),
             (128, 128, 128, 8, 3), (64, 256, 64, 4, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4),
             (64, 64, 64, 4, 4), (64, 64, 128, 4, 3), (128, 32, 64, 4, 4), (64, 32, 128, 4, 4),
             # one 64 x 64 tile per SM over a long K needs a deep pipeline (as cuBLAS runs it), not
             # split-K (docs/compiler.md)
             (64, 64, 128, 4, 5), (64, 64, 128, 4, 6), (64, 64, 64, 4, 8), (64, 64, 64, 4, 10),
             (128, 16, 128, 4, 4), (64, 16, 128, 4, 4), (32, 64, 128, 4, 4), (32, 128, 64, 4, 4),
             (16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 32, 256, 4, 3), (16, 256, 64, 4, 3),
             (32, 16, 256, 4, 3), (32, 32, 128, 4, 4), (16, 16, 256, 4, 3)]
SPLIT_TILES = [(128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4),
               (64, 32, 128, 4, 4), (64, 16, 128, 4, 4), (32, 16, 256, 4, 3), (16, 64, 128, 4, 4),
               (16, 128, 128, 4, 3), (16, 16, 256, 4, 3)]
TMA_TILES = [(128, 256, 64, 8, 3), (256, 128, 64, 8, 3), (128, 128, 64, 8, 4), (128, 128, 64, 8, 5),
             (128, 128, 64, 4, 4), (64, 256, 64, 4, 4), (128, 64, 64, 4, 4), (64, 64, 128, 4, 5)]
TMA_SPLIT_TILES = [(128, 128, 64, 8, 4), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4)]
GEMV_FORMS = [(bn, bk, sk, 4) for bn in (8, 16, 32) for bk in (256, 512) for sk in (1, 2, 4, 8)]
GEMV_FORMS += [(64, 128, 1, 8), (128, 64, 1, 8), (64, 256, 1, 8)]   # wide blocks: the LM head's 248k columns
# tests only: the interpreter's cost is per program (and per row)
CPU_GEMV = [(16, 64, 1, 4), (8, 32, 3, 4), (16, 32, 2, 4, 2, True)]
# Under the interpreter, whose cost is per program: few, large tiles that still take every code
# path (ragged tiles, K not a multiple of BK, split-K).
CPU_TILES = [(256, 256, 64, 4, 1), (64, 128, 32, 4, 1), (16, 128, 64, 4, 1)]
CPU_SPLITS = [((128, 128, 32, 4, 1), 2, False), ((128, 128, 32, 4, 1), 3, True)]


def fits(shape, p: dict) -> bool:
    """No tile wider than the problem (next power of two, at least 16), except that 16 to 63 rows may
    take 64-row tiles: Hopper's warpgroup MMA is 64 rows tall, narrower tiles fall back to the older
    MMA (a batched decode step of 32 rows: 9.2 ms with the 32-row bucket's tiles, 8.2 with 64 rows)."""
    rows = max(16 if shape.rows < 16 else 64, next_pow2(shape.rows))
    return p["bm"] <= rows and p["bn"] <= max(16, next_pow2(shape.n)) and p["bk"] <= max(16, next_pow2(shape.k))


def worth_measuring(shape, p: dict, sms: int) -> bool:
    """Prune forms that cannot win: narrow tiles where wide ones fill the GPU, split-K where the
    tiles alone already fill it, row tiles far narrower than the rows."""
    m, n = shape.rows, shape.n
    t = tiles(m, n, p)
    skinny = p["bm"] == 32 and n <= 64           # few columns: more row tiles keep the SMs busy
    if p["bm"] < 64 and m >= 64 and not skinny:
        return False
    if p["bn"] < 64 and n >= 4 * p["bn"] and cdiv(m, p["bm"]) * cdiv(n, 64) >= sms:
        return False                             # 64 columns a tile already fill the GPU
    if t >= 4 * sms and p["bm"] * p["bn"] < 128 * 128:
        return False
    sk = p.get("sk", 1)
    return sk == 1 or (t < sms and shape.k // sk >= 4 * p["bk"])


def hgemv_variant(bn: int, w: int, r: int, sk: int) -> Variant:
    """hgemv.py's CUDA C form: BN rows a block of W warps, R rows a pass, SK splits of K."""
    return variant(f"cuda_bn{bn}_w{w}_r{r}_sk{sk}", hgemv=True, bn=bn, w=w, r=r, sk=sk, s=1, bm=1, bk=8)


# (bn, warps, rows a pass, splits) of the CUDA C GEMV, warps cut to the split's slabs. On the H100
# (bench/NOTES.md, 2026-12-05) they won 11 of the 0.8b's and 9B's 13 one-row shapes, bn 8/16 10 of those;
# splits won the 9B's 4096-row shapes and its LM head
GPU_HGEMV = [(bn, 4, r, sk) for bn in (8, 16, 32) for r in (4, 8) for sk in (1, 2, 4)]


def hgemv_forms(s, dev) -> list[Variant]:
    """The CUDA C GEMV forms that fit one row of `s`, where CUDA C kernels compile and launch."""
    if s.rows != 1 or not nvrtc.kernels_run(dev):
        return []
    return hgemv_fitting(s, GPU_HGEMV)


def hgemv_fitting(s, forms: list[tuple]) -> list[Variant]:
    """hgemv_variant of each (bn, warps, r, sk) that fits `s`, its warps cut to the split's slabs."""
    out = []
    for bn, w, r, sk in forms:
        w = max(1, min(w, cdiv(s.k // 8 // sk, 32))) if s.k % (8 * sk) == 0 else w
        if hgemv.shape_fits(s.n, s.k, bn, w, r, sk):
            out.append(hgemv_variant(bn, w, r, sk))
    return list(dict.fromkeys(out))


def gemv_worth(shape, p: dict, sms: int) -> bool:
    """At least one program per SM and at most 32, each with at least one BK step per split."""
    programs = cdiv(shape.n, p["bn"]) * p["sk"]
    return sms <= programs <= 32 * sms and shape.k // p["sk"] >= p["bk"]


class GemmOp(Op):
    name = "gemm"
    sources = (__file__, COMMON, norm_kernels.__file__, ACTS_FILE, helpers.__file__, hgemv.__file__,
               cuda_common.__file__, nvrtc.__file__)
    shape_type = GemmShape

    def shape_str(self, s: GemmShape) -> str:
        return f"{s.rows}x{s.n}x{s.k}"

    def with_rows(self, s: GemmShape, rows: int) -> GemmShape:
        return GemmShape(rows, s.n, s.k)

    def catalogue(self, s: GemmShape, dev) -> list[Variant]:
        if dev.capability is None:
            forms = [TRUSTED] + [tile_variant(*t) for t in CPU_TILES]
            forms += [tile_variant(*t, sk=k, sum_kernel=f) for t, k, f in CPU_SPLITS]
        else:
            forms = [TRUSTED] + [tile_variant(*t) for t in GPU_TILES]
            forms += [tile_variant(*t, sk=k, sum_kernel=sum_kernel) for t in SPLIT_TILES for k in (2, 4, 8)
                      for sum_kernel in (False, True)]
            if dev.tma and s.n % 8 == 0 and s.k % 8 == 0:
                forms += [tile_variant(*t, tma=True, persistent=pers) for pers in (False, True) for t in TMA_TILES]
                if try_unmeasured():      # not yet run on a GPU: offered only on request
                    forms += [tile_variant(*t, sk=k, tma=True) for t in TMA_SPLIT_TILES for k in (2, 4)]
            if s.rows == 1:
                forms += [gemv_variant(*g, whole=whole) for g in GEMV_FORMS for whole in (False, True)]
            forms += hgemv_forms(s, dev)
        return forms

    def candidates(self, s: GemmShape, dev) -> list[Variant]:
        forms = [v for v in self.catalogue(s, dev) if fits(s, v.p)]
        if dev.capability is None:
            return forms
        forms = [v for v in forms if not v.p.get("whole") or whole_fits(s, v.p)]
        return [v for v in forms if v == TRUSTED or v.p.get("hgemv") or (gemv_worth(s, v.p, dev.sms) if v.p.get("gemv")
                                                      else worth_measuring(s, v.p, dev.sms))]

    def trusted(self, s, dev) -> Variant:
        return TRUSTED

    def default(self, s: GemmShape, dev) -> Variant:
        if dev.capability is None:
            return TRUSTED
        if s.rows <= 16:
            return tile_variant(16, 64, 128, 4, 4)
        return tile_variant(64, 128, 64, 4, 4) if s.rows <= 256 else tile_variant(128, 128, 64, 8, 4)

    def inputs(self, s: GemmShape, dtype, device, gen) -> dict:
        x = torch.randn(s.rows, s.k, generator=gen, device=device)
        w = torch.randn(s.n, s.k, generator=gen, device=device) * s.k ** -0.5
        return {"x": x.to(dtype), "w": w.to(dtype)}

    def outputs(self, s: GemmShape, inputs: dict) -> dict:
        x = inputs["x"]
        return {"y": torch.empty((x.shape[0], inputs["w"].shape[0]), dtype=x.dtype, device=x.device)}

    def launch(self, v: Variant, inputs: dict, outputs: dict, plan=None) -> None:
        sms = plan.dev.sms if plan is not None else 132
        gemm(inputs["x"], inputs["w"], v, outputs["y"], sms=sms)

    def compile(self, v: Variant, s: GemmShape, dtype, device) -> list:
        if interpreting() or v.run is not None:
            return []
        sms = device_info(device).sms
        x = torch.empty((1, s.k), dtype=dtype, device=device)
        w = torch.empty((s.n, s.k), dtype=dtype, device=device)
        y = torch.empty((1, s.n), dtype=dtype, device=device)
        p, opts = v.p, dict(num_warps=v.p["w"], num_stages=v.p["s"], grid=(1,))
        if p.get("hgemv"):        # a CUDA C kernel: compiled and loaded, no Triton launcher
            hgemv.run(x, w, y, p["bn"], p["w"], p["r"], p["sk"], warm=True)
            return []
        if p.get("gemv"):
            ws = y if p["sk"] == 1 else torch.empty((p["sk"], 1, s.n), dtype=torch.float32, device=device)
            counts = torch.zeros(1, dtype=torch.int32, device=device) if p["sk"] > 1 else y
            return [gemv_kernel.warmup(x, w, y, ws, counts, 1, N=s.n, K=s.k, BN=p["bn"], BK=p["bk"], SPLIT_K=p["sk"],
                                       RNE=False, WHOLE=p.get("whole", False), **opts, **pdl(x))]
        if p.get("tma"):
            from triton.tools.tensor_descriptor import TensorDescriptor
            d = [TensorDescriptor(t, list(t.shape), [t.shape[1], 1], blk)
                 for t, blk in ((x, [p["bm"], p["bk"]]), (w, [p["bn"], p["bk"]]), (y, [p["bm"], p["bn"]]))]
            if p.get("sk", 1) > 1:
                ws = torch.empty((p["sk"], 1, s.n), dtype=torch.float32, device=device)
                counts = torch.zeros(1, dtype=torch.int32, device=device)
                return [gemm_tma_sk_kernel.warmup(d[0], d[1], y, ws, counts, 1, N=s.n, K=s.k, BM=p["bm"], BN=p["bn"],
                                                  BK=p["bk"], GROUP_M=GROUP_M, SPLIT_K=p["sk"], UPCAST=False, RNE=False,
                                                  **opts)]
            return [gemm_tma_kernel.warmup(*d, 1, N=s.n, K=s.k, BM=p["bm"], BN=p["bn"], BK=p["bk"], GROUP_M=GROUP_M,
                                           PROGRAMS=sms if p.get("persistent") else 0, UPCAST=False, RNE=False, **opts)]
        sk, serial = p.get("sk", 1), not p.get("sum", False)
        ws = y if sk == 1 else torch.empty((sk, 1, s.n), dtype=torch.float32, device=device)
        counts = torch.zeros(1, dtype=torch.int32, device=device) if sk > 1 and serial else y
        kernels = [gemm_kernel.warmup(x, w, y, ws, counts, 1, N=s.n, K=s.k, BM=p["bm"], BN=p["bn"], BK=p["bk"],
                                      GROUP_M=GROUP_M, SPLIT_K=sk, SERIAL=serial, RNE=False, **dot_flags(dtype), **opts,
                                      **pdl(x))]
        if sk > 1 and not serial:
            kernels.append(splitk_sum_kernel.warmup(ws, y, s.n, SPLIT_K=sk, BLOCK=1024, RNE=False, num_warps=4,
                                                    grid=(1,)))
        return kernels

    def kernel_sources(self, v: Variant) -> list | str:
        if v.p.get("hgemv"):
            return hgemv.SOURCE        # CUDA C: `kiln kernels --dump` writes it as a .cu file
        if v.p.get("gemv"):
            return [gemv_kernel, masked_k, x_slice, x_normed_row, norm_source, act_f32, pdl_wait, round_to,
                    last_arrival, gemv_splitk_finish, norm_rstd, scale_normed, norm_kernels.style_scaled]
        if v.p.get("tma"):
            return ([gemm_tma_sk_kernel, tile_of, mma, round_to, splitk_finish, last_arrival] if v.p.get("sk", 1) > 1
                    else [gemm_tma_kernel, tma_tile, tile_of, mma])
        return [gemm_kernel, tile_of, mma, round_to, splitk_finish, last_arrival, pdl_wait] + (
            [splitk_sum_kernel] if v.p.get("sum") else [])

    def supports(self, x: torch.Tensor, w: torch.Tensor) -> bool:
        return x.dtype in SUPPORTED and w.dtype == x.dtype


OP = register(GemmOp())
