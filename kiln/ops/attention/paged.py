"""Batched decode attention over paged K/V (kiln.cache.SlotPool): row r of a step reads the keys
0..pos[r] of slot slots[r], whose positions p live at row table[slot, p // PAGE] * PAGE + p % PAGE of
the layer's stores [pages * PAGE, KV, D].

The split kernel is decode_split_kernel's (kernels.py) with one change: before each step of BLOCK_N
keys it looks up the page holding them and shifts the K/V pointers by that page's offset, so `attend`
computes on the same values in the same order. A step never straddles two pages (BLOCK_N divides
PAGE, and the splits start at multiples of BLOCK_N): each row's output is bit-identical to
decode_attention over that row's keys copied into one contiguous buffer, with the same variant. The
combine is kernels.decode_combine_kernel. (A kernel of its own file, so that the tuned choices of
kernels.py's ops, keyed by that file's hash, stay valid; the variant is the tuned attention_decode's.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ...tune.registry import Variant
from ..common import dot_flags, pdl, pdl_wait, rne_flag
from .kernels import attend, combine_block, decode_combine_kernel, decode_rows, decode_splits


@triton.jit(do_not_specialize=["chunk", "splits"])
def paged_split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, slot_ptr, table_ptr, m_ws, l_ws, acc_ws, stride_h, stride_t,
                       table_stride, chunk, splits, scale, softcap, H: tl.constexpr, KV: tl.constexpr,
                       D: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, ROWS: tl.constexpr,
                       BLOCK_N: tl.constexpr, PAGE: tl.constexpr, SCALAR: tl.constexpr, UPCAST: tl.constexpr,
                       IEEE: tl.constexpr, RNE: tl.constexpr, PDL: tl.constexpr = False):
    """Program (split, KV head, row): keys split*chunk .. +chunk-1 of the row's slot that are <= its
    position (and in the window), for the KV head's H // KV query heads; partials [B, H, splits]."""
    G: tl.constexpr = H // KV
    pdl_wait(PDL)
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    row = tl.program_id(2)
    table_ptr += tl.load(slot_ptr + row).to(tl.int64) * table_stride
    q_ptr += row.to(tl.int64) * stride_t
    pos_ptr += row
    m_ws += row.to(tl.int64) * H * splits
    l_ws += row.to(tl.int64) * H * splits
    acc_ws += row.to(tl.int64) * H * splits * D
    r = tl.arange(0, ROWS)
    head = kvh * G + r
    d = tl.arange(0, D)
    q = tl.load(q_ptr + head[:, None] * stride_h + d[None, :], mask=(r < G)[:, None], other=0.0)
    pos = tl.load(pos_ptr).to(tl.int32)
    qpos = tl.zeros([ROWS], dtype=tl.int32) + pos
    start = split * chunk
    end = tl.minimum(start + chunk, pos + 1)
    lo = start
    if WINDOW > 0:
        lo = tl.maximum(start, tl.maximum(pos - WINDOW + 1, 0) // BLOCK_N * BLOCK_N)

    m_i = tl.zeros([ROWS], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, D], dtype=tl.float32)
    for n in range(lo, end, BLOCK_N):
        page = tl.load(table_ptr + n // PAGE).to(tl.int64)
        shift = (page - n // PAGE) * (PAGE * KV * D)     # position n's page, where `attend` looks for it
        m_i, l_i, acc = attend(q, k_ptr + shift, v_ptr + shift, n, kvh, qpos, pos + 1, m_i, l_i, acc, scale,
                               softcap, KV, D, WINDOW, SOFTCAP, BLOCK_N, True, SCALAR, UPCAST, IEEE, RNE)
    at = head.to(tl.int64) * splits + split
    tl.store(m_ws + at, m_i, mask=r < G)
    tl.store(l_ws + at, l_i, mask=r < G)
    tl.store(acc_ws + at[:, None] * D + d[None, :], acc, mask=(r < G)[:, None])


def decode_attention_paged(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, pos: torch.Tensor,
                           slots: torch.Tensor, table: torch.Tensor, page: int, keys: int, scale: float, window,
                           softcap, v: Variant, gate: torch.Tensor | None = None) -> torch.Tensor:
    """One query of each of B requests: q [B, H, D] (row r at position pos[r] < keys, over its slot
    slots[r]'s pages, table [S, keys per slot / page] int32) -> [B, H, D], each row as decode_attention
    computes it over a contiguous buffer of `keys` positions (times sigmoid(gate), gate [B, H, D] with
    unit last stride, when given)."""
    b, h, d = q.shape
    kv = k_store.shape[1]
    p = v.p
    if page % p["bn"]:
        raise ValueError(f"a decode step of {p['bn']} keys does not divide a page of {page}")
    chunk, splits = decode_splits(v, keys)
    m_ws = torch.empty((b, h, splits), dtype=torch.float32, device=q.device)
    l_ws = torch.empty_like(m_ws)
    acc_ws = torch.empty((b, h, splits, d), dtype=torch.float32, device=q.device)
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    rne = rne_flag(q.dtype)
    paged_split_kernel[(splits, kv, b)](q, k_store, v_store, pos, slots, table, m_ws, l_ws, acc_ws, q.stride(1),
                                        q.stride(0), table.stride(0), chunk, splits, scale, softcap or 1.0, H=h, KV=kv,
                                        D=d, WINDOW=window or 0, SOFTCAP=softcap is not None,
                                        ROWS=decode_rows(v, h // kv), BLOCK_N=p["bn"], PAGE=page,
                                        SCALAR=p.get("scalar", False), RNE=rne, **dot_flags(q.dtype),
                                        num_warps=p["w"], num_stages=p.get("s", 2), **pdl(q))
    gated = {} if gate is None else {"g_ptr": gate, "G_STRIDE": gate.stride(1), "g_row": gate.stride(0)}
    decode_combine_kernel[(h, b)](m_ws, l_ws, acc_ws, pos, out, chunk, splits, D=d, WINDOW=window or 0,
                                  SPLIT_BLOCK=combine_block(d), RNE=rne, num_warps=4, H=h, **pdl(q), **gated)
    return out
