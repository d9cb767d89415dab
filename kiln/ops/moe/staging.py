"""Streamed experts in host memory, zero-copy decode (docs/streaming.md): one kernel copies a decode
call's missed experts from mapped (pinned) host memory into device scratch, then the resident decode
kernels read them there.

Why a copy kernel rather than the GEMVs reading host memory in place: the GEMV reads each expert as
many short row pieces and its scales and biases a few bytes at a time, which the link serves at well
under its rate; this kernel reads each part as one contiguous run of wide loads, as the reduction
that measured the link's in-place rate does. It runs inside the decode's CUDA graph (no host read):
the routed ids and the store's table (expert -> slot, or -1 - its row of the host stacks) are
device tensors; pair p of a miss lands in scratch row p and its row becomes -1 - p.

A plain reference beside it (stage_reference) and tests/weights/test_experts.py compare them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..common import cdiv

BLOCK = 2048          # int32 words a program copies of each part (8 KiB)
PARTS = 6             # a quantised expert's words, scales and biases of gate_up and down


@triton.jit
def _copy_part(src, dst, e, p, offs, W: tl.constexpr):
    if W > 0:
        m = offs < W
        tl.store(dst + p * W + offs, tl.load(src + e * W + offs, mask=m), mask=m)


@triton.jit
def stage_kernel(idx_ptr, table_ptr, rows_ptr, s0, d0, s1, d1, s2, d2, s3, d3, s4, d4, s5, d5,
                 W0: tl.constexpr, W1: tl.constexpr, W2: tl.constexpr, W3: tl.constexpr, W4: tl.constexpr,
                 W5: tl.constexpr, BLOCK: tl.constexpr):
    """Program (pair p, chunk c): pair p's expert e = idx[p]; its row is table[e] when in a slot, else
    -1 - p, and then chunk c of each of its parts (an [E, W] int32 view of a host stack, the expert at
    its row -1 - table[e]: e, or its row of a compacted stack) is copied to row p of that part's
    scratch."""
    p = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    e = tl.load(idx_ptr + p).to(tl.int64)
    t = tl.load(table_ptr + e)
    if c == 0:
        tl.store(rows_ptr + p, tl.where(t >= 0, t, -1 - p.to(tl.int32)))
    if t < 0:
        offs = c * BLOCK + tl.arange(0, BLOCK)
        r = -1 - t.to(tl.int64)
        _copy_part(s0, d0, r, p, offs, W0)
        _copy_part(s1, d1, r, p, offs, W1)
        _copy_part(s2, d2, r, p, offs, W2)
        _copy_part(s3, d3, r, p, offs, W3)
        _copy_part(s4, d4, r, p, offs, W4)
        _copy_part(s5, d5, r, p, offs, W5)


def words(t: torch.Tensor) -> torch.Tensor | None:
    """A stack [E, ...] as [E, W] int32 words (a view), None where its rows are not whole words."""
    flat = t.reshape(t.shape[0], -1)
    if (flat.shape[1] * flat.element_size()) % 4 or not flat.is_contiguous():
        return None
    return flat.view(torch.int32)


def stage(idx: torch.Tensor, table: torch.Tensor, host: list[torch.Tensor],
          scratch: list[torch.Tensor]) -> torch.Tensor:
    """Rows for idx's pairs (slot, or -1 - p for a miss staged in scratch row p), the misses copied;
    host and scratch: up to PARTS [E, W] / [P, W] int32 views."""
    pairs = idx.numel()
    rows = torch.empty(pairs, dtype=torch.int32, device=idx.device)
    if pairs == 0:
        return rows
    args, widths = [], []
    for j in range(PARTS):
        if j < len(host):
            args += [host[j], scratch[j]]
            widths.append(host[j].shape[1])
        else:
            args += [host[0], scratch[0]]
            widths.append(0)
    grid = (pairs, max(1, cdiv(max(widths), BLOCK)))
    stage_kernel[grid](idx.reshape(-1), table, rows, *args, *widths, BLOCK=BLOCK, num_warps=4)
    return rows


def stage_reference(idx: torch.Tensor, table: torch.Tensor, host: list[torch.Tensor],
                    scratch: list[torch.Tensor]) -> torch.Tensor:
    """stage in plain torch (with host reads on the host)."""
    flat = idx.reshape(-1).long()
    slot = table[flat]
    rows = torch.where(slot >= 0, slot, -1 - torch.arange(flat.numel(), device=idx.device, dtype=slot.dtype))
    for p in torch.nonzero(slot < 0).reshape(-1).tolist():
        for h, s in zip(host, scratch):
            s[p].copy_(h[-1 - int(slot[p])])
    return rows.to(torch.int32)
