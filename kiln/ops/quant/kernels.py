"""Decode's projections on quantised weights: y[M, N] = x[M, K] @ dequantize(w)^T for a few rows,
w in MLX's affine format (kiln/ops/quant/reference.py), read packed.

The kernel never builds the 16-bit weight. Per group of G inputs it takes dot(q, x) and sum(x) in
f32, then y += scale * dot(q, x) + bias * sum(x) (the FMA form: the weights' bytes are all it reads
from memory besides x, and the scale and bias are applied once a group, not once a weight).

Forms: "words" (bits 2, 4, 8: whole values in each 32-bit word) loads a [BN, BK * bits / 32] tile of
words and spreads each word's 32 / bits values with shifts; "gather" (every bits value, 3, 5 and 6
too, whose values cross word boundaries) reads, for each value, the word holding its first bit and
the next one where it spills over. The trusted form dequantises as mx.dequantize does and runs
F.linear: the specification.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from ...tune.device import device_info, interpreting
from ...tune.registry import Op, Variant, register, variant
from ...weights.quantized import QuantizedWeight
from .. import cuda_common, nvrtc
from ..common import COMMON, SUPPORTED, cdiv, pdl, pdl_wait, rne_flag, round_to
from ..gemm import helpers
from ..gemm.activation import ACTS, act_f32, act_mul
from ..gemm.activation import __file__ as ACTS_FILE
from ..gemm.gemm import __file__ as gemm_file
from ..gemm.gemm import arrival_counters, gemv_splitk_finish, norm_args, norm_rstd
from ..gemm.helpers import last_arrival
from ..gemm.reference import GemmReference
from ..moe import kernels as moe_kernels
from ..moe.kernels import weighted
from ..norm import kernels as norm_kernels
from ..norm.kernels import style_scaled
from ..norm.reference import NormReference
from . import dp4a
from . import mma as qmma
from .mma import NC as MMA_GROUPS
from .mma import chunk_sums, qgemv_mma_kernel, unpack_asm, unpack_plain, weight_tile
from .reference import dequantize, quantize

# The routed experts' pair GEMV also takes Gemma 4's GELU (the MoE kernels' formula): 2 in pair_act.
PAIR_ACTS = {**ACTS, "gelu_pytorch_tanh": 2}


@triton.jit
def as_f32(v):
    """Small unsigned ints (under 2^23) as f32 without an int-to-float conversion (a quarter-rate
    instruction): the value in the mantissa of 2^23, then 2^23 subtracted (exact)."""
    return (v | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def words_tile(q_ptr, rows, k0, WORDS: tl.constexpr, BITS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The [BN, BK] values from column k0 of `rows`, for bits dividing 32: a word holds 32 / BITS
    values, the first in its lowest bits."""
    PER: tl.constexpr = 32 // BITS
    wi = k0 // PER + tl.arange(0, BK // PER)
    words = tl.load(q_ptr + rows[:, None] * WORDS + wi[None, :]).to(tl.uint32, bitcast=True)
    shifts = (tl.arange(0, PER) * BITS).to(tl.uint32)
    vals = (words[:, :, None] >> shifts[None, None, :]) & ((1 << BITS) - 1)
    return tl.reshape(vals, [BN, BK])


