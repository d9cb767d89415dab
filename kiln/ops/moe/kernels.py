"""Routed experts (mixture of experts): y[t] = sum over t's top-k experts e, in ascending id, of
w[t, e] * down_e(act(gate_e(x[t])) * up_e(x[t])), rounded where ReferenceOps.moe_experts rounds.

Two forms, both measured by the tuner:
- grouped (prefill): the T*k (token, slot) pairs are grouped by expert on the device (a counting
  sort); each program takes a block of BM rows of one expert (each expert's rows padded to whole
  blocks, read from a table the sort writes) and runs a tensor-core GEMM. Kernel 1: gate_up with the
  activation and the product in its epilogue -> h [T*k, I]; kernel 2: down, times the routing weight
  -> y [T*k, H]; kernel 3: the combine.
- gemv (decode, few tokens): one program per (pair, column block), no sorting, no padded tile rows.
The combine adds each token's k contributions in ascending expert id with a rounding after each add,
as the reference's index_add into the activation-dtype buffer does.

Every launch has a grid fixed by T (an upper bound on the blocks; blocks past the real count exit
at once) and nothing reads device values on the host: the whole op can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...tune.device import device_info, interpreting
from ...tune.registry import Op, Variant, register, variant
from .. import cuda_common, nvrtc
from ..common import COMMON, EXACT_ROUNDING, SUPPORTED, cdiv, dot_flags, next_pow2, pdl, pdl_wait, rne_flag, round_to
from ..gemm import gemm, helpers, hgemv
from . import hpairs

ACTS = {"silu": 0, "gelu_pytorch_tanh": 1}
COMBINE_BH = 256     # columns per combine program: the combine reads k rows, it is never the bottleneck


# -- device helpers --------------------------------------------------------------------------------

@triton.jit
def activate(g, ACT: tl.constexpr):
    """g in f32. silu, or gelu with the tanh approximation written as 0.5 g (1 + tanh(u)) =
    g sigmoid(2u): no libdevice (the interpreter runs the same formula) and no cancellation
    where 1 + tanh(u) is small."""
    if ACT == 0:
        return g / (1.0 + tl.exp(-g))
    u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
    return g / (1.0 + tl.exp(-2.0 * u))


@triton.jit
def glu(acc_g, acc_u, dtype: tl.constexpr, ACT: tl.constexpr, RNE: tl.constexpr):
    """h = act(gate) * up with the reference's roundings: gate and up, act(gate), the product."""
    g = round_to(acc_g, dtype, RNE).to(tl.float32)
    u = round_to(acc_u, dtype, RNE).to(tl.float32)
    a = round_to(activate(g, ACT), dtype, RNE).to(tl.float32)
    return round_to(a * u, dtype, RNE)


@triton.jit
def weighted(acc, w, dtype: tl.constexpr, RNE: tl.constexpr):
    """down output rounded, times the routing weight (f32 product of the two), rounded: the same
    value whether the weights are 16-bit (torch multiplies in f32 then rounds) or f32."""
    d = round_to(acc, dtype, RNE).to(tl.float32)
    return round_to(d * w, dtype, RNE)


@triton.jit
def table_block(blocks_ptr):
    """This program's row block from the table place_kernel wrote: (expert, first row, end of rows)."""
    b = blocks_ptr + tl.program_id(0) * 4
    return tl.load(b), tl.load(b + 1), tl.load(b + 2)


# -- grouped (prefill) -----------------------------------------------------------------------------

@triton.jit(do_not_specialize=["P"])
def grouped_gate_up_kernel(x_ptr, w_ptr, order_ptr, blocks_ptr, h_ptr, P, E: tl.constexpr, KTOP: tl.constexpr,
                           H: tl.constexpr, I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                           ACT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                           RNE: tl.constexpr):
    """h[sorted rows, n block] for one block of one expert: x rows gathered by token, the gate tile
    (w rows n..) and the up tile (w rows I + n..) of gate_up [E, 2I, H] in one pass over H."""
    e, row0, row_end = table_block(blocks_ptr)
    if e >= E:
        return
    rm = row0 + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    tok = tl.load(order_ptr + tl.minimum(rm, P - 1)) // KTOP       # rows past the expert read a valid row
    xs = x_ptr + tok.to(tl.int64)[:, None] * H + rk[None, :]
    gs = w_ptr + e.to(tl.int64) * (2 * I * H) + tl.minimum(rn, I - 1).to(tl.int64)[None, :] * H + rk[:, None]
    us = gs + I * H
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, H, BK):
        if H % BK == 0:
            a = tl.load(xs)
            bg = tl.load(gs)
            bu = tl.load(us)
        else:
            inside = rk + k < H
            a = tl.load(xs, mask=inside[None, :], other=0.0)
            bg = tl.load(gs, mask=inside[:, None], other=0.0)
            bu = tl.load(us, mask=inside[:, None], other=0.0)
        acc_g = helpers.mma(acc_g, a, bg, UPCAST, IEEE)
        acc_u = helpers.mma(acc_u, a, bu, UPCAST, IEEE)
        xs += BK
        gs += BK
        us += BK
    keep = (rm < row_end)[:, None] & (rn < I)[None, :]
    h = glu(acc_g, acc_u, h_ptr.dtype.element_ty, ACT, RNE)
    tl.store(h_ptr + rm.to(tl.int64)[:, None] * I + rn[None, :], h, mask=keep)


