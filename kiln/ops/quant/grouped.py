"""A prefill chunk's routed experts on quantised stacks, read packed: the MoE family's grouped kernels
(kiln/ops/moe/kernels.py) with each weight tile dequantised in registers as it is loaded, instead of
from a dequantised copy of the whole stack.

The copy costs a write and a read of the 16-bit stack a layer (the 397B's 12.9 GB: more than the GPU
has free beside the weights, so it went in batches), against the packed bytes here (2-bit: 1/8 of
them). Each tile's values are those the copy would hold (embed.qembed's arithmetic: scale * q rounded
to the scales' dtype, plus the bias rounded, then the compute dtype), and the tile sizes are the
grouped kernels', so the products and sums are the same: the output equals the copy's path bit for
bit under the interpreter (tests/ops/test_quant_grouped.py); compiled, the two kernels may sum their
tiles in other orders, a GEMM's rounding apart. Bits whose values cross words (3, 5, 6) take the copies.
Each word, scale and bias is loaded once a tile and spread over its values in registers."""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ...weights.quantized import QuantizedWeight
from ..common import SUPPORTED, cdiv, dot_flags, rne_flag, round_to
from ..gemm import gemm
from ..moe import kernels as mk


@triton.jit
def dequant_tile(q_ptr, s_ptr, b_ptr, rows, k0, K: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                 BK: tl.constexpr, BN: tl.constexpr, DT: tl.constexpr, RNE: tl.constexpr):
    """[BK, BN] values w[row, k0 + j] of the packed [*, K] weight (rows: int64 [1, BN]), zero past K,
    rounded as embed.qembed rounds, in dtype DT. Each word and each group's scale and bias is loaded
    once and spread over its values (a tile of BK columns holds BK / (32 / BITS) words)."""
    PER: tl.constexpr = 32 // BITS
    GROUPS: tl.constexpr = K // G
    w = k0 // PER + tl.arange(0, BK // PER)
    words = tl.load(q_ptr + rows * (K // PER) + w[:, None], mask=(w < K // PER)[:, None], other=0)
    shifts = (tl.arange(0, PER) * BITS).to(tl.uint32)
    q = (words.to(tl.uint32, bitcast=True)[:, None, :] >> shifts[None, :, None]) & ((1 << BITS) - 1)
    q = tl.reshape(q, [BK, BN]).to(tl.float32)          # value j of word w: column w * PER + j
    if BK >= G:
        gi = k0 // G + tl.arange(0, BK // G)
        at = rows * GROUPS + gi[:, None]
        scale = tl.load(s_ptr + at, mask=(gi < GROUPS)[:, None], other=0.0).to(tl.float32)
        bias = tl.load(b_ptr + at, mask=(gi < GROUPS)[:, None], other=0.0).to(tl.float32)
        scale = tl.reshape(tl.broadcast_to(scale[:, None, :], [BK // G, G, BN]), [BK, BN])
        bias = tl.reshape(tl.broadcast_to(bias[:, None, :], [BK // G, G, BN]), [BK, BN])
    else:       # the tile inside one group (BK divides G, G divides K: never past K)
        scale = tl.load(s_ptr + rows * GROUPS + k0 // G).to(tl.float32)
        bias = tl.load(b_ptr + rows * GROUPS + k0 // G).to(tl.float32)
    sdt = s_ptr.dtype.element_ty
    prod = round_to(scale * q, sdt, RNE).to(tl.float32)
    return round_to(round_to(prod + bias, sdt, RNE).to(tl.float32), DT, RNE)


@triton.jit(do_not_specialize=["P"])
def qgrouped_gate_up_kernel(x_ptr, q_ptr, s_ptr, b_ptr, order_ptr, blocks_ptr, h_ptr, P, E: tl.constexpr,
                            KTOP: tl.constexpr, H: tl.constexpr, I: tl.constexpr, BITS: tl.constexpr,
                            G: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                            ACT: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, RNE: tl.constexpr):
    """grouped_gate_up_kernel on gate_up [E, 2I, H] packed: the gate rows n.. and up rows I + n.. of
    one block's expert, their tiles dequantised as they are loaded."""
    e, row0, row_end = mk.table_block(blocks_ptr)
    if e >= E:
        return
    rm = row0 + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    tok = tl.load(order_ptr + tl.minimum(rm, P - 1)) // KTOP
    xs = x_ptr + tok.to(tl.int64)[:, None] * H + rk[None, :]
    gate = (e.to(tl.int64) * (2 * I) + tl.minimum(rn, I - 1).to(tl.int64))[None, :]
    DT: tl.constexpr = x_ptr.dtype.element_ty
    acc_g = tl.zeros((BM, BN), dtype=tl.float32)
    acc_u = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, H, BK):
        if H % BK == 0:
            a = tl.load(xs)
        else:
            a = tl.load(xs, mask=(k + rk < H)[None, :], other=0.0)
        bg = dequant_tile(q_ptr, s_ptr, b_ptr, gate, k, H, BITS, G, BK, BN, DT, RNE)
        bu = dequant_tile(q_ptr, s_ptr, b_ptr, gate + I, k, H, BITS, G, BK, BN, DT, RNE)
        acc_g = gemm.mma(acc_g, a, bg, UPCAST, IEEE)
        acc_u = gemm.mma(acc_u, a, bu, UPCAST, IEEE)
        xs += BK
    keep = (rm < row_end)[:, None] & (rn < I)[None, :]
    h = mk.glu(acc_g, acc_u, h_ptr.dtype.element_ty, ACT, RNE)
    tl.store(h_ptr + rm.to(tl.int64)[:, None] * I + rn[None, :], h, mask=keep)


@triton.jit(do_not_specialize=["P"])
def qgrouped_down_kernel(h_ptr, q_ptr, s_ptr, b_ptr, order_ptr, blocks_ptr, rw_ptr, y_ptr, P, E: tl.constexpr,
                         H: tl.constexpr, I: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, BM: tl.constexpr,
                         BN: tl.constexpr, BK: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
                         RNE: tl.constexpr):
    """grouped_down_kernel on down [E, H, I] packed."""
    e, row0, row_end = mk.table_block(blocks_ptr)
    if e >= E:
        return
    rm = row0 + tl.arange(0, BM)
    rn = tl.program_id(1) * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    hs = h_ptr + tl.minimum(rm, P - 1).to(tl.int64)[:, None] * I + rk[None, :]
    rows = (e.to(tl.int64) * H + tl.minimum(rn, H - 1).to(tl.int64))[None, :]
    DT: tl.constexpr = h_ptr.dtype.element_ty
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, I, BK):
        if I % BK == 0:
            a = tl.load(hs)
        else:
            a = tl.load(hs, mask=(k + rk < I)[None, :], other=0.0)
        b = dequant_tile(q_ptr, s_ptr, b_ptr, rows, k, I, BITS, G, BK, BN, DT, RNE)
        acc = gemm.mma(acc, a, b, UPCAST, IEEE)
        hs += BK
    inside = rm < row_end
    pair = tl.load(order_ptr + rm, mask=inside, other=0)
    rw = tl.load(rw_ptr + pair, mask=inside, other=0.0).to(tl.float32)
    y = mk.weighted(acc, rw[:, None], y_ptr.dtype.element_ty, RNE)
    tl.store(y_ptr + pair.to(tl.int64)[:, None] * H + rn[None, :], y, mask=inside[:, None] & (rn < H)[None, :])


def supports(x: torch.Tensor, gate_up, down, act: str) -> bool:
    """Both stacks packed [E, N, K] in x's dtype, bits that do not cross words, groups that split K."""
    return (x.dim() == 2 and x.dtype in SUPPORTED and act in mk.ACTS
            and all(isinstance(w, QuantizedWeight) and w.packed.dim() == 3 and w.dtype == x.dtype
                    and 32 % w.bits == 0 and w.shape[2] % w.group_size == 0
                    and w.scales.dtype in SUPPORTED for w in (gate_up, down)))


def run(x, idx, rw, gate_up: QuantizedWeight, down: QuantizedWeight, act: str, p: dict, y: torch.Tensor,
        rows: torch.Tensor | None = None) -> None:
    """mk.run_grouped on the packed stacks: every (token, slot) pair's weighted expert output into
    y [T*k, H]. `rows` (idx's shape): the stack row of each pair's expert where it is not its id."""
    (t, hd), k, i = x.shape, idx.shape[1], down.shape[2]
    e = gate_up.shape[0]
    order, _, blocks = mk.sort_pairs(idx if rows is None else rows, e, p["bm"])
    h = torch.empty((t * k, i), dtype=x.dtype, device=x.device)
    nb = blocks.shape[0]
    rne = rne_flag(x.dtype) or rne_flag(gate_up.scales.dtype) or rne_flag(down.scales.dtype)
    common = dict(E=e, BM=p["bm"], RNE=rne, **dot_flags(x.dtype), num_warps=p["w"], num_stages=p["s"])
    qgrouped_gate_up_kernel[(nb, cdiv(i, p["bn"]))](x, gate_up.packed, gate_up.scales, gate_up.biases, order, blocks,
                                                    h, t * k, KTOP=k, H=hd, I=i, BITS=gate_up.bits,
                                                    G=gate_up.group_size, BN=p["bn"], BK=p["bk"], ACT=mk.ACTS[act],
                                                    **common)
    dn, dk = p.get("dn", p["bn"]), p.get("dk", p["bk"])
    qgrouped_down_kernel[(nb, cdiv(hd, dn))](h, down.packed, down.scales, down.biases, order, blocks, rw, y, t * k,
                                             H=hd, I=i, BITS=down.bits, G=down.group_size, BN=dn, BK=dk, **common)


def experts(ops, x, idx, weights, gate_up: QuantizedWeight, down: QuantizedWeight, act: str) -> torch.Tensor | None:
    """The per-pair outputs [T*k, H] of a prefill chunk (rows past the GEMVs'), for the caller's
    combine; None where the families are off or the stacks do not fit the kernels. The tile form is
    the MoE family's choice for the chunk's 16-bit shape (its grouped default where that is a GEMV)."""
    v = form(ops, x, idx, gate_up, down, act)
    if v is None:
        return None
    y = torch.empty((idx.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
    run(x.contiguous(), idx.contiguous(), weights.reshape(-1).contiguous(), gate_up, down, act, v.p, y)
    return y


def form(ops, x, idx, gate_up, down, act: str, least: int | None = None):
    """The grouped tile form for a chunk's pairs on these stacks: the MoE family's choice for the 16-bit
    shape, else its grouped default; None where the families are off, the chunk has no more rows than
    `least` (default: the GEMVs' few) or the kernels do not take the stacks."""
    from .cuda import GEMV_ROWS
    least = GEMV_ROWS if least is None else least
    if not (ops.on("quant", x) and ops.on("moe", x) and x.shape[0] > least and supports(x, gate_up, down, act)):
        return None
    shape = mk.MoeShape(x.shape[0], gate_up.shape[0], idx.shape[1], x.shape[1], down.shape[2], act)
    v = ops.choose(mk.OP, shape)
    if v.p.get("gemv") or v.p.get("fin") or v.run is not None:      # the default past the GEMVs' rows
        v = mk.OP.default(dataclasses.replace(shape, rows=max(shape.rows, GEMV_ROWS + 1)), ops.dev)
    return None if v.p.get("gemv") or v.run is not None else v
