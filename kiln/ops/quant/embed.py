"""The embedding lookup on a quantised table: each token's row dequantised straight from the packed
words, in one launch, as mx.dequantize computes it (scale * q rounded to the scales' dtype, plus the
bias rounded again, then the weight's dtype). Not tuned: one [BK] slice of a row a program, a few
kilobytes a token, bound by its launch.
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
                  BK: tl.constexpr, RNE: tl.constexpr):
    """y[t, c] for program (t, column block): value c of row ids[t] sits at bit c * BITS of the row's
    stream, in one word or spilling into the next (every bits value)."""
    WORDS: tl.constexpr = K * BITS // 32
    t = tl.program_id(0)
    c = tl.program_id(1) * BK + tl.arange(0, BK)
    inside = c < K
    row = tl.load(ids_ptr + t).to(tl.int64)
    first = c * BITS
    shift = (first % 32).to(tl.uint32)
    base = q_ptr + row * WORDS + first // 32
    lo = tl.load(base, mask=inside, other=0).to(tl.uint32, bitcast=True)
    spills = inside & (shift + BITS > 32)
    hi = tl.load(base + 1, mask=spills, other=0).to(tl.uint32, bitcast=True)
    # where nothing spills hi is 0, so its shift (by up to 32) contributes nothing either way
    q = ((lo >> shift) | tl.where(spills, hi << (32 - shift), 0)) & ((1 << BITS) - 1)
    gi = row * (K // G) + c // G
    sdt = s_ptr.dtype.element_ty
    scale = tl.load(s_ptr + gi, mask=inside, other=0.0).to(tl.float32)
    bias = tl.load(b_ptr + gi, mask=inside, other=0.0).to(tl.float32)
    prod = round_to(scale * q.to(tl.float32), sdt, RNE).to(tl.float32)
    w = round_to(prod + bias, sdt, RNE).to(tl.float32)
    tl.store(y_ptr + t.to(tl.int64) * K + c, round_to(w, y_ptr.dtype.element_ty, RNE), mask=inside)


def supports(ids: torch.Tensor, table) -> bool:
    return (isinstance(table, QuantizedWeight) and table.packed.dim() == 2 and not ids.is_floating_point()
            and table.dtype in SUPPORTED and table.scales.dtype in SUPPORTED and ids.device == table.packed.device)


def qembed(ids: torch.Tensor, table: QuantizedWeight) -> torch.Tensor:
    """dequantize(table.rows(ids)) in one launch: [*ids.shape, K] in the table's dtype."""
    k = table.shape[-1]
    flat = ids.reshape(-1).contiguous()
    y = torch.empty((flat.numel(), k), dtype=table.dtype, device=table.packed.device)
    if flat.numel():
        bk = min(BLOCK, next_pow2(k))
        rne = rne_flag(table.dtype) or rne_flag(table.scales.dtype)
        qembed_kernel[(flat.numel(), cdiv(k, bk))](flat, table.packed, table.scales, table.biases, y, flat.numel(),
                                                   K=k, BITS=table.bits, G=table.group_size, BK=bk, RNE=rne,
                                                   num_warps=4)
    return y.view(*ids.shape, k)