@triton.jit(do_not_specialize=["P"])
def grouped_down_kernel(h_ptr, w_ptr, order_ptr, blocks_ptr, rw_ptr, y_ptr, P, E: tl.constexpr, H: tl.constexpr,
                        I: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr,
                        IEEE: tl.constexpr, RNE: tl.constexpr):
    """y[pair, n block] = round(round(h @ down_e^T) * routing weight) for one block of one expert;
    h rows are in sorted order, y rows in pair order (token * k + slot)."""
    e, row0, row_end = table_block(blocks_ptr)
    if e >= E:
        return
    rm = row0 + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    hs = h_ptr + tl.minimum(rm, P - 1).to(tl.int64)[:, None] * I + rk[None, :]
    ws = w_ptr + e.to(tl.int64) * (H * I) + tl.minimum(rn, H - 1).to(tl.int64)[None, :] * I + rk[:, None]
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, I, BK):
        if I % BK == 0:
            a = tl.load(hs)
            b = tl.load(ws)
        else:
            inside = rk + k < I
            a = tl.load(hs, mask=inside[None, :], other=0.0)
            b = tl.load(ws, mask=inside[:, None], other=0.0)
        acc = helpers.mma(acc, a, b, UPCAST, IEEE)
        hs += BK
        ws += BK
    inside = rm < row_end
    pair = tl.load(order_ptr + rm, mask=inside, other=0)
    rw = tl.load(rw_ptr + pair, mask=inside, other=0.0).to(tl.float32)
    y = weighted(acc, rw[:, None], y_ptr.dtype.element_ty, RNE)
    tl.store(y_ptr + pair.to(tl.int64)[:, None] * H + rn[None, :], y, mask=inside[:, None] & (rn < H)[None, :])


# -- gemv (decode) ---------------------------------------------------------------------------------

@triton.jit
def tile_w(ws, k, rk, K: tl.constexpr, EVEN: tl.constexpr):
    """A [BN, BK] tile of weight rows (pointers ws at column 0) at column k, in f32, zero past K."""
    if EVEN:
        return tl.load(ws + k).to(tl.float32)
    return tl.load(ws + k, mask=(rk + k < K)[None, :], other=0.0).to(tl.float32)


@triton.jit
def tile_x(xs, k, rk, K: tl.constexpr, EVEN: tl.constexpr):
    """The activation row's [1, BK] slice at column k, in f32, zero past K."""
    if EVEN:
        return tl.load(xs + k).to(tl.float32)[None, :]
    return tl.load(xs + k, mask=rk + k < K, other=0.0).to(tl.float32)[None, :]