@triton.jit
def gather_tile(q_ptr, rows, k0, WORDS: tl.constexpr, BITS: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The [BN, BK] values from column k0 of `rows`, for any bits: value j's bits start at bit
    j * BITS of the row's stream and may continue in the next word."""
    first = (k0 + tl.arange(0, BK)) * BITS
    wi, shift = first // 32, (first % 32).to(tl.uint32)
    base = q_ptr + rows[:, None] * WORDS + wi[None, :]
    lo = tl.load(base).to(tl.uint32, bitcast=True)
    spills = (shift + BITS > 32)[None, :]
    hi = tl.load(base + 1, mask=spills, other=0).to(tl.uint32, bitcast=True)
    # where nothing spills hi is 0, so its shift (by up to 32) contributes nothing either way
    vals = (lo >> shift[None, :]) | tl.where(spills, hi << (32 - shift[None, :]), 0)
    return vals & ((1 << BITS) - 1)


@triton.jit
def grouped_layout(BITS: tl.constexpr, G: tl.constexpr, BK: tl.constexpr):
    """The grouped forms' indices for one BK step from column 0: the groups g [NG], each value's word
    [NG, WG] and column [NG, WG, PER] (a word's PER values an axis of their own), and the shifts that
    spread a word [1, 1, 1, PER]."""
    PER: tl.constexpr = 32 // BITS
    NG: tl.constexpr = BK // G
    WG: tl.constexpr = G // PER
    g = tl.arange(0, NG)
    wg = tl.arange(0, WG)
    p = tl.arange(0, PER)
    word = g[:, None] * WG + wg[None, :]
    col = g[:, None, None] * G + wg[None, :, None] * PER + p[None, None, :]
    return g, word, col, (p * BITS).to(tl.uint32)[None, None, None, :]


@triton.jit
def scaled_group_sums(s_ptr, b_ptr, rows, k0, GROUPS: tl.constexpr, G: tl.constexpr, g, dots, xsum):
    """sum over a step's groups g of scale * dot(q, x) + bias * sum(x), per row (the FMA form)."""
    gi = rows[:, None] * GROUPS + k0 // G + g[None, :]
    scale = tl.load(s_ptr + gi).to(tl.float32)
    bias = tl.load(b_ptr + gi).to(tl.float32)
    return tl.sum(scale * dots + bias * xsum[None, :], axis=1)


@triton.jit
def grouped_step(x_ptr, q_ptr, s_ptr, b_ptr, rows, m, k0, K: tl.constexpr, WORDS: tl.constexpr,
                 GROUPS: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One BK step for bits dividing 32, with the groups an axis of their own: words [BN, NG, WG]
    spread to values [BN, NG, WG, PER] by shifts and multiplied by x [NG, WG, PER] loaded in that
    shape (no reshape: each group's dot is a reduction over its own two axes)."""
    g, word, col, shifts = grouped_layout(BITS, G, BK)
    words = tl.load(q_ptr + rows[:, None, None] * WORDS + k0 // (32 // BITS) + word[None, :, :])
    q = (words.to(tl.uint32, bitcast=True)[:, :, :, None] >> shifts) & ((1 << BITS) - 1)
    x = tl.load(x_ptr + m * K + k0 + col).to(tl.float32)
    dots = tl.sum(tl.sum(as_f32(q) * x[None, :, :, :], axis=3), axis=2)                      # [BN, NG]
    xsum = tl.sum(tl.sum(x, axis=2), axis=1)                                                 # [NG]
    return scaled_group_sums(s_ptr, b_ptr, rows, k0, GROUPS, G, g, dots, xsum)


@triton.jit
def dequant_row(x_ptr, q_ptr, s_ptr, b_ptr, rows, m, K: tl.constexpr, WORDS: tl.constexpr, GROUPS: tl.constexpr,
                BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """One row's outputs, bits dividing 32: in grouped_step's layout, (scale * q + bias) * x summed
    elementwise over the K steps, reduced once at the end (no reductions inside the loop)."""
    PER: tl.constexpr = 32 // BITS
    g, word, xi, shifts = grouped_layout(BITS, G, BK)
    acc = tl.zeros((BN, BK // G, G // PER, PER), dtype=tl.float32)
    for k0 in range(0, K, BK):
        words = tl.load(q_ptr + rows[:, None, None] * WORDS + k0 // PER + word[None, :, :]).to(tl.uint32, bitcast=True)
        q = as_f32((words[:, :, :, None] >> shifts) & ((1 << BITS) - 1))
        x = tl.load(x_ptr + m * K + k0 + xi).to(tl.float32)
        gi = rows[:, None] * GROUPS + k0 // G + g[None, :]
        scale = tl.load(s_ptr + gi).to(tl.float32)[:, :, None, None]
        bias = tl.load(b_ptr + gi).to(tl.float32)[:, :, None, None]
        acc += (q * scale + bias) * x[None, :, :, :]
    return tl.sum(tl.sum(tl.sum(acc, axis=3), axis=2), axis=1)


@triton.jit
def flat_step(x_ptr, q_ptr, s_ptr, b_ptr, rows, m, k0, K: tl.constexpr, WORDS: tl.constexpr,
              GROUPS: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
              GATHER: tl.constexpr):
    """One BK step on a flat [BN, BK] tile of values (words or gathered), the groups split off by a
    reshape; the same sum as grouped_step."""
    NG: tl.constexpr = BK // G
    x = tl.load(x_ptr + m * K + k0 + tl.arange(0, BK)).to(tl.float32)
    if GATHER:
        q = gather_tile(q_ptr, rows, k0, WORDS, BITS, BN, BK)
    else:
        q = words_tile(q_ptr, rows, k0, WORDS, BITS, BN, BK)
    dots = tl.sum(tl.reshape(as_f32(q) * x[None, :], [BN, NG, G]), axis=2)             # [BN, NG]
    xsum = tl.sum(tl.reshape(x, [NG, G]), axis=1)                                      # [NG]
    return scaled_group_sums(s_ptr, b_ptr, rows, k0, GROUPS, G, tl.arange(0, NG), dots, xsum)


@triton.jit
def step_sums(x_ptr, q_ptr, s_ptr, b_ptr, rows, m, K: tl.constexpr, WORDS: tl.constexpr, GROUPS: tl.constexpr,
              BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATHER: tl.constexpr,
              GROUPED: tl.constexpr):
    """One row's outputs in the FMA form, each step's groups reduced as it comes."""
    acc = tl.zeros((BN,), dtype=tl.float32)
    for k0 in range(0, K, BK):
        if GROUPED:
            acc += grouped_step(x_ptr, q_ptr, s_ptr, b_ptr, rows, m, k0, K, WORDS, GROUPS, BITS, G, BN, BK)
        else:
            acc += flat_step(x_ptr, q_ptr, s_ptr, b_ptr, rows, m, k0, K, WORDS, GROUPS, BITS, G, BN, BK, GATHER)
    return acc


@triton.jit(do_not_specialize=["M"])
def qgemv_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, M, N: tl.constexpr, K: tl.constexpr, BITS: tl.constexpr,
                 G: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GATHER: tl.constexpr, RNE: tl.constexpr,
                 GROUPED: tl.constexpr = False, ACC: tl.constexpr = False, PDL: tl.constexpr = False):
    """BN output features a program, K in BK steps (whole groups), for each of the M rows in turn."""
    WORDS: tl.constexpr = K * BITS // 32      # packed words per weight row
    GROUPS: tl.constexpr = K // G
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rows = tl.minimum(rn, N - 1).to(tl.int64)     # rows past N read row N-1, never stored
    pdl_wait(PDL)
    for m32 in range(0, M):
        m = tl.cast(m32, tl.int64)
        if ACC:
            acc = dequant_row(x_ptr, q_ptr, s_ptr, b_ptr, rows, m, K, WORDS, GROUPS, BITS, G, BN, BK)
        else:
            acc = step_sums(x_ptr, q_ptr, s_ptr, b_ptr, rows, m, K, WORDS, GROUPS, BITS, G, BN, BK, GATHER, GROUPED)
        tl.store(y_ptr + m * N + rn, round_to(acc, y_ptr.dtype.element_ty, RNE), mask=rn < N)


@triton.jit
def top_bits(words, p: tl.constexpr, BITS: tl.constexpr):
    """Value p of each word as the f32 1 + q / 2^BITS: q moved into the top mantissa bits under 1.0's
    exponent, one shift and one AND-OR (no conversion, no subtraction: the 1 is taken out once a word
    through sum(x))."""
    TOP: tl.constexpr = 23 - BITS                    # q's lowest bit in the f32
    SH: tl.constexpr = TOP - p * BITS
    MASK: tl.constexpr = ((1 << BITS) - 1) << TOP
    if SH >= 0:
        v = (words << SH) & MASK
    else:
        v = (words >> (-SH)) & MASK
    return (v | 0x3F800000).to(tl.float32, bitcast=True)


@triton.jit
def pair_act(g, ACT: tl.constexpr):
    """act_f32, or (2) GELU's tanh approximation as 0.5 g (1 + tanh(u)) = g sigmoid(2u), as the MoE
    kernels write it (no libdevice: the interpreter runs the same formula)."""
    if ACT == 2:
        u = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        return g / (1.0 + tl.exp(-2.0 * u))
    return act_f32(g, ACT)


@triton.jit
def x_values(x_ptr, m, cols, K: tl.constexpr, ACT: tl.constexpr, NORM: tl.constexpr, STYLE: tl.constexpr,
             r_ptr, nw_ptr, rstd, RNE: tl.constexpr):
    """Row m's x at columns `cols` (any shape, inside the row) in f32, through the prologue: ACT >= 0:
    rows are [g | u] (2K wide) and x = act(g) * u; NORM 1: rmsnorm(x), 2: rmsnorm(x + r), with the
    row's rstd; rounded where gemv_kernel's x_slice rounds (act_mul's and the rmsnorm kernel's places)."""
    dtype = x_ptr.dtype.element_ty
    if ACT >= 0:
        g = tl.load(x_ptr + m * (2 * K) + cols).to(tl.float32)
        u = tl.load(x_ptr + m * (2 * K) + K + cols).to(tl.float32)
        a = round_to(pair_act(g, ACT), dtype, RNE).to(tl.float32)
        xv = round_to(a * u, dtype, RNE).to(tl.float32)
    else:
        xv = tl.load(x_ptr + m * K + cols).to(tl.float32)
        if NORM == 2:
            xv = round_to(xv + tl.load(r_ptr + m * K + cols).to(tl.float32), dtype, RNE).to(tl.float32)
        if NORM > 0:
            xv = style_scaled(xv * rstd, tl.load(nw_ptr + cols).to(tl.float32), STYLE, dtype, RNE).to(tl.float32)
    return xv


@triton.jit
def fma_words(words, scale, bias, x_ptr, m, cols, K: tl.constexpr, BITS: tl.constexpr, X3: tl.constexpr,
              ACT: tl.constexpr, NORM: tl.constexpr, STYLE: tl.constexpr, r_ptr, nw_ptr, rstd, RNE: tl.constexpr):
    """A step's sum a word: words [BN, NG, WG] (WG words a group), scale and bias [BN, NG] as loaded,
    cols the column of each word's first value: [NG, WG], or with X3 [BN, NG, WG] (x read in the
    words' own layout: no shared-memory exchange of x, at the cost of a sum(x) a row). x comes through
    x_values' prologue. Per word, dot = sum_p (1 + q_p / 2^BITS) x_p (each word an element of the tile:
    no reduction across threads) and xs = sum_p x_p; then S * dot + (bias - S) * xs with
    S = scale * 2^BITS, which is scale * dot(q, x) + bias * xs."""
    PER: tl.constexpr = 32 // BITS
    dot = tl.zeros(words.shape, dtype=tl.float32)
    xs = tl.zeros(cols.shape, dtype=tl.float32)
    for p in tl.static_range(PER):
        xp = x_values(x_ptr, m, cols + p, K, ACT, NORM, STYLE, r_ptr, nw_ptr, rstd, RNE)
        xs += xp
        if X3:
            dot += top_bits(words, p, BITS) * xp
        else:
            dot += top_bits(words, p, BITS) * xp[None, :, :]
    s = scale.to(tl.float32) * (1 << BITS)
    if not X3:
        xs = xs[None, :, :]
    return s[:, :, None] * dot + (bias.to(tl.float32) - s)[:, :, None] * xs


@triton.jit(do_not_specialize=["M"])
def qgemv_fma_kernel(x_ptr, q_ptr, s_ptr, b_ptr, y_ptr, ws_ptr, count_ptr, M, N: tl.constexpr, K: tl.constexpr,
                     BITS: tl.constexpr, G: tl.constexpr, BN: tl.constexpr, BW: tl.constexpr,
                     SPLIT_K: tl.constexpr, RNE: tl.constexpr, PF: tl.constexpr = False, X3: tl.constexpr = False,
                     ACT: tl.constexpr = -1, nw_ptr=None, r_ptr=None, sum_ptr=None, eps=1e-6,
                     NORM: tl.constexpr = 0, STYLE: tl.constexpr = 0, KP: tl.constexpr = 16,
                     idx_ptr=None, rw_ptr=None, XDIV: tl.constexpr = 0, PDL: tl.constexpr = False,
                     hq_ptr=None, hs_ptr=None, hb_ptr=None, HOST: tl.constexpr = False):
    """The FMA form a word at a time (bits dividing 32): program (column block, split) streams
    [BN, NG, WG] tiles of words (BW = NG whole groups of WG words a step) and their [BN, NG] scales
    and biases, adds fma_words elementwise over the steps and reduces once a row. PF: the next step's
    words, scales and biases are loaded before this step's arithmetic (the first before the PDL wait:
    weights are never written; with XDIV after it: the expert id is the router's output); the last
    step fetches the first again, what the next row reads.
    X3: x read in the words' layout (fma_words). The prologue (x_values): ACT, or NORM with every
    program computing the row's rstd from L2 and program (0, 0) storing s = x + r to sum_ptr, as
    gemv_kernel does. Split-K as gemv_kernel's serial form. XDIV > 0: routed experts, program axis 2
    the (token, slot) pair: the weights are expert idx[pair] of [E, N, K] stacks, x row pair // XDIV,
    y row pair, M = 1, no split; with rw_ptr the output is weighted by the pair's routing weight as
    the MoE kernels weight it. HOST (streamed experts read in place): a negative idx[pair] names expert
    -1 - idx of the [E, N, K] stack at hq/hs/hb (mapped host memory) instead of a slot of q/s/b."""
    PER: tl.constexpr = 32 // BITS
    WORDS: tl.constexpr = K // PER
    GROUPS: tl.constexpr = K // G
    WG: tl.constexpr = G // PER
    NG: tl.constexpr = BW // WG
    SPAN: tl.constexpr = WORDS // SPLIT_K              # words a split (fits() makes it whole BW steps)
    pid_n, split = tl.program_id(0), tl.program_id(1)
    if XDIV > 0:
        pdl_wait(PDL)      # idx is the router's output, written by the kernel just before
        pair = tl.program_id(2).to(tl.int64)
        e = tl.load(idx_ptr + pair).to(tl.int64)
        if HOST:
            if e < 0:
                e = -1 - e
                q_ptr, s_ptr, b_ptr = hq_ptr, hs_ptr, hb_ptr
        q_ptr += e * (N * WORDS)
        s_ptr += e * (N * GROUPS)
        b_ptr += e * (N * GROUPS)
        x_ptr += (pair // XDIV) * (2 * K if ACT >= 0 else K)
        y_ptr += pair * N
    rn = pid_n * BN + tl.arange(0, BN)
    rows = tl.minimum(rn, N - 1).to(tl.int64)        # rows past N read row N-1, never stored
    g = tl.arange(0, NG)
    wcol = split * SPAN + g[:, None] * WG + tl.arange(0, WG)[None, :]          # [NG, WG]
    qrow = q_ptr + rows[:, None, None] * WORDS + wcol[None, :, :]
    grow = rows[:, None] * GROUPS + (split * SPAN) // WG + g[None, :]            # [BN, NG]
    words = tl.load(qrow)
    scale = tl.load(s_ptr + grow)
    bias = tl.load(b_ptr + grow)
    if X3:
        cols = (rows * 0)[:, None, None] + wcol[None, :, :] * PER
    else:
        cols = wcol * PER
    if XDIV == 0:
        pdl_wait(PDL)
    for m32 in range(0, M):
        m = tl.cast(m32, tl.int64)
        rstd = 0.0
        if NORM > 0:
            rstd = tl.sum(norm_rstd(x_ptr, r_ptr, sum_ptr, m, eps, K, KP, NORM, (pid_n == 0) & (split == 0), RNE),
                          axis=0)
        acc = tl.zeros((BN, NG, WG), dtype=tl.float32)
        for w0 in range(0, SPAN, BW):
            if PF:
                nxt = (w0 + BW) % SPAN
                words_n = tl.load(qrow + nxt)
                scale_n = tl.load(s_ptr + grow + nxt // WG)
                bias_n = tl.load(b_ptr + grow + nxt // WG)
                acc += fma_words(words.to(tl.uint32, bitcast=True), scale, bias, x_ptr, m, cols + w0 * PER, K, BITS,
                                 X3, ACT, NORM, STYLE, r_ptr, nw_ptr, rstd, RNE)
                words, scale, bias = words_n, scale_n, bias_n
            else:
                words = tl.load(qrow + w0)
                scale = tl.load(s_ptr + grow + w0 // WG)
                bias = tl.load(b_ptr + grow + w0 // WG)
                acc += fma_words(words.to(tl.uint32, bitcast=True), scale, bias, x_ptr, m, cols + w0 * PER, K, BITS,
                                 X3, ACT, NORM, STYLE, r_ptr, nw_ptr, rstd, RNE)
        total = tl.sum(tl.sum(acc, axis=2), axis=1)
        if XDIV > 0 and rw_ptr is not None:
            tl.store(y_ptr + rn, weighted(total, tl.load(rw_ptr + pair).to(tl.float32), y_ptr.dtype.element_ty, RNE),
                     mask=rn < N)
        elif SPLIT_K == 1:
            tl.store(y_ptr + m * N + rn, round_to(total, y_ptr.dtype.element_ty, RNE), mask=rn < N)
        else:
            tl.store(ws_ptr + (split * M + m) * N + rn, total, mask=rn < N)
    if SPLIT_K > 1:
        gemv_splitk_finish(ws_ptr, y_ptr, count_ptr, pid_n, rn, M, N, BN, SPLIT_K, RNE)


# -- launching -------------------------------------------------------------------------------------

def prologue_reference(x: torch.Tensor, act: str | None = None, norm: dict | None = None) -> torch.Tensor:
    """The GEMV's input as the reference computes it: act(g) * u of [g | u] rows, rmsnorm(x) or
    rmsnorm(x + r) (norm {w, eps, style[, r, s]}; s = x + r written), or x itself."""
    if act is not None:
        g, u = x.split(x.shape[-1] // 2, dim=-1)
        return GemmReference().act_mul(g, u, act)
    if norm is None:
        return x
    src = x
    if norm.get("r") is not None:
        src = x + norm["r"]
        norm["s"].copy_(src)
    return NormReference().rmsnorm(src, norm["w"], norm["eps"], norm["style"])


def launch(kernel, grid: tuple, warm: bool, *args, **kwargs):
    """kernel[grid](*args, **kwargs), or with `warm` only its compile (kernel.warmup): the tuner's
    compile and the launch build one argument list, so the kernel the workers compiled is the one
    the launch finds (a pointer of another dtype, or an integer specialised apart, would compile
    again, serially, in the launching process)."""
    if warm:
        return kernel.warmup(*args, grid=grid, **kwargs)
    kernel[grid](*args, **kwargs)
    return None


def epilogue_reference(y: torch.Tensor, act_out: str | None) -> torch.Tensor:
    """act(gate) * up of a [gate | up] GEMV output as the reference's act_mul computes it, or y itself."""
    if act_out is None:
        return y
    g, u = y.split(y.shape[-1] // 2, dim=-1)
    return GemmReference().act_mul(g, u, act_out)


def norm_after_reference(y: torch.Tensor, norm_out: dict) -> torch.Tensor:
    """rmsnorm(y + r) as the reference's add_rmsnorm computes it, s = y + r written (norm_out {w, r, s,
    eps, style})."""
    s, h = NormReference().add_rmsnorm(y, norm_out["r"], norm_out["w"], norm_out["eps"], norm_out["style"])
    norm_out["s"].copy_(s)
    return h


def act_after(h: torch.Tensor, act_out: str, y: torch.Tensor) -> torch.Tensor:
    """The act_mul kernel on a [gate | up] GEMV output h: y = act(gate) * up (the epilogue's composition)."""
    g, u = h.split(h.shape[-1] // 2, dim=-1)
    return act_mul(g, u, act_out, y=y)


def norm_after(y: torch.Tensor, norm_out: dict, out: torch.Tensor, nv: Variant | None = None) -> torch.Tensor:
    """The rmsnorm kernel with its add on a GEMV's output y: out = rmsnorm(y + r), s = y + r written."""
    nv = nv or norm_kernels.OP.default(norm_kernels.NormShape(y.shape[0], y.shape[1], norm_out["style"]),
                                       device_info(y.device))
    return norm_kernels.rmsnorm(y, norm_out["w"], norm_out["eps"], norm_out["style"], nv, y=out, add=norm_out["r"],
                                s=norm_out["s"])


def qgemv(x: torch.Tensor, w: QuantizedWeight, v: Variant, y: torch.Tensor | None = None, act: str | None = None,
          norm: dict | None = None, warm: bool = False, act_out: str | None = None, norm_out: dict | None = None):
    """y = pro(x) @ dequantize(w)^T with variant `v`; x [M, K] contiguous ([M, 2K] = [g | u] with act),
    pro as prologue_reference says (the fma forms compute it as they load x; the others take none).
    act_out: w is [gate; up] and y [M, N / 2] = act(gate) * up as epilogue_reference says (the dp4a
    forms compute it as they store; the others through act_mul). norm_out {w, r, s, eps, style}: y is
    rmsnorm(x W^T + r) and s = x W^T + r, as norm_after_reference says (the dp4a forms in their last
    block; the others through the rmsnorm kernel). With `warm`, compiles the launch's kernel instead
    and returns it."""
    p = v.p
    m, k, n = x.shape[0], w.shape[-1], w.shape[0]
    if y is None:
        y = torch.empty((m, n // 2 if act_out else n), dtype=x.dtype, device=x.device)
    if p.get("trusted"):
        lin = F.linear(prologue_reference(x, act, norm), dequantize(w))
        y.copy_(epilogue_reference(lin, act_out) if norm_out is None else norm_after_reference(lin, norm_out))
        return y
    if norm_out is not None and not (p.get("dp4a") and dp4a.takes(x, w.packed, norm_out["w"], norm_out["r"],
                                                                    norm_out["s"]) and dp4a.weights_take(x, w)):
        assert not warm and act is None and norm is None, f"{v.name} has no norm epilogue"
        return norm_after(qgemv(x, w, v), norm_out, y)     # the plain form (a dp4a form off its inputs: fma)
    if act_out is not None and not (p.get("dp4a") and dp4a.takes(x, w.packed) and dp4a.weights_take(x, w)):
        assert not warm, f"{v.name} has no act epilogue"
        # the plain form (a dp4a form off its inputs: the fma form), then act_mul
        return act_after(qgemv(x, w, v, act=act, norm=norm), act_out, y)
    if p.get("dp4a"):
        extra = [] if norm is None else [t for t in (norm["w"], norm.get("r"), norm.get("s")) if t is not None]
        if not (dp4a.takes(x, w.packed, *extra) and dp4a.weights_take(x, w)):   # f32 x or scales, or a view off
            # 16-byte alignment: the FMA form instead
            v2 = OP.default(QGemvShape(m, n, k, w.bits, w.group_size), device_info(x.device))
            pro_ok = v2.p.get("fma") or (act is None and norm is None)     # the fma forms take the prologues
            return qgemv(x, w, v2 if pro_ok else TRUSTED, y, act=act, norm=norm)
        dnorm = None if norm is None else {**norm, "style": norm_kernels.STYLES[norm["style"]]}
        counts = arrival_counters(x.device, cdiv(n, p["bn"])) if p["sk"] > 1 else None
        a = act_out if act_out is not None else act
        dout = None
        if norm_out is not None:
            dout = {**norm_out, "style": norm_kernels.STYLES[norm_out["style"]]}
            counts = arrival_counters(x.device, cdiv(n, p["bn"]) + 1)      # the last one: the grid's arrivals
        built = dp4a.run(x, w.packed, w.scales, w.biases, w.bits, w.group_size, y, p["bn"], p["w"], p["r"], p["sk"],
                         counts, warm=warm, act=-1 if a is None else ACTS[a], norm=dnorm, epi=act_out is not None,
                         norm_out=dout)
        return built if warm else y
    if p.get("mma"):
        assert act is None and norm is None, f"{v.name} takes no prologue"
        assert w.bits in MMA_BITS.get(x.dtype, ()), f"{v.name}: no {w.bits}-bit values in {x.dtype} products"
        sk, blocks = p["sk"], cdiv(n, p["bn"])
        ws = y if sk == 1 else torch.empty((sk, m, n), dtype=torch.float32, device=x.device)
        counts = arrival_counters(x.device, blocks) if sk > 1 else y
        built = launch(qgemv_mma_kernel, (blocks, sk), warm, x, w.packed, w.scales, w.biases, y, ws, counts, m, N=n,
                       K=k, BITS=w.bits, G=w.group_size, BN=p["bn"], SUB=p["sub"], SPLIT_K=sk, RNE=rne_flag(x.dtype),
                       ASM=not interpreting(), num_warps=p["w"], num_stages=p["st"], **pdl(x))
        return built if warm else y
    if p.get("fma"):
        sk, blocks = p["sk"], cdiv(n, p["bn"])
        ws = y if sk == 1 else torch.empty((sk, m, n), dtype=torch.float32, device=x.device)
        counts = arrival_counters(x.device, blocks) if sk > 1 else y
        pro = {k2 if k2 != "s_ptr" else "sum_ptr": a for k2, a in norm_args(norm, k).items()}
        built = launch(qgemv_fma_kernel, (blocks, sk), warm, x, w.packed, w.scales, w.biases, y, ws, counts, m, N=n,
                       K=k, BITS=w.bits, G=w.group_size, BN=p["bn"], BW=p["bw"], SPLIT_K=sk, RNE=rne_flag(x.dtype),
                       PF=p.get("pf", False), X3=p.get("x3", False), ACT=-1 if act is None else ACTS[act], **pro,
                       num_warps=p["w"], **pdl(x))
        return built if warm else y
    assert act is None and norm is None, f"{v.name} takes no prologue"
    built = launch(qgemv_kernel, (triton.cdiv(n, p["bn"]),), warm, x, w.packed, w.scales, w.biases, y, m, N=n, K=k,
                   BITS=w.bits, G=w.group_size, BN=p["bn"], BK=p["bk"], GATHER=p["gather"],
                   GROUPED=p.get("grouped", False), ACC=p.get("acc", False), RNE=rne_flag(x.dtype),
                   num_warps=p["w"], **pdl(x))
    return built if warm else y


def qgemv_pairs(x: torch.Tensor, w: QuantizedWeight, idx: torch.Tensor, v: Variant, y: torch.Tensor,
                xdiv: int, act: str | None = None, rw: torch.Tensor | None = None,
                host: QuantizedWeight | None = None) -> torch.Tensor:
    """Routed experts' projections, one launch: y[pair] = pro(x[pair // xdiv]) @ dequantize(w[idx[pair]])^T
    (weighted by rw[pair] when given) for every pair of idx (flattened); w an [E, N, K] stack, v an
    unsplit fma form, or an unsplit dp4a form (dp4a.run_pairs). `host`: a stack like w (mapped host
    memory, or device scratch), read for a pair whose idx is negative (expert -1 - idx)."""
    p, n, k = v.p, w.shape[-2], w.shape[-1]
    pairs = idx.numel()
    if p.get("dp4a"):     # act(g) * u as act_mul's: dp4a.pairs_take says which
        assert p["sk"] == 1, f"{v.name}: routed experts take an unsplit form"
        return dp4a.run_pairs(x, w, idx, y, p["bn"], p["w"], p["r"], xdiv, -1 if act is None else ACTS[act], rw,
                              host=host)
    assert p.get("fma") and p["sk"] == 1, f"{v.name}: routed experts take an unsplit fma form"
    if pairs:
        extra = {"rw_ptr": rw} if rw is not None else {}
        if host is not None:
            extra.update(hq_ptr=host.packed, hs_ptr=host.scales, hb_ptr=host.biases, HOST=True)
        qgemv_fma_kernel[(cdiv(n, p["bn"]), 1, pairs)](x, w.packed, w.scales, w.biases, y, y, y, 1, N=n, K=k,
                                                       BITS=w.bits, G=w.group_size, BN=p["bn"], BW=p["bw"],
                                                       SPLIT_K=1, RNE=rne_flag(x.dtype), PF=p.get("pf", False),
                                                       X3=p.get("x3", False),
                                                       ACT=-1 if act is None else PAIR_ACTS[act],
                                                       idx_ptr=idx, XDIV=xdiv, num_warps=p["w"], **extra, **pdl(x))
    return y


# -- the op: variants, inputs, outputs --------------------------------------------------------------

@dataclass(frozen=True)
class QGemvShape:
    rows: int     # M, tokens (runtime; a few at most: the slab is re-read per row)
    n: int        # output features
    k: int        # input features
    bits: int
    group: int
    act: str | None = None      # prologue: x rows are [g | u] and the input is act(g) * u
    style: str | None = None    # prologue: the input is rmsnorm(x) in this style ...
    add: bool = False           # ... of x + r, s = x + r written
    out_act: str | None = None  # epilogue: the weight is [gate; up] (n = 2I rows), the output act(gate) * up
    out_norm: str | None = None  # epilogue: the output rmsnorm(y + r) in this style, s = y + r written

    @property
    def key(self) -> tuple:
        return (self.n, self.k, self.bits, self.group) + self.prologue + self.epilogue

    @property
    def epilogue(self) -> tuple:
        return ((("out_act", self.out_act),) if self.out_act else ()) + (
            (("out_norm", self.out_norm),) if self.out_norm else ())

    @property
    def prologue(self) -> tuple:
        return ((("act", self.act),) if self.act else ()) + ((("norm", self.style, self.add),) if self.style else ())

    @property
    def plain(self) -> "QGemvShape":
        return QGemvShape(self.rows, self.n, self.k, self.bits, self.group)


def unfused(inputs: dict, outputs: dict, plan, trusted: bool = False) -> None:
    """The prologue's own kernel (act_mul, or the rmsnorm kernel as the plan chose), then the plain
    quantised GEMV as the plan chose; or that GEMV, then the epilogue's act_mul."""
    x, w, act = inputs["x"], inputs["w"], inputs.get("act")
    shape = QGemvShape(x.shape[0], w.shape[0], w.shape[-1], w.bits, w.group_size)
    dev = plan.dev if plan is not None else device_info(x.device)
    if inputs.get("out_act") is not None:      # the plain GEMV (never its epilogue form), then act_mul
        act_after(qgemv(x, w, plan.choose(OP, shape) if plan is not None else OP.default(shape, dev)),
                  inputs["out_act"], outputs["y"])
        return
    if inputs.get("out_norm") is not None:
        ns = norm_kernels.NormShape(x.shape[0], w.shape[0], inputs["out_norm"])
        y = qgemv(x, w, plan.choose(OP, shape) if plan is not None else OP.default(shape, dev))
        norm_after(y, norm_out_of(inputs, outputs), outputs["y"],
                   plan.choose(norm_kernels.OP, ns) if plan is not None else None)
        return
    if act is not None:
        g, u = x.split(w.shape[-1], dim=-1)
        h = act_mul(g, u, act)
    else:
        ns = norm_kernels.NormShape(x.shape[0], x.shape[1], inputs["style"])
        nv = plan.choose(norm_kernels.OP, ns) if plan is not None else norm_kernels.OP.default(ns, dev)
        h = norm_kernels.rmsnorm(x, inputs["norm_w"], inputs["eps"], inputs["style"], nv, add=inputs.get("r"),
                                 s=outputs.get("s"))
    qgemv(h, w, plan.choose(OP, shape) if plan is not None else OP.default(shape, dev), outputs["y"])


UNFUSED = variant("unfused", run=unfused)


def norm_out_of(inputs: dict, outputs: dict) -> dict | None:
    """qgemv's norm_out from an out_norm shape's inputs and outputs (None for other shapes)."""
    if inputs.get("out_norm") is None:
        return None
    return {"w": inputs["out_w"], "r": inputs["out_r"], "s": outputs["s"], "eps": inputs["out_eps"],
            "style": inputs["out_norm"]}


def qgemv_variant(bn: int, bk: int, w: int, gather: bool, grouped: bool = False, acc: bool = False) -> Variant:
    """words (flat tile, bits dividing 32), grouped (the groups an axis: no reshape; bits dividing 32),
    acc (grouped's layout, dequantised and accumulated elementwise, reduced once a row) or gather
    (every bits value)."""
    form = "gather" if gather else "acc" if acc else "grouped" if grouped else "words"
    return variant(f"{form}_bn{bn}_bk{bk}_w{w}", bn=bn, bk=bk, w=w, gather=gather, grouped=grouped, acc=acc)


def fma_variant(bn: int, bw: int, w: int, sk: int, pf: bool = False, x3: bool = False) -> Variant:
    """qgemv_fma_kernel: BN output features a program, BW words a step, SK splits of K; pf: the next
    step's weights loaded before this step's arithmetic; x3: x read in the words' layout."""
    name = f"fma_bn{bn}_bw{bw}_w{w}_sk{sk}" + ("_pf" if pf else "") + ("_x3" if x3 else "")
    return variant(name, fma=True, bn=bn, bw=bw, w=w, sk=sk, pf=pf, x3=x3)


def mma_variant(bn: int, sub: int, w: int, sk: int, st: int = 3) -> Variant:
    """qgemv_mma_kernel: BN output features a program, SUB groups a tensor-core product, SK splits,
    ST stages of Triton's pipeline (each a chunk of 16 groups of BN rows in shared memory)."""
    return variant(f"mma_bn{bn}_s{sub}_w{w}_sk{sk}_st{st}", mma=True, bn=bn, sub=sub, w=w, sk=sk, st=st)


MMA_BITS = {torch.bfloat16: (2, 4), torch.float16: (2, 4, 8)}     # q fits under 1.0's exponent


def dp4a_variant(bn: int, w: int, r: int, sk: int) -> Variant:
    """dp4a.py's CUDA C form: BN rows a block of W warps, R rows a pass, SK splits of K."""
    return variant(f"dp4a_bn{bn}_w{w}_r{r}_sk{sk}", dp4a=True, bn=bn, w=w, r=r, sk=sk)


def dp4a_forms(s: QGemvShape, forms: list[tuple]) -> list[Variant]:
    """dp4a_variant of each form that fits (bits 4 and 8; no prologue, act(g) * u's or a norm's; or the
    act epilogue; or the norm epilogue where a thread holds at most NOUT_CHUNKS of the output row), its warps
    cut to the split's slabs."""
    out = []
    for bn, w, r, sk in forms:
        chunks = s.k * s.bits // 128
        if (s.bits not in dp4a.BITS or any(a and a not in ACTS for a in (s.act, s.out_act)) or chunks % sk
                or (s.out_norm and s.n % 8)):       # the norm epilogue's 16-byte loads of the output row
            continue
        w = max(1, min(w, cdiv(chunks // sk, 32)))
        if s.out_norm and cdiv(s.n // 8, w * 32) > dp4a.NOUT_CHUNKS:     # the tail's row in registers
            continue
        if dp4a.shape_fits(s.n, s.k, s.bits, s.group, bn, w, r, sk):
            out.append(dp4a_variant(bn, w, r, sk))
    return list(dict.fromkeys(out))


def cuda_c_forms(s: QGemvShape, forms: list[tuple], dev) -> list[Variant]:
    """dp4a_forms where CUDA C kernels compile and launch (a GPU, NVRTC, not KILN_CUDA_C=0), else none."""
    if not nvrtc.kernels_run(dev):
        return []
    return dp4a_forms(s, forms)


def mma_split(s: QGemvShape, sub: int) -> int:
    """The split of the groups into whole products of `sub` nearest 4 ways (2 to 8; 0: none)."""
    groups = s.k // s.group
    ways = [d for d in range(2, 9) if groups % d == 0 and (groups // d) % sub == 0]
    return min(ways, key=lambda d: (abs(d - 4), d)) if ways else 0


def mma_forms(s: QGemvShape, forms: list[tuple]) -> list[Variant]:
    """mma_variant of each form that fits (bits 2 and 4: the catalogue holds no dtype; 8 bits fit
    f16 only), its split 0 made mma_split's; whole products of SUB groups a split."""
    out = []
    for bn, sub, w, sk, st in forms:
        sk = sk or mma_split(s, sub)
        if sk and fits(s, mma_variant(bn, sub, w, sk, st).p):
            out.append(mma_variant(bn, sub, w, sk, st))
    return list(dict.fromkeys(out))


TRUSTED = variant("dequant_linear", trusted=True)
GPU_FORMS = [(bn, bk, w) for bn in (4, 8, 16, 32) for bk in (256, 512, 1024) for w in (2, 4, 8)]
CPU_FORMS = [(8, 128, 4), (16, 256, 4)]    # the interpreter's cost is per program: few, each path taken
# (bn, bw, warps, splits, prefetch, x3), 4 to 32 words a thread; splits 0: the divisor of the shape's
# steps nearest 4 (split_for). On the H200 (bench/NOTES.md) the prefetch lost at every 9B shape (its
# extra registers cost more than the latency it hides)
GPU_FMA = [(bn, bw, 4, sk, False, x3) for bn in (8, 16, 32) for bw in (64, 128, 256) for sk in (1, 0)
           for x3 in (False, True) if 4 <= bn * bw // 128 <= 32] + [(16, 128, 4, 1, True, False)]
PROLOGUE_TILES = ((16, 128), (32, 128))     # (bn, bw) of the fused prologue forms measured on a GPU
CPU_FMA = [(8, 16, 4, 2, True, False), (16, 32, 4, 1, False, True)]
# (bn, sub, warps, splits (0: mma_split's), stages) of the tensor-core form: 64 rows a warpgroup's
# product; the stages' words within MMA_SMEM of the H200's 227 KiB of shared memory a block. Measured
# on the 9B's and 27B's shapes (bench/NOTES.md, 2026-12-02, 30 forms a shape): every winner was 64 rows,
# 2 or 4 groups a product, 4 warps, 2 stages; 1 group a product, 32 rows, 8 warps and 3 stages never won
GPU_MMA = [(bn, sub, w, sk, st) for bn, sub, w, st in ((64, 4, 4, 2), (64, 2, 4, 2), (128, 2, 4, 2))
           for sk in (1, 2, 0)]
CPU_MMA = [(32, 4, 4, 2, 2)]      # the interpreter's tunes: one form (tests/ops take the paths one by one)
TEST_MMA = [(16, 2, 4, 1, 2), (32, 4, 4, 2, 2)]     # whole and split, a tail chunk with dead products
MMA_SMEM = 160 * 1024
# (bn, warps, rows a pass, splits) of the DP4A form (dp4a.py); on an H100 (bench/NOTES.md, 2026-12-05)
# every 9B and 27B shape's variants came within ~25% of each other, bn16/32 with no split winning most
GPU_DP4A = [(bn, 4, r, sk) for bn in (16, 32, 64) for r in (4, 8) for sk in (1, 2, 4)]
# more loads in flight where the H200's winners sat at the list's edge (11bd38c's tunes: the 27B's
# 5120x17408 at 61% of bandwidth with bn16, 4 warps, the least rows and most warps listed): 8 warps
# where K has the slabs for them, 8 rows a block where N is small (GPU_DP4A_SMALL_N)
GPU_DP4A_WIDE = [(bn, 8, r, sk) for bn in (16, 32) for r in (4, 8) for sk in (1, 2)]
GPU_DP4A_NARROW = [(8, 4, r, sk) for r in (4, 8) for sk in (1, 2)]
GPU_DP4A_SMALL_N = 8192
# with act(g) * u computed as x is loaded (the down projections'): the plain shapes' H100 winners' tiles
# (bn16/32, 4 warps, no split: 19 of 24, bench/NOTES.md 2026-12-05), one split, and bn 64 with splits
# (every block computes act(g) * u over its K: N / bn times in all). On the H100 (bench/NOTES.md,
# 2026-12-05) these won the 0.8b's down projection (3.51 vs 4.28 us) and lost the 9B's and 27B's
DP4A_ACT = [(bn, 4, r, sk) for bn in (16, 32) for r in (4, 8) for sk in (1, 2)] + [(64, 4, 8, 2), (64, 4, 8, 4)]
# with the norm in the prologue every block first reads the whole row (and r) from L2 for its rstd: at
# bn 16 that is as many bytes as the weights on the 9B's gate|up; more rows a block spread it over more.
# On the H100 they lost every 0.8b, 9B and 27B shape, by 0.4 to 5 us (bench/NOTES.md, 2026-12-05)
DP4A_NORM = [(bn, 4, r, 1) for bn in (32, 64, 128) for r in (4, 8)] + [(64, 4, 8, 2), (128, 4, 8, 2)]
# (gather, grouped, acc): words, grouped, acc, gather
FORMS = ((False, False, False), (False, True, False), (False, False, True), (True, False, False))


def split_for(s: QGemvShape, bw: int) -> int:
    """The split of K into whole steps of `bw` words nearest 4 ways (2 to 8; 0: none): 0.8b's down
    projection (K 3584) has 7 steps of 64 words, the 27B's (K 17408) 17 of 128."""
    words = s.k * s.bits // 32 if 32 % s.bits == 0 else 0
    steps = words // bw if words % bw == 0 else 0
    ways = [d for d in range(2, 9) if steps and steps % d == 0]
    return min(ways, key=lambda d: (abs(d - 4), d)) if ways else 0


def fma_forms(s: QGemvShape, forms: list[tuple]) -> list[Variant]:
    """fma_variant of each form that fits the shape, its split 0 made split_for's."""
    out = []
    for bn, bw, w, sk, pf, x3 in forms:
        sk = sk or split_for(s, bw)
        if sk:
            v = fma_variant(bn, bw, w, sk, pf, x3)
            if fits(s, v.p):
                out.append(v)
    return list(dict.fromkeys(out))


def fits(s: QGemvShape, p: dict) -> bool:
    """Whole groups a step, K a whole number of steps, words only where values do not cross words."""
    if p.get("mma"):
        groups = s.k // s.group
        stage = p["bn"] * MMA_GROUPS * s.group * s.bits // 8         # a chunk's words in shared memory
        return (s.bits in (2, 4) and s.k % s.group == 0 and groups % p["sk"] == 0
                and (groups // p["sk"]) % p["sub"] == 0 and MMA_GROUPS % p["sub"] == 0
                and (p["st"] - 1) * stage <= MMA_SMEM)       # Triton buffers stages - 1 chunks
    if p.get("fma"):      # whole words, whole groups a step, whole steps a split
        return (32 % s.bits == 0 and s.k % (32 // s.bits) == 0 and (s.k * s.bits // 32) % (p["sk"] * p["bw"]) == 0
                and p["bw"] % (s.group * s.bits // 32) == 0
                and p["bn"] <= max(8, 1 << (s.n - 1).bit_length()))
    return (s.k % p["bk"] == 0 and p["bk"] % s.group == 0 and (p["gather"] or 32 % s.bits == 0)
            and p["bn"] <= max(4, 1 << (s.n - 1).bit_length()))


class QGemvOp(Op):
    name = "qgemv"
    # every file its kernels' code comes from (the Triton forms call gemm.py's, helpers', mma.py's,
    # the norm's, activation's and moe's device functions; `unfused` runs act_mul and the norm kernel)
    sources = (__file__, COMMON, qmma.__file__, gemm_file, helpers.__file__, ACTS_FILE, moe_kernels.__file__,
               norm_kernels.__file__, dp4a.__file__, nvrtc.__file__, cuda_common.__file__)
    shape_type = QGemvShape
    only: tuple = ()     # benches: only variants whose names start so (a tuple: the op is pickled to workers)

    def shape_str(self, s: QGemvShape) -> str:
        pro = (f"_{s.act}" if s.act else "") + (f"_{s.style}" + ("_add" if s.add else "") if s.style else "")
        return (f"{s.rows}x{s.n}x{s.k}_q{s.bits}g{s.group}{pro}" + (f"_out_{s.out_act}" if s.out_act else "")
                + (f"_out_{s.out_norm}_add" if s.out_norm else ""))

    def with_rows(self, s: QGemvShape, rows: int) -> QGemvShape:
        return QGemvShape(rows, s.n, s.k, s.bits, s.group, s.act, s.style, s.add, s.out_act, s.out_norm)

    def blocks(self, s: QGemvShape) -> tuple[int, int]:
        return max(2, s.rows), s.rows     # the rows loop taken more than once, and the rows asked for

    def catalogue(self, s: QGemvShape, dev) -> list[Variant]:
        only = self.only or ""
        if s.epilogue:      # the GEMV then act_mul or the add + norm kernel (trusted: the reference's), or a dp4a
            # form computing it as it stores
            forms = GPU_DP4A + GPU_DP4A_WIDE + (GPU_DP4A_NARROW if s.n <= GPU_DP4A_SMALL_N else [])
            return [TRUSTED, UNFUSED] + [v for v in cuda_c_forms(s, forms, dev) if v.name.startswith(only)]
        if s.prologue:      # the composition (trusted), its tuned kernels, or the FMA form computing it as it loads
            # on the H200 every fused form lost to `unfused` at all 12 prologue shapes of the 0.8b and
            # 9B (bench/NOTES.md, 2026-12-02): two stay measured, in case a shape ever favours them
            fused = CPU_FMA if dev.capability is None else [f for f in GPU_FMA if f[:2] in PROLOGUE_TILES
                                                            and f[3] == 1 and not f[4] and not f[5]]
            dp = [v for v in cuda_c_forms(s, DP4A_ACT if s.act else DP4A_NORM, dev) if v.name.startswith(only)]
            return [TRUSTED, UNFUSED] + [v for v in fma_forms(s, fused) if v.name.startswith(only)] + dp
        fma = [v for v in fma_forms(s, CPU_FMA if dev.capability is None else GPU_FMA) if v.name.startswith(only)]
        # words and grouped lost to acc on every H200 shape, and acc and gather to fma wherever it fits
        # (bench/NOTES.md): the interpreter keeps every form
        forms = CPU_FORMS if dev.capability is None else GPU_FORMS
        kinds = FORMS if dev.capability is None else [] if fma else [f for f in FORMS if f[0] or f[2]]
        old = [qgemv_variant(*f, *form) for f in forms for form in kinds]
        mma = [v for v in mma_forms(s, CPU_MMA if dev.capability is None else GPU_MMA) if v.name.startswith(only)]
        dp_forms = GPU_DP4A + GPU_DP4A_WIDE + (GPU_DP4A_NARROW if s.n <= GPU_DP4A_SMALL_N else [])
        dp = [v for v in cuda_c_forms(s, dp_forms, dev) if v.name.startswith(only)]
        return [TRUSTED] + [v for v in old if fits(s, v.p) and v.name.startswith(only)] + fma + mma + dp

    def trusted(self, s, dev) -> Variant:
        return TRUSTED

    def default(self, s: QGemvShape, dev) -> Variant:
        """Untuned: the FMA form's H200 winner (bn16, 128 words a step, no split) or its nearest that fits,
        else the widest gather form."""
        if s.prologue or s.epilogue:
            return UNFUSED
        forms = [v for v in self.catalogue(s, dev) if v is not TRUSTED and not v.p.get("mma")
                 and not v.p.get("dp4a")]     # any dtype, any machine
        fma = [v for v in forms if v.p.get("fma") and not v.p["pf"] and not v.p["x3"]]
        if fma:
            return min(fma, key=lambda v: (v.p["sk"], abs(v.p["bw"] - 128), abs(v.p["bn"] - 16)))
        forms.sort(key=lambda v: (not v.p.get("gather", False), v.p.get("bn", 0) != 8, -v.p.get("bk", 0)))
        return forms[0] if forms else TRUSTED

    def inputs(self, s: QGemvShape, dtype, device, gen) -> dict:
        if s.style:
            d = norm_kernels.norm_inputs(s.rows, s.k, s.style, dtype, device, gen)
            if s.add:
                d["r"] = torch.randn(s.rows, s.k, generator=gen, device=device).to(dtype)
        elif s.act:       # [g | u], gates across the activation's bend
            d = {"x": (torch.randn(s.rows, 2 * s.k, generator=gen, device=device) * 2.0).to(dtype), "act": s.act}
        else:
            d = {"x": torch.randn(s.rows, s.k, generator=gen, device=device).to(dtype)}
            if s.out_act:       # gates across the activation's bend
                d = {"x": d["x"] * 2.0, "out_act": s.out_act}
            if s.out_norm:      # the residual r and the norm's weights as the rmsnorm op draws them
                nd = norm_kernels.norm_inputs(s.rows, s.n, s.out_norm, dtype, device, gen)
                d.update(out_r=nd["x"], out_w=nd["norm_w"], out_eps=nd["eps"], out_norm=s.out_norm)
        w = torch.randn(s.n, s.k, generator=gen, device=device) * s.k ** -0.5
        return {**d, "w": quantize(w.to(dtype), s.bits, s.group)}

    def outputs(self, s: QGemvShape, inputs: dict) -> dict:
        x, n = inputs["x"], inputs["w"].shape[0]
        out = {"y": torch.empty((x.shape[0], n // 2 if inputs.get("out_act") else n), dtype=x.dtype, device=x.device)}
        if inputs.get("r") is not None:
            out["s"] = torch.empty_like(x)
        if inputs.get("out_norm") is not None:
            out["s"] = torch.empty_like(out["y"])
        return out

    def launch(self, v: Variant, inputs: dict, outputs: dict, plan=None) -> None:
        norm = None
        if "norm_w" in inputs:
            norm = {"w": inputs["norm_w"], "eps": inputs["eps"], "style": inputs["style"], "r": inputs.get("r"),
                    "s": outputs.get("s")}
        qgemv(inputs["x"], inputs["w"], v, outputs["y"], act=inputs.get("act"), norm=norm,
              act_out=inputs.get("out_act"), norm_out=norm_out_of(inputs, outputs))

    def compile(self, v: Variant, s: QGemvShape, dtype, device) -> list:
        if interpreting() or v.run is not None or v.p.get("trusted"):
            return []
        x = torch.empty((1, 2 * s.k if s.act else s.k), dtype=dtype, device=device)
        sb = torch.empty((s.n, s.k // s.group), dtype=dtype, device=device)
        w = QuantizedWeight(torch.empty((s.n, s.k * s.bits // 32), dtype=torch.int32, device=device), sb, sb,
                            s.bits, s.group)
        norm = None
        if s.style:
            r = torch.empty_like(x) if s.add else None
            norm = {"w": torch.empty(s.k, dtype=dtype, device=device), "eps": 1e-6, "style": s.style, "r": r, "s": r}
        nout = None
        if s.out_norm:
            y = torch.empty((1, s.n), dtype=dtype, device=device)
            nout = {"w": torch.empty(s.n, dtype=dtype, device=device), "r": y, "s": y, "eps": 1e-6,
                    "style": s.out_norm}
        built = qgemv(x, w, v, act=s.act, norm=norm, warm=True, act_out=s.out_act, norm_out=nout)
        return [] if v.p.get("dp4a") else [built]     # a CUDA C kernel: compiled and loaded, no Triton launcher

    def kernel_sources(self, v: Variant) -> list | str:
        if v.p.get("trusted"):
            return []
        if v.p.get("dp4a"):
            return dp4a.SOURCE           # CUDA C: `kiln kernels --dump` writes it as a .cu file
        if v.p.get("mma"):
            return [qgemv_mma_kernel, chunk_sums, weight_tile, unpack_asm, unpack_plain, gemv_splitk_finish,
                    last_arrival, pdl_wait, round_to]
        if v.p.get("fma"):
            return [qgemv_fma_kernel, fma_words, x_values, top_bits, gemv_splitk_finish, last_arrival, norm_rstd,
                    style_scaled, act_f32,
                    weighted, pdl_wait, round_to]
        return [qgemv_kernel, step_sums, flat_step, grouped_step, dequant_row, grouped_layout, scaled_group_sums,
                words_tile, gather_tile, as_f32, pdl_wait, round_to]

    def supports(self, x: torch.Tensor, w) -> bool:
        """x [M, K] in a kernel dtype, w quantised with scales of x's dtype and K a whole number of the
        smallest step (128 inputs)."""
        return (isinstance(w, QuantizedWeight) and x.dtype in SUPPORTED and w.dtype == x.dtype
                and w.packed.dim() == 2 and w.shape[-1] == x.shape[-1] and x.shape[-1] % 128 == 0)

    def supports_prologue(self, x: torch.Tensor, w, act: str | None = None, norm_w=None, style=None, r=None) -> bool:
        """One row of x ([g | u] with act), w as `supports` takes it and in a form the FMA kernel reads
        (bits dividing 32); the norm's weight [K] in x's dtype, a known style, r shaped like x."""
        k = w.shape[-1] if isinstance(w, QuantizedWeight) else -1
        if x.dim() != 2 or x.shape[0] != 1 or 32 % getattr(w, "bits", 3) != 0:
            return False
        if act is not None:
            return act in ACTS and x.shape[-1] == 2 * k and self.supports(x[:, :k], w)
        return (self.supports(x, w) and norm_w is not None and norm_w.shape == (k,) and norm_w.dtype == x.dtype
                and style in norm_kernels.STYLES and (r is None or (r.shape == x.shape and r.dtype == x.dtype)))

    def supports_norm_epilogue(self, x: torch.Tensor, w, r, norm_w, style) -> bool:
        """One row of x, w as `supports` takes it, r [1, N] and the norm's weight [N] in x's dtype, a
        known style."""
        n = w.shape[0] if isinstance(w, QuantizedWeight) else -1
        return (x.dim() == 2 and x.shape[0] == 1 and self.supports(x, w) and style in norm_kernels.STYLES
                and norm_w is not None and norm_w.shape == (n,) and norm_w.dtype == x.dtype
                and r is not None and r.shape == (1, n) and r.dtype == x.dtype)

    def supports_epilogue(self, x: torch.Tensor, w, act: str) -> bool:
        """One row of x, w as `supports` takes it with an even number of rows ([gate; up]), an
        activation the kernels compute (SiLU, sigmoid)."""
        return (x.dim() == 2 and x.shape[0] == 1 and act in ACTS and self.supports(x, w)
                and w.shape[0] % 2 == 0)


OP = register(QGemvOp())
