"""The embedding lookup on a quantised table: each token's row dequantised straight from the packed
words, in one launch, as mx.dequantize computes it (scale * q rounded to the scales' dtype, plus the
bias rounded again, then the weight's dtype). Not tuned: one [BK] slice of a row a program, a few
kilobytes a token, bound by its launch. The same kernel dequantises a whole weight in one pass (tiles
of rows) for the prefill GEMM, instead of torch's chain of unpack, multiply and add kernels.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...weights.quantized import QuantizedWeight
from ..common import SUPPORTED, cdiv, next_pow2, rne_flag, round_to

BLOCK = 1024


@triton.jit(do_not_specialize=["T"])
def qembed_kernel(ids_ptr, q_ptr, s_ptr, b_ptr, y_ptr, T, K: tl.constexpr, BITS: tl.constexpr, G: tl.constexpr,
                  BR: tl.constexpr, BK: tl.constexpr, RNE: tl.constexpr, IDS: tl.constexpr = True):
    """y[t, c] for program (block of BR outputs t, block of BK columns c): row ids[t] (IDS) or row t
    of the table; value c sits at bit c * BITS of the row's stream, in one word or spilling into the
    next (every bits value)."""
    WORDS: tl.constexpr = K * BITS // 32
    t = tl.program_id(0) * BR + tl.arange(0, BR)
    c = tl.program_id(1) * BK + tl.arange(0, BK)
    inside = (t < T)[:, None] & (c < K)[None, :]
    if IDS:
        row = tl.load(ids_ptr + t, mask=t < T, other=0).to(tl.int64)[:, None]
    else:
        row = tl.minimum(t, T - 1).to(tl.int64)[:, None]
    first = c * BITS
    shift = (first % 32).to(tl.uint32)[None, :]
    base = q_ptr + row * WORDS + (first // 32)[None, :]
    lo = tl.load(base, mask=inside, other=0).to(tl.uint32, bitcast=True)
    spills = inside & (shift + BITS > 32)
    hi = tl.load(base + 1, mask=spills, other=0).to(tl.uint32, bitcast=True)
    # where nothing spills hi is 0, so its shift (by up to 32) contributes nothing either way
    q = ((lo >> shift) | tl.where(spills, hi << (32 - shift), 0)) & ((1 << BITS) - 1)
    gi = row * (K // G) + (c // G)[None, :]
    sdt = s_ptr.dtype.element_ty
    scale = tl.load(s_ptr + gi, mask=inside, other=0.0).to(tl.float32)
    bias = tl.load(b_ptr + gi, mask=inside, other=0.0).to(tl.float32)
    prod = round_to(scale * q.to(tl.float32), sdt, RNE).to(tl.float32)
    w = round_to(prod + bias, sdt, RNE).to(tl.float32)
    tl.store(y_ptr + t.to(tl.int64)[:, None] * K + c[None, :], round_to(w, y_ptr.dtype.element_ty, RNE), mask=inside)


def supports(ids: torch.Tensor | None, table) -> bool:
    return (isinstance(table, QuantizedWeight) and table.packed.dim() == 2 and table.dtype in SUPPORTED
            and table.scales.dtype in SUPPORTED
            and (ids is None or (not ids.is_floating_point() and ids.device == table.packed.device)))


def qembed(ids: torch.Tensor | None, table: QuantizedWeight) -> torch.Tensor:
    """dequantize(table.rows(ids)) in one launch: [*ids.shape, K] in the table's dtype; with ids None,
    the whole table (dequantize(table), what a prefill GEMM takes)."""
    n, k = table.shape
    flat = None if ids is None else ids.reshape(-1).contiguous()
    t = n if flat is None else flat.numel()
    y = torch.empty((t, k), dtype=table.dtype, device=table.packed.device)
    if t:
        bk = min(BLOCK, next_pow2(k))
        br = 1 if flat is not None else max(1, min(32, BLOCK * 4 // bk))      # whole tables: tiles of rows
        rne = rne_flag(table.dtype) or rne_flag(table.scales.dtype)
        qembed_kernel[(cdiv(t, br), cdiv(k, bk))](table.packed if flat is None else flat, table.packed, table.scales,
                                                  table.biases, y, t, K=k, BITS=table.bits, G=table.group_size, BR=br,
                                                  BK=bk, RNE=rne, IDS=flat is not None, num_warps=4)
    return y if ids is None else y.view(*ids.shape, k)