@triton.jit(do_not_specialize=["P"])
def gemv_gate_up_kernel(x_ptr, w_ptr, idx_ptr, h_ptr, P, KTOP: tl.constexpr, H: tl.constexpr, I: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, ACT: tl.constexpr, RNE: tl.constexpr,
                        ACC: tl.constexpr = False, PDL: tl.constexpr = False):
    """h[pair, n block] for one (token, slot) pair: w tiles times the token's x row, in f32. ACC: the
    products accumulate elementwise and are reduced once at the end (as the dense GEMV), else each
    tile is reduced as it comes."""
    pair = tl.program_id(0)
    pdl_wait(PDL)     # the ids may be the kernel just before's output
    e = tl.load(idx_ptr + pair).to(tl.int64)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    EVEN: tl.constexpr = H % BK == 0
    xs = x_ptr + (pair // KTOP).to(tl.int64) * H + rk
    gs = w_ptr + e * (2 * I * H) + tl.minimum(rn, I - 1).to(tl.int64)[:, None] * H + rk[None, :]
    us = gs + I * H
    if ACC:
        acc_g = tl.zeros((BN, BK), dtype=tl.float32)
        acc_u = tl.zeros((BN, BK), dtype=tl.float32)
        for k in range(0, H, BK):
            a = tile_x(xs, k, rk, H, EVEN)
            acc_g += tile_w(gs, k, rk, H, EVEN) * a
            acc_u += tile_w(us, k, rk, H, EVEN) * a
        sum_g, sum_u = tl.sum(acc_g, axis=1), tl.sum(acc_u, axis=1)
    else:
        sum_g = tl.zeros((BN,), dtype=tl.float32)
        sum_u = tl.zeros((BN,), dtype=tl.float32)
        for k in range(0, H, BK):
            a = tile_x(xs, k, rk, H, EVEN)
            sum_g += tl.sum(tile_w(gs, k, rk, H, EVEN) * a, axis=1)
            sum_u += tl.sum(tile_w(us, k, rk, H, EVEN) * a, axis=1)
    h = glu(sum_g, sum_u, h_ptr.dtype.element_ty, ACT, RNE)
    tl.store(h_ptr + pair.to(tl.int64) * I + rn, h, mask=rn < I)


@triton.jit(do_not_specialize=["P"])
def gemv_down_kernel(h_ptr, w_ptr, idx_ptr, rw_ptr, y_ptr, P, H: tl.constexpr, I: tl.constexpr, BN: tl.constexpr,
                     BK: tl.constexpr, RNE: tl.constexpr, ACC: tl.constexpr = False, PDL: tl.constexpr = False,
                     out_ptr=None, x_ptr=None, g_ptr=None, s_ptr=None, count_ptr=None, KTOP: tl.constexpr = 1,
                     KP: tl.constexpr = 1, FINISH: tl.constexpr = False, GATE: tl.constexpr = False,
                     HP: tl.constexpr = 16):
    """y[pair, n block] = round(round(down_e h[pair]) * routing weight). The expert id and its first
    weight tile load before the wait: they never come from the kernel just before (gate_up). FINISH:
    the last of a token's k pairs to store its block also combines the token's block (combine_cols:
    one launch fewer, the same sums in the same order)."""
    pair = tl.program_id(0)
    e = tl.load(idx_ptr + pair).to(tl.int64)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    EVEN: tl.constexpr = I % BK == 0
    hs = h_ptr + pair.to(tl.int64) * I + rk
    ws = w_ptr + e * (H * I) + tl.minimum(rn, H - 1).to(tl.int64)[:, None] * I + rk[None, :]
    w = tile_w(ws, 0, rk, I, EVEN)
    pdl_wait(PDL)
    if ACC:
        acc = w * tile_x(hs, 0, rk, I, EVEN)
        for k in range(BK, I, BK):
            acc += tile_w(ws, k, rk, I, EVEN) * tile_x(hs, k, rk, I, EVEN)
        total = tl.sum(acc, axis=1)
    else:
        total = tl.sum(w * tile_x(hs, 0, rk, I, EVEN), axis=1)
        for k in range(BK, I, BK):
            total += tl.sum(tile_w(ws, k, rk, I, EVEN) * tile_x(hs, k, rk, I, EVEN), axis=1)
    y = weighted(total, tl.load(rw_ptr + pair).to(tl.float32), y_ptr.dtype.element_ty, RNE)
    tl.store(y_ptr + pair.to(tl.int64) * H + rn, y, mask=rn < H)
    if FINISH:
        t = (pair // KTOP).to(tl.int64)
        at = t * tl.num_programs(1) + tl.program_id(1)
        if helpers.last_arrival(count_ptr, at, KTOP):
            combine_cols(y_ptr, idx_ptr, out_ptr, x_ptr, g_ptr, s_ptr, t, rn, KTOP, KP, H, RNE, GATE, HP)
            tl.atomic_xchg(count_ptr + at, 0)


# -- combine -----------------------------------------------------------------------------------------

@triton.jit
def combine_cols(y_ptr, idx_ptr, out_ptr, x_ptr, g_ptr, s_ptr, t, cols, KTOP: tl.constexpr, KP: tl.constexpr,
                 H: tl.constexpr, RNE: tl.constexpr, GATE: tl.constexpr, HP: tl.constexpr):
    """out[t, cols] = the token's k contributions y[t * k + slot], added in ascending expert id with a
    rounding to out's dtype after each add; with GATE then + sigmoid(x[t] . g) * shared[t], rounded as
    gate_add_kernel. NOTE: assumes a token's k expert ids are distinct."""
    slots = tl.arange(0, KP)
    ids = tl.load(idx_ptr + t * KTOP + slots, mask=slots < KTOP, other=0).to(tl.int64)
    ids = tl.where(slots < KTOP, ids, (1 << 30) + slots)               # padding ranks last (ids < 2^30)
    rank = tl.sum((ids[:, None] < ids[None, :]).to(tl.int32), axis=0)    # [KP]: how many ids are smaller
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros(cols.shape, dtype=tl.float32)
    for j in tl.static_range(KTOP):
        slot = tl.sum(tl.where(rank == j, slots, 0), axis=0)
        y = tl.load(y_ptr + (t * KTOP + slot) * H + cols, mask=cols < H, other=0.0).to(tl.float32)
        acc = round_to(acc + y, dtype, RNE).to(tl.float32)
    if GATE:
        acc = round_to(acc + gate_term(x_ptr, g_ptr, s_ptr, t, cols, H, HP, dtype, RNE), dtype, RNE).to(tl.float32)
    tl.store(out_ptr + t * H + cols, acc.to(dtype), mask=cols < H)


@triton.jit(do_not_specialize=["T"])
def combine_kernel(y_ptr, idx_ptr, out_ptr, x_ptr, g_ptr, s_ptr, T, KTOP: tl.constexpr, KP: tl.constexpr,
                   H: tl.constexpr, BH: tl.constexpr, RNE: tl.constexpr, GATE: tl.constexpr = False,
                   HP: tl.constexpr = 16, PDL: tl.constexpr = False):
    """Program (token, column block): combine_cols."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    pdl_wait(PDL)
    combine_cols(y_ptr, idx_ptr, out_ptr, x_ptr, g_ptr, s_ptr, t, cols, KTOP, KP, H, RNE, GATE, HP)


# -- shared-expert gate (one launch instead of torch's 4; the router is in router.py) ----------------

@triton.jit
def gate_term(x_ptr, g_ptr, s_ptr, t, cols, H: tl.constexpr, HP: tl.constexpr, dtype: tl.constexpr,
              RNE: tl.constexpr):
    """round(sigmoid(x[t] . g) * shared[t, cols]) in f32, the logit and the sigmoid each rounded to the
    activation dtype as the reference's linear and sigmoid round. Every caller recomputes the H-long
    dot (a few KB)."""
    k = tl.arange(0, HP)
    g = tl.load(g_ptr + k, mask=k < H, other=0.0).to(tl.float32)
    xv = tl.load(x_ptr + t * H + k, mask=k < H, other=0.0).to(tl.float32)
    logit = round_to(tl.sum(xv * g, axis=0), dtype, RNE).to(tl.float32)
    sig = round_to(1.0 / (1.0 + tl.exp(-logit)), dtype, RNE).to(tl.float32)
    sh = tl.load(s_ptr + t * H + cols, mask=cols < H, other=0.0).to(tl.float32)
    return round_to(sig * sh, dtype, RNE).to(tl.float32)


@triton.jit
def gate_add_kernel(r_ptr, x_ptr, g_ptr, s_ptr, out_ptr, H: tl.constexpr, HP: tl.constexpr, BH: tl.constexpr,
                    RNE: tl.constexpr, PDL: tl.constexpr = False):
    """out = routed + sigmoid(x . g) * shared, rounded where the reference's linear, sigmoid, product
    and sum each round to the activation dtype."""
    t = tl.program_id(0).to(tl.int64)
    dtype = out_ptr.dtype.element_ty
    cols = tl.program_id(1) * BH + tl.arange(0, BH)
    pdl_wait(PDL)
    prod = gate_term(x_ptr, g_ptr, s_ptr, t, cols, H, HP, dtype, RNE)
    r = tl.load(r_ptr + t * H + cols, mask=cols < H, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + cols, round_to(r + prod, dtype, RNE), mask=cols < H)


def shared_gate_add(routed: torch.Tensor, x: torch.Tensor, gate_w: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """routed + sigmoid(x @ gate_w.T) * shared for a [1, H] gate weight; all [T, H], one dtype."""
    t, h = x.shape
    out = torch.empty_like(routed)
    if t:
        bh = min(COMBINE_BH, next_pow2(h))
        gate_add_kernel[(t, cdiv(h, bh))](routed.contiguous(), x.contiguous(), gate_w.contiguous(), shared.contiguous(),
                                          out, H=h, HP=next_pow2(h), BH=bh, RNE=rne_flag(x.dtype), num_warps=4,
                                          **pdl(x), **EXACT_ROUNDING)
    return out


# -- launching ---------------------------------------------------------------------------------------

def max_blocks(pairs: int, experts: int, bm: int) -> int:
    """An upper bound on the padded row blocks: each expert with rows adds at most one partial block."""
    return cdiv(pairs, bm) + min(experts, pairs)


SORT_BLOCK = 128     # pairs per program of the counting sort


@triton.jit(do_not_specialize=["P"])
def rank_kernel(idx_ptr, counts_ptr, rank_ptr, P, BLOCK: tl.constexpr):
    """Each pair's rank among its expert's pairs: an atomic add on the expert's count returns the
    count before it, distinct for every pair (in whatever order the atomics land)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < P
    e = tl.load(idx_ptr + offs, mask=inside, other=0)
    rank = tl.atomic_add(counts_ptr + e, 1, mask=inside)
    tl.store(rank_ptr + offs, rank, mask=inside)


@triton.jit(do_not_specialize=["P", "NB"])
def place_kernel(idx_ptr, counts_ptr, rank_ptr, order_ptr, starts_ptr, blocks_ptr, P, NB, E: tl.constexpr,
                 EP: tl.constexpr, BLOCK: tl.constexpr, BM: tl.constexpr):
    """order[starts[e] + rank] = pair, starts[e] = the counts of the experts before e (each program
    sums them again: E is small); program 0 also writes starts [E + 1], and with BM > 0 the grouped
    kernels' table of row blocks, NB entries [NB, 4] int32 (expert, first sorted row, end of the
    expert's rows, unused): each of their programs loads its block instead of summing the counts
    again (at 1,000 tokens the down GEMM runs ~10,000 programs)."""
    ids = tl.arange(0, EP)
    counts = tl.load(counts_ptr + ids, mask=ids < E, other=0)
    begins = tl.cumsum(counts, axis=0) - counts
    if tl.program_id(0) == 0:
        tl.store(starts_ptr + ids, begins.to(tl.int64), mask=ids < E)
        tl.store(starts_ptr + E, P.to(tl.int64))
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < P
    e = tl.load(idx_ptr + offs, mask=inside, other=0)
    rank = tl.load(rank_ptr + offs, mask=inside, other=0)
    first = tl.sum(tl.where(ids[None, :] < e[:, None], counts[None, :], 0), axis=1)
    tl.store(order_ptr + first + rank, offs.to(tl.int64), mask=inside)
    if BM > 0:
        if tl.program_id(0) == 0:
            block_table(blocks_ptr, counts, begins, NB, E, EP, BLOCK, BM)


@triton.jit
def block_table(blocks_ptr, counts, begins, NB, E: tl.constexpr, EP: tl.constexpr, BLOCK: tl.constexpr,
                BM: tl.constexpr):
    """Each expert's rows (counts, begins [EP], 0 past E) as whole blocks of BM in expert order: the
    experts write their j-th blocks together (as many rounds as the busiest expert has blocks), then
    the entries past the last block get the expert E (their programs exit)."""
    ids = tl.arange(0, EP)
    nblk = (counts + BM - 1) // BM
    first = tl.cumsum(nblk, axis=0) - nblk
    for j in range(0, tl.max(nblk, axis=0)):
        has = j < nblk
        row = blocks_ptr + (first + j) * 4
        tl.store(row, ids, mask=has)
        tl.store(row + 1, begins + j * BM, mask=has)
        tl.store(row + 2, begins + counts, mask=has)
    total = tl.sum(nblk, axis=0)
    for c in range(0, NB, BLOCK):
        b = c + tl.arange(0, BLOCK)
        tl.store(blocks_ptr + b * 4, tl.zeros((BLOCK,), dtype=tl.int32) + E, mask=(b >= total) & (b < NB))


def sort_pairs(idx: torch.Tensor, experts: int, bm: int = 0):
    """(order, starts): pair ids grouped by expert in ascending expert id, and where each expert's
    rows begin among them ([E + 1], the last is T*k). A counting sort in two launches (torch.sort's
    radix passes cost ~50 us a layer at 8,000 pairs); the order within an expert is whatever the
    atomics give, which changes nothing computed: every row of the grouped GEMMs is its own. All on
    the device: no host sync. With bm: (order, starts, blocks), the row blocks of bm rows
    (place_kernel), as many as grid_blocks() says."""
    flat = idx.reshape(-1)
    p = flat.numel()
    counts = torch.zeros(experts, dtype=torch.int32, device=idx.device)
    rank = torch.empty(p, dtype=torch.int32, device=idx.device)
    order = torch.empty(p, dtype=torch.int64, device=idx.device)
    starts = torch.empty(experts + 1, dtype=torch.int64, device=idx.device)
    nb = grid_blocks(p, experts, bm) if bm else 0
    blocks = torch.empty((max(nb, 1), 4), dtype=torch.int32, device=idx.device)
    grid = (cdiv(max(p, 1), SORT_BLOCK),)
    rank_kernel[grid](flat, counts, rank, p, BLOCK=SORT_BLOCK)
    place_kernel[grid](flat, counts, rank, order, starts, blocks, p, nb, E=experts, EP=next_pow2(experts),
                       BLOCK=SORT_BLOCK, BM=bm)
    return (order, starts, blocks[:nb]) if bm else (order, starts)


def grid_blocks(pairs: int, experts: int, bm: int) -> int:
    """The grouped kernels' grid: max_blocks, and never past the pairs (each real block holds one)."""
    return min(max_blocks(pairs, experts, bm), max(pairs, 1))


def run_grouped(x, idx, rw, gate_up, down, act, p: dict, y: torch.Tensor) -> None:
    (t, hd), (e, k), i = x.shape, (gate_up.shape[0], idx.shape[1]), down.shape[2]
    order, starts, blocks = sort_pairs(idx, e, p["bm"])
    h = torch.empty((t * k, i), dtype=x.dtype, device=x.device)
    nb = blocks.shape[0]
    common = dict(E=e, BM=p["bm"], BN=p["bn"], BK=p["bk"], RNE=rne_flag(x.dtype),
                  **dot_flags(x.dtype), num_warps=p["w"], num_stages=p["s"])
    grouped_gate_up_kernel[(nb, cdiv(i, p["bn"]))](x, gate_up, order, blocks, h, t * k, KTOP=k, H=hd, I=i,
                                                   ACT=ACTS[act], **common)
    dn, dk = p.get("dn", p["bn"]), p.get("dk", p["bk"])
    grouped_down_kernel[(nb, cdiv(hd, dn))](h, down, order, blocks, rw, y, t * k, H=hd, I=i,
                                            **(common | dict(BN=dn, BK=dk)))


def run_gemv(x, idx, rw, gate_up, down, act, p: dict, y: torch.Tensor, out=None, gate=None) -> None:
    """The two GEMVs into y [T*k, H]; with variant fin (and `out` given) the down kernel combines too."""
    (t, hd), k, i = x.shape, idx.shape[1], down.shape[2]
    h = torch.empty((t * k, i), dtype=x.dtype, device=x.device)
    rne, acc, dn, dk = rne_flag(x.dtype), p.get("acc", False), p.get("dn", p["bn"]), p.get("dk", p["bk"])
    opts = dict(ACC=acc, num_warps=p["w"], num_stages=p.get("s", 1), **pdl(x))
    gemv_gate_up_kernel[(t * k, cdiv(i, p["bn"]))](x, gate_up, idx, h, t * k, KTOP=k, H=hd, I=i, BN=p["bn"],
                                                   BK=p["bk"], ACT=ACTS[act], RNE=rne, **opts)
    fin = {}
    if out is not None:
        g, s = (gate[0].contiguous(), gate[1].contiguous()) if gate is not None else (out, out)
        fin = dict(out_ptr=out, x_ptr=x, g_ptr=g, s_ptr=s, count_ptr=gemm.arrival_counters(x.device, t * cdiv(hd, dn)),
                   KTOP=k, KP=next_pow2(k), FINISH=True, GATE=gate is not None,
                   HP=next_pow2(hd) if gate is not None else 16, **EXACT_ROUNDING)
    gemv_down_kernel[(t * k, cdiv(hd, dn))](h, down, idx, rw, y, t * k, H=hd, I=i, BN=dn, BK=dk, RNE=rne, **opts, **fin)


def combine(y: torch.Tensor, idx: torch.Tensor, out: torch.Tensor, x: torch.Tensor | None = None,
            gate: tuple | None = None) -> None:
    """out = the experts' rows added per token; with gate = (gate_w [1, H], shared [T, H]) also
    + sigmoid(x . gate_w) * shared."""
    (t, hd), k = out.shape, idx.shape[1]
    bh = min(COMBINE_BH, next_pow2(hd))
    g, s = (gate[0].contiguous(), gate[1].contiguous()) if gate is not None else (out, out)
    combine_kernel[(t, cdiv(hd, bh))](y, idx, out, x if gate is not None else out, g, s, t, KTOP=k, KP=next_pow2(k),
                                      H=hd, BH=bh, RNE=rne_flag(out.dtype), GATE=gate is not None,
                                      HP=next_pow2(hd) if gate is not None else 16, num_warps=4,
                                      **pdl(out), **EXACT_ROUNDING)


def moe_experts(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                down: torch.Tensor, act: str, v: Variant | None = None, out: torch.Tensor | None = None,
                gate: tuple | None = None) -> torch.Tensor:
    """ReferenceOps.moe_experts with variant `v` (None: the op's default). x [T, H]; idx [T, k]
    (distinct expert ids per token); weights [T, k] (x's dtype or f32); gate_up [E, 2I, H] (gate
    rows first); down [E, H, I]. Returns (or fills `out`) [T, H] in x's dtype. gate = (gate_w [1, H],
    shared [T, H]): the combine adds sigmoid(x . gate_w) * shared too (ReferenceOps.moe_experts_gated)."""
    t, k = idx.shape
    out = torch.empty_like(x) if out is None else out
    if t == 0:
        return out
    if v is None:
        v = OP.default(MoeShape(t, gate_up.shape[0], k, x.shape[1], down.shape[2], act), device_info(x.device))
    x, idx, weights = x.contiguous(), idx.contiguous(), weights.contiguous()
    y = torch.empty((t * k, x.shape[1]), dtype=x.dtype, device=x.device)     # [T*k, H], pair order
    if v.p.get("fin"):
        run_gemv(x, idx, weights, gate_up, down, act, v.p, y, out, gate)
        return out
    routed(x, idx, weights, gate_up, down, act, v.p, y)
    combine(y, idx, out, x, gate)
    return out


def routed(x, idx, weights, gate_up, down, act, p: dict, y: torch.Tensor) -> None:
    """The routed experts' weighted rows y [T*k, H] (pair order) by form p (not fin): the combine's input.
    A pair form on tensors its 16-byte loads do not take (unaligned, strided) runs the default GEMV form."""
    if p.get("pairs") and hpairs.takes(x, gate_up, down, act):
        hpairs.routed(x, idx, weights, gate_up, down, act, p, y)
    elif p.get("pairs"):
        run_gemv(x, idx, weights, gate_up, down, act, gemv_variant(16, 256, 4).p, y)
    else:
        (run_gemv if p.get("gemv") else run_grouped)(x, idx, weights, gate_up, down, act, p, y)


# -- the op: variants, inputs, outputs ---------------------------------------------------------------

@dataclass(frozen=True)
class MoeShape:
    rows: int     # T, tokens (runtime)
    e: int        # experts
    k: int        # experts per token
    h: int        # hidden size
    i: int        # expert FFN size
    act: str

    @property
    def key(self) -> tuple:
        return (self.e, self.k, self.h, self.i, self.act)


def grouped_variant(bm, bn, bk, w, s, dn=None, dk=None) -> Variant:
    """Row blocks of bm, gate_up's [bn, bk] tiles (down's [dn, dk], else the same), warps, stages."""
    extra = {} if dn is None else dict(dn=dn, dk=dk)
    return variant(f"grouped_bm{bm}_bn{bn}_bk{bk}_w{w}_s{s}" + (f"_d{dn}x{dk}" if dn is not None else ""),
                   bm=bm, bn=bn, bk=bk, w=w, s=s, **extra)


def gemv_variant(bn, bk, w, s=1, acc=False, dn=None, dk=None, fin=False) -> Variant:
    """gate_up's [bn, bk] tiles (down's [dn, dk], else the same), warps, pipeline stages; acc: reduce once;
    fin: the down kernel's last arrival combines (no combine launch)."""
    name = f"gemv_bn{bn}_bk{bk}_w{w}" + (f"_s{s}" if s != 1 else "") + ("_acc" if acc else "")
    extra = ({} if dn is None else dict(dn=dn, dk=dk)) | ({"fin": True} if fin else {})
    return variant(name + (f"_d{dn}x{dk}" if dn is not None else "") + ("_fin" if fin else ""), gemv=True, bn=bn,
                   bk=bk, w=w, s=s, acc=acc, **extra)


def pairs_variant(g: tuple, d: tuple) -> Variant:
    """hpairs.py's CUDA C pair GEMVs: gate_up's form g = (bn, warps, r), down's d, then the combine."""
    return variant("hpairs_g{}w{}r{}_d{}w{}r{}".format(*g, *d), pairs=True, g=g, d=d)


def pairs_forms(s: MoeShape, dev) -> list[Variant]:
    """The pair forms where CUDA C kernels run, the prologue computes the activation and KILN_MOE_PAIRS=1
    (until their GPU tests have run), warps cut to each weight's slabs."""
    if not nvrtc.kernels_run(dev) or s.act not in hpairs.ACTS or not hpairs.pairs_on():
        return []
    gs = [(bn, hpairs.warps_for(s.h, w), r) for bn, w, r in GPU_PAIRS_GATE_UP]
    ds = [(bn, hpairs.warps_for(s.i, w), r) for bn, w, r in GPU_PAIRS_DOWN]
    return list(dict.fromkeys(pairs_variant(g, d) for g in gs if hpairs.fits(2 * s.i, s.h, g)
                              for d in ds if hpairs.fits(s.h, s.i, d)))


TRUSTED = grouped_variant(16, 32, 32, 4, 1)     # small tiles, no pipelining
# (bm, bn, bk, warps, stages): BM 16/32 for few rows per expert (decode batches, short prompts), 64 for prefill.
# (..., dn, dk): down on tiles of its own (its K is the expert's FFN size, gate_up's the hidden size).
GPU_GROUPED = [(16, 64, 128, 4, 3), (16, 128, 64, 4, 3), (32, 64, 128, 4, 3), (32, 128, 64, 4, 3),
               (64, 64, 64, 4, 3), (64, 128, 64, 4, 3), (64, 128, 64, 8, 4), (64, 64, 128, 4, 3),
               (64, 256, 32, 8, 3), (64, 64, 64, 4, 4), (32, 64, 64, 4, 4), (64, 64, 64, 4, 3, 128, 64),
               (64, 64, 64, 4, 3, 64, 128), (64, 64, 64, 4, 4, 128, 128), (128, 64, 64, 8, 3)]
# (bn, bk, warps). BN 8: 4x the programs of BN 32, more of the experts' bytes in flight at once;
# BK 2048: a 2048-wide row in one step, every load issued before the first sum.
GPU_GEMV = [(16, 128, 4), (16, 256, 4), (32, 128, 4), (32, 256, 8), (64, 128, 8), (8, 256, 4), (8, 512, 4),
            (16, 512, 8), (8, 2048, 8)]
# The accumulating forms (the products summed elementwise, one reduction at the end, as the dense GEMV):
# (bn, bk, warps, stages, down's bn, down's bk); about 32-64 f32 accumulators a thread.
GPU_GEMV_ACC = [(8, 256, 4, 1, 16, 128), (8, 256, 4, 2, 16, 128), (16, 256, 4, 2, 16, 128), (8, 512, 4, 2, 8, 256),
                (16, 128, 4, 2, 32, 64), (32, 128, 8, 2, 32, 128), (16, 512, 8, 1, 8, 512), (8, 256, 4, 3, 8, 128)]
# ... and the best of them (H200, bench/NOTES.md 2026-12-03) with the combine in the down kernel's last arrival
GPU_GEMV_FIN = [(8, 256, 4, 3, 8, 128), (8, 512, 4, 2, 8, 256), (8, 256, 4, 1, 16, 128)]
# (bn, warps, r) of the CUDA C pair GEMVs (hpairs.py): hgemv's one-row forms, gate_up's K the hidden size
# (the 35B-A3B: 8 slabs of 32 chunks), down's the expert's FFN size (512: 2 slabs)
GPU_PAIRS_GATE_UP = [(8, 4, 4), (16, 4, 8), (16, 8, 8), (32, 4, 8)]
GPU_PAIRS_DOWN = [(8, 2, 4), (16, 2, 8), (8, 1, 8)]
GEMV_MAX_ROWS = 64     # beyond this the gemv rereads each expert's weights for too many pairs
# the pair forms read an expert's weights once a pair: at 8 tokens (64 pairs of the 35B) about the bytes of
# the experts those tokens touch (57 of 256); past that, more
PAIRS_MAX_ROWS = 8
CPU_GROUPED = [(32, 32, 64, 4, 1), (64, 64, 32, 4, 1)]
CPU_GEMV = [(64, 64, 4)]
CPU_GEMV_ACC = [(16, 32, 4, 1, 32, 16)]
CPU_GEMV_FIN = [(16, 32, 4, 1, 32, 16)]


class MoeOp(Op):
    name = "moe"
    # its kernels call gemm/helpers.py's, none of gemm.py's; the pair forms' CUDA C is hgemv's and hpairs'
    sources = (__file__, helpers.__file__, COMMON, hpairs.__file__, hgemv.__file__, cuda_common.__file__)
    shape_type = MoeShape

    def shape_str(self, s: MoeShape) -> str:
        return f"{s.rows}x{s.e}e{s.k}_{s.h}x{s.i}_{s.act}"

    def with_rows(self, s: MoeShape, rows: int) -> MoeShape:
        return MoeShape(rows, s.e, s.k, s.h, s.i, s.act)

    def catalogue(self, s: MoeShape, dev) -> list[Variant]:
        cpu = dev.capability is None
        grouped, gemv, acc, fin = ((CPU_GROUPED, CPU_GEMV, CPU_GEMV_ACC, CPU_GEMV_FIN) if cpu
                                   else (GPU_GROUPED, GPU_GEMV, GPU_GEMV_ACC, GPU_GEMV_FIN))
        return ([TRUSTED] + [grouped_variant(*t) for t in grouped] + [gemv_variant(*t) for t in gemv]
                + [gemv_variant(bn, bk, w, st, True, dn, dk) for bn, bk, w, st, dn, dk in acc]
                + [gemv_variant(bn, bk, w, st, True, dn, dk, True) for bn, bk, w, st, dn, dk in fin]
                + pairs_forms(s, dev))

    def candidates(self, s: MoeShape, dev) -> list[Variant]:
        forms = self.catalogue(s, dev)
        if dev.capability is None:
            return forms
        per_expert = s.rows * s.k / s.e     # mean rows per expert
        return [v for v in forms if v == TRUSTED or
                (s.rows <= PAIRS_MAX_ROWS if v.p.get("pairs") else s.rows <= GEMV_MAX_ROWS if v.p.get("gemv")
                 else v.p["bm"] <= max(16, 4 * next_pow2(int(per_expert))))]

    def trusted(self, s, dev) -> Variant:
        return TRUSTED

    def default(self, s: MoeShape, dev) -> Variant:
        if dev.capability is None:
            return TRUSTED
        if s.rows <= 4:
            return gemv_variant(16, 256, 4)
        return grouped_variant(16, 64, 128, 4, 3) if s.rows * s.k <= 16 * s.e else grouped_variant(64, 128, 64, 4, 3)

    def inputs(self, s: MoeShape, dtype, device, gen) -> dict:
        return moe_inputs(s, dtype, device, gen)

    def outputs(self, s: MoeShape, inputs: dict) -> dict:
        return {"y": torch.empty_like(inputs["x"])}

    def launch(self, v: Variant, inputs: dict, outputs: dict, plan=None) -> None:
        i = inputs
        moe_experts(i["x"], i["idx"], i["weights"], i["gate_up"], i["down"], i["act"], v, outputs["y"])

    def compile(self, v: Variant, s: MoeShape, dtype, device) -> list:
        if interpreting() or v.run is not None:
            return []
        # Only dtypes and 16-byte alignment specialise a kernel: small stand-ins serve for every tensor.
        a = torch.empty(64, dtype=dtype, device=device)
        i64 = torch.empty(64, dtype=torch.int64, device=device)
        i32 = torch.empty(64, dtype=torch.int32, device=device)
        p, k, grid = v.p, s.k, (1,)
        kernels = [combine_kernel.warmup(a, i64, a, a, a, a, 1, KTOP=k, KP=next_pow2(k), H=s.h,
                                         BH=min(COMBINE_BH, next_pow2(s.h)), RNE=False, num_warps=4, grid=grid,
                                         **pdl(a), **EXACT_ROUNDING)]
        if p.get("pairs"):          # CUDA C: compiled and loaded (cubins cached), no Triton launcher
            x = torch.empty((1, s.h), dtype=dtype, device=device)
            gu = torch.empty((1, 2 * s.i, s.h), dtype=dtype, device=device)
            dn = torch.empty((1, s.h, s.i), dtype=dtype, device=device)
            hpairs.run_pairs(x, gu, i64, x, p["g"], k, warm=True)
            for rw in (a, torch.empty(64, dtype=torch.float32, device=device)):   # the tuner's weights, the router's
                hpairs.run_pairs(x, dn, i64, x, p["d"], 1, hpairs.ACTS[s.act], rw=rw, warm=True)
            return kernels
        if p.get("gemv"):
            opts = dict(RNE=False, ACC=p.get("acc", False), num_warps=p["w"], num_stages=p.get("s", 1), grid=grid,
                        **pdl(a))
            kernels += [gemv_gate_up_kernel.warmup(a, a, i64, a, 1, KTOP=k, H=s.h, I=s.i, ACT=ACTS[s.act], BN=p["bn"],
                                                   BK=p["bk"], **opts),
                        gemv_down_kernel.warmup(a, a, i64, a, a, 1, H=s.h, I=s.i, BN=p.get("dn", p["bn"]),
                                                BK=p.get("dk", p["bk"]), **opts, **finish_args(p, s, a, i32))]
            return kernels
        opts = dict(E=s.e, H=s.h, I=s.i, BM=p["bm"], BN=p["bn"], BK=p["bk"], RNE=False,
                    **dot_flags(dtype), num_warps=p["w"], num_stages=p["s"], grid=grid)
        kernels += [grouped_gate_up_kernel.warmup(a, a, i64, i32, a, 1, KTOP=k, ACT=ACTS[s.act], **opts),
                    grouped_down_kernel.warmup(a, a, i64, i32, a, a, 1,
                                               **(opts | dict(BN=p.get("dn", p["bn"]), BK=p.get("dk", p["bk"])))),
                    rank_kernel.warmup(i64, i32, i32, 1, BLOCK=SORT_BLOCK, grid=grid),
                    place_kernel.warmup(i64, i32, i32, i64, i64, i32, 1, 1, E=s.e, EP=next_pow2(s.e),
                                        BLOCK=SORT_BLOCK, BM=p["bm"], grid=grid)]
        return kernels

    def kernel_sources(self, v: Variant) -> list:
        shared = [combine_kernel, combine_cols, gate_term, glu, activate, weighted, round_to, pdl_wait]
        if v.p.get("pairs"):
            return hpairs.SOURCE
        if v.p.get("gemv"):
            return [gemv_gate_up_kernel, gemv_down_kernel, tile_w, tile_x, helpers.last_arrival] + shared
        return ([grouped_gate_up_kernel, grouped_down_kernel, table_block, block_table, rank_kernel, place_kernel,
                 helpers.mma] + shared)

    def supports(self, x, idx, weights, gate_up, down, act) -> bool:
        return supports(x, gate_up, down, act) and weights.dtype in (x.dtype, torch.float32) and idx.dim() == 2


def finish_args(p: dict, s: MoeShape, a: torch.Tensor, i32: torch.Tensor) -> dict:
    """The down kernel's combine arguments for compiling a fin variant (without the gate: the moe op's)."""
    if not p.get("fin"):
        return {}
    return dict(out_ptr=a, x_ptr=a, g_ptr=a, s_ptr=a, count_ptr=i32, KTOP=s.k, KP=next_pow2(s.k), FINISH=True,
                GATE=False, HP=16, **EXACT_ROUNDING)


def supports(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str = "silu") -> bool:
    """What the kernels cover: 2-D x, expert weights in x's dtype, an activation they know."""
    return (x.dtype in SUPPORTED and gate_up.dtype == x.dtype and down.dtype == x.dtype and x.dim() == 2
            and act in ACTS)


def moe_inputs(s: MoeShape, dtype, device, gen, route_dtype=None) -> dict:
    """x ~ N(0, 1); each token's k distinct experts drawn from a random subset of about 3/4 of them
    (so some experts get no tokens); positive routing weights summing to 1; expert weights ~ N(0, 0.02)."""
    live = torch.randperm(s.e, generator=gen, device=device)[:max(s.k, (3 * s.e) // 4)]
    pick = torch.rand(s.rows, live.numel(), generator=gen, device=device).argsort(dim=1)[:, :s.k]
    rw = torch.rand(s.rows, s.k, generator=gen, device=device) + 0.1
    return {"x": torch.randn(s.rows, s.h, generator=gen, device=device).to(dtype),
            "idx": live[pick],
            "weights": (rw / rw.sum(dim=1, keepdim=True)).to(route_dtype or dtype),
            "gate_up": (torch.randn(s.e, 2 * s.i, s.h, generator=gen, device=device) * 0.02).to(dtype),
            "down": (torch.randn(s.e, s.h, s.i, generator=gen, device=device) * 0.02).to(dtype),
            "act": s.act}


OP = register(MoeOp())
