"""The GDN layer's inputs out of its packed projection in one launch. The model runs one GEMM for
qkv | z | b | a and hands the mixer column views of its [T, W] output; the mixer's kernels take
contiguous rows, so each view was copied alone: four strided torch copies a layer (a 1,000-token
prefill of the 35B-A3B: 120 launches, 1.2 ms; bench/NOTES.md 2026-12-03). Here one program a row
copies all four parts into one buffer, each part contiguous, and can push the b and a of a padded
prefill's spare rows to a constant (kiln.ops.gdn.cuda.PAD_GATE) in the same pass.

This file is not among the gdn op's kernel sources: the tuned choices do not depend on it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024     # columns a step: the widest part (the 35B's qkv, 8,192) takes 8


@triton.jit
def copy_part(src, dst, t, T, OFF: tl.constexpr, W: tl.constexpr, BLOCK: tl.constexpr, pad, PADDED: tl.constexpr,
              PAD: tl.constexpr):
    """Columns OFF..OFF+W of row t (src at the row) -> row t of the part at dst + OFF * T, [T, W]."""
    for j in tl.static_range(0, W, BLOCK):
        c = j + tl.arange(0, BLOCK)
        inside = c < W
        v = tl.load(src + OFF + c, mask=inside)
        if PADDED:
            v = tl.where(pad, PAD, v)
        tl.store(dst + OFF * T.to(tl.int64) + t.to(tl.int64) * W + c, v, mask=inside)


@triton.jit(do_not_specialize=["T", "stride"])
def unpack_kernel(src_ptr, dst_ptr, n_ptr, T, stride, W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr,
                  W3: tl.constexpr, PADDED: tl.constexpr, PAD: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0)
    src = src_ptr + t.to(tl.int64) * stride
    pad = False
    if PADDED:
        pad = t >= tl.load(n_ptr)
    copy_part(src, dst_ptr, t, T, 0, W0, BLOCK, pad, False, PAD)
    copy_part(src, dst_ptr, t, T, W0, W1, BLOCK, pad, False, PAD)
    copy_part(src, dst_ptr, t, T, W0 + W1, W2, BLOCK, pad, PADDED, PAD)
    copy_part(src, dst_ptr, t, T, W0 + W1 + W2, W3, BLOCK, pad, PADDED, PAD)


def packed(parts) -> bool:
    """Whether the four 2-D parts are consecutive column ranges of one row-major buffer, that buffer's
    whole rows (what `ops.linear_split` returns)."""
    first = parts[0]
    if first.dim() != 2 or any(p.dim() != 2 or p.dtype != first.dtype or p.device != first.device
                               or p.shape[0] != first.shape[0] or p.stride(1) != 1 or p.stride(0) != first.stride(0)
                               for p in parts):
        return False
    at = first.data_ptr()
    for p in parts:
        if p.data_ptr() != at:
            return False
        at += p.shape[1] * p.element_size()
    return first.stride(0) == sum(p.shape[1] for p in parts)


def unpack(qkv, z, b, a, n: torch.Tensor | None = None, pad: float = 0.0):
    """(qkv, z, b, a), each contiguous, from column views of one packed [T, W] buffer; with n (an int
    tensor [1] on the device) the rows from n on get b and a = pad. None where they are not such views."""
    parts = (qkv, z, b, a)
    if not packed(parts):
        return None
    t, widths = qkv.shape[0], [p.shape[1] for p in parts]
    out = torch.empty(t * sum(widths), dtype=qkv.dtype, device=qkv.device)
    unpack_kernel[(t,)](qkv, out, n if n is not None else out, t, qkv.stride(0), *widths, PADDED=n is not None,
                        PAD=pad, BLOCK=BLOCK)
    views, at = [], 0
    for w in widths:
        views.append(out[at * t:(at + w) * t].view(t, w))
        at += w
    return tuple(views)


def unpack_reference(qkv, z, b, a, n: torch.Tensor | None = None, pad: float = 0.0):
    """unpack in torch: the copies it replaces (and the masked_fill of the padded rows)."""
    if n is not None:
        spare = (torch.arange(qkv.shape[0], device=qkv.device) >= n)[:, None]
        b, a = b.masked_fill(spare, pad), a.masked_fill(spare, pad)
    return tuple(p.contiguous() for p in (qkv, z, b, a))
