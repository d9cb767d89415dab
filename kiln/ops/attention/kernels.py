"""Causal GQA attention over a layer's KV cache buffers (kiln/ops/attention/reference.py):
q [T, H, D] (a strided view is fine, last dim contiguous), k_buf/v_buf [capacity, KV, D] contiguous
with positions 0..S-1 valid; query i sits at position q_start + i and sees keys j <= q_start + i
(and j > q_start + i - window with a sliding window); query head h reads KV head h // (H // KV).
A sliding-window layer's buffers may be a ring (kiln.cache.WindowKVCache): `ring` rows, position j at
row j % ring; ring is a multiple of every BLOCK_N (ring_align), so a block of keys never straddles the
wrap and the kernels shift the K/V pointers by a block's wrap before `attend` reads it (as the paged
kernel shifts them by a page). A plain buffer passes NO_RING (no position reaches it: no shift).

Two kernel families:
  prefill: FlashAttention-2 style. One program owns BLOCK_M query rows (tokens of one head, or with
    GQA packing the H // KV heads of one KV head for BLOCK_M // group tokens, so each K/V tile
    serves every head that reads it) and walks key blocks with an online softmax; blocks that
    are fully masked (above the diagonal, before the window) are never visited, and blocks that
    no row masks run without masks.
  decode: split-KV (flash-decoding). Kernel 1: one program per (key split, KV head) takes all query
    heads of the KV head, so each key byte is read once, and writes f32 partials (m, l, acc[D]);
    kernel 2 combines them. The valid length is read from `pos` inside the kernels and the grid
    depends only on the buffer capacity, so the step can be captured in a CUDA graph.

Numerics (bf16/f16, where HF eager rounds): s = round16(round16(q.k) * scale) (with softcap also
rounded after each of /softcap, tanh, *softcap), softmax in f32, probabilities rounded to 16 bits
before the P@V dot, f32 accumulation, the output rounded once. NOTE: the online softmax cannot
round the normalised probabilities as HF does: it rounds exp(s - m_running) (unnormalised, against
the running max) and divides by the f32 sum at the end, so bf16 outputs differ from HF's by about
one bf16 rounding of the probabilities: within two ulps of the output row's largest value (the
bound the tests check). In f32 every
step is f32 and the result matches the reference to summation order.

tanh is exp-based (the interpreter has no libdevice): within 10 f32 ulps of the true value, so it
changes a bf16-rounded score about once in a few thousand.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...tune.device import device_info, interpreting
from ...tune.registry import Op, Variant, register, variant
from ..common import COMMON, SUPPORTED, cdiv, dot_flags, next_pow2, pdl, pdl_wait, pow2_dim, rne_flag, round_to
from ..gemm.activation import ACTS, act_f32
from ..gemm.activation import __file__ as ACTS_FILE

SIGMOID = tl.constexpr(ACTS["sigmoid"])    # the gate's act (Qwen3.5's gated attention), in the combine

HEAD_DIMS = (16, 32, 64, 128, 256, 512)
NO_RING = 1 << 30       # `ring` for a plain buffer: past every position, so j % ring == j (an int32 argument)


def ring_align(dev) -> int:
    """A ring's rows are a multiple of this: every key block (BLOCK_N) of the device's catalogues divides it."""
    return 32 if dev.capability is None else 128


@triton.jit
def ring_shift(n, ring, KV: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr):
    """Elements from position n's place in a plain buffer to its row in a ring of `ring` rows (<= 0).
    Only a sliding window's buffer is a ring: a full layer's code is the plain buffer's (no shift)."""
    sh = 0
    if WINDOW > 0:
        sh = (n % ring - n).to(tl.int64) * (KV * D)
    return sh


# -- shared pieces -------------------------------------------------------------------------------

@triton.jit
def tanh_f32(x):
    """tanh from exp: the series below 0.125 (where 1 - e^-2x cancels), the exp form above."""
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    big = (1.0 - e) / (1.0 + e)
    a2 = a * a
    small = a * (1.0 - a2 * (1.0 / 3.0 - a2 * (2.0 / 15.0 - a2 * (17.0 / 315.0))))
    t = tl.where(a < 0.125, small, big)
    return tl.where(x < 0, -t, t)


@triton.jit
def matmul_f32(a, b, SCALAR: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    """a [M, K] @ b [K, N] in f32: tensor cores (tl.dot), or broadcast-multiply and sum (SCALAR:
    the trusted forms, no tl.dot). UPCAST only under the interpreter (its 16-bit dot is wrong)."""
    # NOTE: one return at the end: code after a return in a constexpr branch is still compiled.
    if SCALAR:
        c = tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], axis=1)
    else:
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        if IEEE:
            c = tl.dot(a, b, input_precision="ieee")
        else:
            c = tl.dot(a, b)
    return c


@triton.jit
def round16(x, dtype: tl.constexpr, RNE: tl.constexpr):
    """x rounded to the activation dtype and back to f32 (identity in f32)."""
    return round_to(x, dtype, RNE).to(tl.float32)


@triton.jit
def scores(q, k, scale, softcap, dtype: tl.constexpr, SOFTCAP: tl.constexpr, SCALAR: tl.constexpr,
           UPCAST: tl.constexpr, IEEE: tl.constexpr, RNE: tl.constexpr):
    """s [M, N] = q [M, D] . k [N, D], rounded after each step as torch's 16-bit ops round."""
    s = round16(matmul_f32(q, tl.trans(k), SCALAR, UPCAST, IEEE), dtype, RNE)
    s = round16(s * scale, dtype, RNE)
    if SOFTCAP:
        s = round16(s / softcap, dtype, RNE)
        s = round16(tanh_f32(s), dtype, RNE)
        s = round16(s * softcap, dtype, RNE)
    return s


@triton.jit
def attend(q, k_ptr, v_ptr, n, kvh, qpos, kv_len, m_i, l_i, acc, scale, softcap, KV: tl.constexpr,
           D: tl.constexpr, WINDOW: tl.constexpr, SOFTCAP: tl.constexpr, BLOCK_N: tl.constexpr,
           MASKED: tl.constexpr, SCALAR: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
           RNE: tl.constexpr):
    """One online-softmax step over keys n..n+BLOCK_N-1 of KV head kvh for query rows at qpos [M].
    Unmasked blocks (every row sees every key) skip the masks."""
    j = n + tl.arange(0, BLOCK_N)
    d = tl.arange(0, D)
    offs = j.to(tl.int64)[:, None] * (KV * D) + kvh * D + d[None, :]
    if MASKED:
        k = tl.load(k_ptr + offs, mask=(j < kv_len)[:, None], other=0.0)
        v = tl.load(v_ptr + offs, mask=(j < kv_len)[:, None], other=0.0)
    else:
        k = tl.load(k_ptr + offs)
        v = tl.load(v_ptr + offs)
    dtype = k_ptr.dtype.element_ty
    s = scores(q, k, scale, softcap, dtype, SOFTCAP, SCALAR, UPCAST, IEEE, RNE)
    if MASKED:
        seen = (j[None, :] <= qpos[:, None]) & (j < kv_len)[None, :]
        if WINDOW > 0:
            seen = seen & (j[None, :] > qpos[:, None] - WINDOW)
        s = tl.where(seen, s, float("-inf"))
    # A row that has seen no key yet keeps m = -inf; it shifts by 0 so that exp gives 0, not NaN.
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_use)
    p = tl.exp(s - m_use[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + matmul_f32(round_to(p, dtype, RNE), v, SCALAR, UPCAST, IEEE)
    return m_new, l_i, acc


# -- prefill ---------------------------------------------------------------------------------------

@triton.jit
def key_ranges(q_start, m0, last, BLOCK_N: tl.constexpr, WINDOW: tl.constexpr):
    """Key block bounds for query tokens m0..last: [lo, mid_lo) masked, [mid_lo, mid_hi) seen by
    every row (no masks), [mid_hi, hi) masked. Blocks outside [lo, hi) are fully masked: skipped."""
    hi = q_start + last + 1
    lo = q_start * 0
    free_lo = q_start * 0                      # first block every row's window covers
    if WINDOW > 0:
        lo = tl.maximum(q_start + m0 - WINDOW + 1, 0) // BLOCK_N * BLOCK_N
        free_lo = (tl.maximum(q_start + last - WINDOW + 1, 0) + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    free_hi = (q_start + m0 + 1) // BLOCK_N * BLOCK_N   # last block the first row sees whole
    mid_lo = tl.minimum(tl.maximum(lo, free_lo), hi)
    mid_hi = tl.maximum(mid_lo, free_hi)
    return lo, mid_lo, mid_hi, hi


@triton.jit(do_not_specialize=["T", "q_start", "kv_len", "ring"])
def prefill_kernel(q_ptr, k_ptr, v_ptr, o_ptr, T, q_start, kv_len, stride_t, stride_h, scale, softcap, ring,
                   H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr,
                   SOFTCAP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PACK: tl.constexpr,
                   SCALAR: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr, RNE: tl.constexpr):
    """Program (token block, group of PACK heads). Row r of the tile is token m0 + r // PACK of head
    group * PACK + r % PACK; the PACK heads share one KV head. o [T, H, D] contiguous."""
    TM: tl.constexpr = BLOCK_M // PACK          # tokens per program
    # the last token blocks (the most keys) first, so that no long program starts last
    m0 = (tl.cdiv(T, TM) - 1 - tl.program_id(0)) * TM
    group = tl.program_id(1)
    kvh = group * PACK // (H // KV)
    r = tl.arange(0, BLOCK_M)
    tok = m0 + r // PACK
    head = group * PACK + r % PACK
    row_ok = (r < TM * PACK) & (tok < T)
    qpos = q_start + tok
    d = tl.arange(0, D)
    q_offs = tok.to(tl.int64)[:, None] * stride_t + head[:, None] * stride_h + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_ok[:, None], other=0.0)

    m_i = tl.zeros([BLOCK_M], dtype=tl.float32) - float("inf")
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, D], dtype=tl.float32)
    last = tl.minimum(m0 + TM, T) - 1
    lo, mid_lo, mid_hi, hi = key_ranges(q_start, m0, last, BLOCK_N, WINDOW)
    for n in range(lo, mid_lo, BLOCK_N):
        sh = ring_shift(n, ring, KV, D, WINDOW)
        m_i, l_i, acc = attend(q, k_ptr + sh, v_ptr + sh, n, kvh, qpos, kv_len, m_i, l_i, acc, scale, softcap, KV, D,
                               WINDOW, SOFTCAP, BLOCK_N, True, SCALAR, UPCAST, IEEE, RNE)
    for n in range(mid_lo, mid_hi, BLOCK_N):
        sh = ring_shift(n, ring, KV, D, WINDOW)
        m_i, l_i, acc = attend(q, k_ptr + sh, v_ptr + sh, n, kvh, qpos, kv_len, m_i, l_i, acc, scale, softcap, KV, D,
                               WINDOW, SOFTCAP, BLOCK_N, False, SCALAR, UPCAST, IEEE, RNE)
    for n in range(mid_hi, hi, BLOCK_N):
        sh = ring_shift(n, ring, KV, D, WINDOW)
        m_i, l_i, acc = attend(q, k_ptr + sh, v_ptr + sh, n, kvh, qpos, kv_len, m_i, l_i, acc, scale, softcap, KV, D,
                               WINDOW, SOFTCAP, BLOCK_N, True, SCALAR, UPCAST, IEEE, RNE)
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]     # l = 0 only on padding rows
    o_offs = (tok.to(tl.int64) * H + head)[:, None] * D + d[None, :]
    tl.store(o_ptr + o_offs, round_to(out, o_ptr.dtype.element_ty, RNE), mask=row_ok[:, None])


# -- decode ----------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["chunk", "splits", "ring"])
def decode_split_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, m_ws, l_ws, acc_ws, stride_h, chunk, splits, scale, softcap, ring,
                        H: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, WINDOW: tl.constexpr,
                        SOFTCAP: tl.constexpr, ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SCALAR: tl.constexpr,
                        UPCAST: tl.constexpr, IEEE: tl.constexpr, RNE: tl.constexpr, PDL: tl.constexpr = False,
                        slot_ptr=None, slot_stride=0, stride_t=0, SLOTS: tl.constexpr = False):
    """Program (split, KV head): keys split*chunk .. +chunk-1 that are <= pos (and in the window),
    for the H // KV query heads of the KV head (ROWS >= that, padded). A split with no such key
    writes the neutral partial m = -inf, l = 0, acc = 0. Partials: [H, splits] (and [H, splits, D]).
    SLOTS: program axis 2 is the query row of a batched step, at pos_ptr[row], over the buffers of slot
    slot_ptr[row] (slot_stride elements apart); its partials [H, splits] after the rows before it."""
    G: tl.constexpr = H // KV
    pdl_wait(PDL)
    split = tl.program_id(0)
    kvh = tl.program_id(1)
    if SLOTS:
        row = tl.program_id(2)
        base = tl.load(slot_ptr + row).to(tl.int64) * slot_stride
        k_ptr += base
        v_ptr += base
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
        sh = ring_shift(n, ring, KV, D, WINDOW)
        m_i, l_i, acc = attend(q, k_ptr + sh, v_ptr + sh, n, kvh, qpos, pos + 1, m_i, l_i, acc, scale, softcap, KV, D,
                               WINDOW, SOFTCAP, BLOCK_N, True, SCALAR, UPCAST, IEEE, RNE)
    at = head.to(tl.int64) * splits + split
    tl.store(m_ws + at, m_i, mask=r < G)
    tl.store(l_ws + at, l_i, mask=r < G)
    tl.store(acc_ws + at[:, None] * D + d[None, :], acc, mask=(r < G)[:, None])


@triton.jit(do_not_specialize=["chunk", "splits"])
def decode_combine_kernel(m_ws, l_ws, acc_ws, pos_ptr, o_ptr, chunk, splits, D: tl.constexpr, WINDOW: tl.constexpr,
                          SPLIT_BLOCK: tl.constexpr, RNE: tl.constexpr, PDL: tl.constexpr = False, g_ptr=None,
                          G_STRIDE: tl.constexpr = 0, g_row=0, H: tl.constexpr = 0):
    """Program per query head: o = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s over the splits
    that hold keys <= pos (and in the window), SPLIT_BLOCK splits at a time. G_STRIDE > 0: the
    output is sigmoid(g) * o (head h's gate at g_ptr + h * G_STRIDE), rounded as act_mul rounds.
    H > 0: program axis 1 is the row of a batched step (H heads a row; its gate g_row apart)."""
    pdl_wait(PDL)
    h = tl.program_id(0)
    if H > 0:
        row = tl.program_id(1).to(tl.int64)
        pos_ptr += row
        m_ws += row * H * splits
        l_ws += row * H * splits
        acc_ws += row * H * splits * D
        o_ptr += row * H * D
        if G_STRIDE > 0:
            g_ptr += row * g_row
    d = tl.arange(0, D)
    pos = tl.load(pos_ptr).to(tl.int32)
    used = tl.minimum(pos // chunk + 1, splits)
    first = pos * 0
    if WINDOW > 0:
        first = tl.maximum(pos - WINDOW + 1, 0) // chunk
    m_run = tl.zeros([1], dtype=tl.float32) - float("inf")
    l_run = tl.zeros([1], dtype=tl.float32)
    acc = tl.zeros([D], dtype=tl.float32)
    for s0 in range(first, used, SPLIT_BLOCK):
        s = s0 + tl.arange(0, SPLIT_BLOCK)
        ok = s < used
        at = h.to(tl.int64) * splits + s
        m = tl.load(m_ws + at, mask=ok, other=float("-inf"))
        l = tl.load(l_ws + at, mask=ok, other=0.0)
        a = tl.load(acc_ws + at[:, None] * D + d[None, :], mask=ok[:, None], other=0.0)
        m_new = tl.maximum(m_run, tl.max(m, axis=0))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp(m - m_use)
        alpha = tl.exp(m_run - m_use)
        l_run = l_run * alpha + tl.sum(w * l, axis=0)
        acc = acc * alpha + tl.sum(w[:, None] * a, axis=0)
        m_run = m_new
    dtype = o_ptr.dtype.element_ty
    out = round_to(acc / l_run, dtype, RNE)
    if G_STRIDE > 0:
        g = tl.load(g_ptr + h.to(tl.int64) * G_STRIDE + d).to(tl.float32)
        a = round_to(act_f32(g, SIGMOID), dtype, RNE).to(tl.float32)
        out = round_to(a * out.to(tl.float32), dtype, RNE)
    tl.store(o_ptr + h.to(tl.int64) * D + d, out)


# -- launching -------------------------------------------------------------------------------------

def group_of(q: torch.Tensor, k_buf: torch.Tensor) -> int:
    return q.shape[1] // k_buf.shape[1]


def run_prefill(q, k_buf, v_buf, q_start: int, kv_len: int, scale: float, window, softcap, v: Variant,
                out: torch.Tensor, ring: int | None = None) -> torch.Tensor:
    """prefill_attention into `out` [T, H, D] contiguous; `ring`: the buffers' rows when they are a ring."""
    t, h, d = q.shape
    kv = k_buf.shape[1]
    if t == 0:
        return out
    p = v.p
    pack = group_of(q, k_buf) if p.get("pack") else 1
    grid = (cdiv(t, p["bm"] // pack), h // pack)
    prefill_kernel[grid](q, k_buf, v_buf, out, t, q_start, kv_len, q.stride(0), q.stride(1), scale, softcap or 1.0,
                         ring_arg(ring, p["bn"], window), H=h, KV=kv, D=d, WINDOW=window or 0,
                         SOFTCAP=softcap is not None, BLOCK_M=p["bm"], BLOCK_N=p["bn"], PACK=pack,
                         SCALAR=p.get("scalar", False), RNE=rne_flag(q.dtype), **dot_flags(q.dtype), num_warps=p["w"],
                         num_stages=p["s"])
    return out


def prefill_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, q_start: int, kv_len: int,
                      scale: float, window: int | None, softcap: float | None,
                      v: Variant | None = None, ring: int | None = None) -> torch.Tensor:
    """Causal GQA attention of T queries at positions q_start.. over keys 0..kv_len-1 (kv_len =
    q_start + T) of the cache buffers. q [T, H, D] (last dim contiguous), k/v [capacity, KV, D]
    contiguous -> [T, H, D] contiguous in q's dtype. `v` defaults to the op's default variant. A ring
    of `ring` rows must hold every key the queries see: ring >= window - 1 + T."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if v is None:
        shape = PrefillShape(q.shape[0], q.shape[1], k_buf.shape[1], q.shape[2], window, softcap)
        v = PREFILL_OP.default(shape, _dev(q))
    return run_prefill(q, k_buf, v_buf, q_start, kv_len, scale, window, softcap, v, out, ring)


def ring_arg(ring: int | None, bn: int, window) -> int:
    """The kernels' `ring` argument: NO_RING for a plain buffer; a ring's rows, whole key blocks (only a
    sliding window's buffer is a ring: the kernels shift only where WINDOW > 0)."""
    if ring is None:
        return NO_RING
    assert window, "only a sliding window's keys live in a ring"
    assert ring % bn == 0 and ring < NO_RING, f"a ring of {ring} rows does not take key blocks of {bn}"
    return ring


def decode_splits(v: Variant, capacity: int) -> tuple[int, int]:
    """(keys per split, split count) for a buffer of `capacity` keys: fixed by the capacity, not by
    the position, so one grid serves every step of a captured graph. chunk 0 means one split."""
    bn = v.p["bn"]
    chunk = v.p["chunk"] or cdiv(capacity, bn) * bn
    return chunk, cdiv(capacity, chunk)


def decode_rows(v: Variant, group: int) -> int:
    """Query rows per program: the group padded to a power of two, at least 16 for tl.dot."""
    return next_pow2(group) if v.p.get("scalar") else max(16, next_pow2(group))


def gate_ok(q: torch.Tensor, gate: torch.Tensor) -> bool:
    """A gate the combine kernel takes: q's shape and dtype, one row, heads at a fixed stride."""
    return gate.shape == q.shape and gate.dtype == q.dtype and gate.shape[0] == 1 and gate.stride(-1) == 1


def run_decode(q, k_buf, v_buf, pos: torch.Tensor, scale: float, window, softcap, v: Variant,
               out: torch.Tensor, gate: torch.Tensor | None = None, ring: int | None = None,
               span: int | None = None) -> torch.Tensor:
    """decode_attention into `out` [1, H, D] contiguous (times sigmoid(gate) with a gate). The f32
    partials are allocated here (torch.empty is fine under graph capture: the graph's pool owns them).
    A ring (`ring` rows) splits the keys as a plain buffer of `span` positions would."""
    _, h, d = q.shape
    kv = k_buf.shape[1]
    p = v.p
    chunk, splits = decode_splits(v, k_buf.shape[0] if span is None else span)
    m_ws = torch.empty((h, splits), dtype=torch.float32, device=q.device)
    l_ws = torch.empty_like(m_ws)
    acc_ws = torch.empty((h, splits, d), dtype=torch.float32, device=q.device)
    rne = rne_flag(q.dtype)
    decode_split_kernel[(splits, kv)](q, k_buf, v_buf, pos, m_ws, l_ws, acc_ws, q.stride(1), chunk, splits, scale,
                                      softcap or 1.0, ring_arg(ring, p["bn"], window), H=h, KV=kv, D=d,
                                      WINDOW=window or 0, SOFTCAP=softcap is not None, ROWS=decode_rows(v, h // kv),
                                      BLOCK_N=p["bn"], SCALAR=p.get("scalar", False), RNE=rne, **dot_flags(q.dtype),
                                      num_warps=p["w"], num_stages=p.get("s", 2), **pdl(q))
    gated = {} if gate is None else {"g_ptr": gate, "G_STRIDE": gate.stride(1)}
    decode_combine_kernel[(h,)](m_ws, l_ws, acc_ws, pos, out, chunk, splits, D=d, WINDOW=window or 0,
                                SPLIT_BLOCK=combine_block(d), RNE=rne, num_warps=4, **pdl(q), **gated)
    return out


def decode_attention_rows(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, pos: torch.Tensor,
                          slots: torch.Tensor, scale: float, window, softcap, v: Variant,
                          gate: torch.Tensor | None = None) -> torch.Tensor:
    """One query of each of B requests in one launch pair: q [B, H, D] (row r at position pos[r], over
    keys 0..pos[r] of slot slots[r] of the pools [S, capacity, KV, D]) -> [B, H, D], each row
    bit-identical to decode_attention on its slot's buffers alone (times sigmoid(gate), gate [B, H, D]
    with unit last stride, when given)."""
    b, h, d = q.shape
    cap, kv = k_pool.shape[1], k_pool.shape[2]
    p = v.p
    chunk, splits = decode_splits(v, cap)
    m_ws = torch.empty((b, h, splits), dtype=torch.float32, device=q.device)
    l_ws = torch.empty_like(m_ws)
    acc_ws = torch.empty((b, h, splits, d), dtype=torch.float32, device=q.device)
    out = torch.empty((b, h, d), dtype=q.dtype, device=q.device)
    rne = rne_flag(q.dtype)
    decode_split_kernel[(splits, kv, b)](q, k_pool, v_pool, pos, m_ws, l_ws, acc_ws, q.stride(1), chunk, splits, scale,
                                         softcap or 1.0, NO_RING, H=h, KV=kv, D=d, WINDOW=window or 0,
                                         SOFTCAP=softcap is not None, ROWS=decode_rows(v, h // kv), BLOCK_N=p["bn"],
                                         SCALAR=p.get("scalar", False), RNE=rne, **dot_flags(q.dtype),
                                         num_warps=p["w"], num_stages=p.get("s", 2), slot_ptr=slots,
                                         slot_stride=k_pool.stride(0), stride_t=q.stride(0), SLOTS=True, **pdl(q))
    gated = {} if gate is None else {"g_ptr": gate, "G_STRIDE": gate.stride(1), "g_row": gate.stride(0)}
    decode_combine_kernel[(h, b)](m_ws, l_ws, acc_ws, pos, out, chunk, splits, D=d, WINDOW=window or 0,
                                  SPLIT_BLOCK=combine_block(d), RNE=rne, num_warps=4, H=h, **pdl(q), **gated)
    return out


def combine_block(d: int) -> int:
    """Splits combined at a time: about 4096 partial values in registers."""
    return max(1, min(64, 4096 // d))


def decode_attention(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, pos: torch.Tensor, scale: float,
                     window: int | None, softcap: float | None, v: Variant | None = None,
                     gate: torch.Tensor | None = None, ring: int | None = None,
                     span: int | None = None) -> torch.Tensor:
    """One query q [1, H, D] at the absolute position held in `pos` (int64 device tensor [1]; k/v
    at pos already written) over keys 0..pos of the buffers -> [1, H, D] (sigmoid(gate) * that
    with a gate: see gate_ok). CUDA-graph capturable: no host sync, the grid depends on k_buf.shape[0] only
    (a ring's, of `ring` rows: on `span`, the positions it is reserved for)."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if v is None:
        keys = k_buf.shape[0] if span is None else span
        v = DECODE_OP.default(DecodeShape(keys, q.shape[1], k_buf.shape[1], q.shape[2], window, softcap), _dev(q))
    return run_decode(q, k_buf, v_buf, pos, scale, window, softcap, v, out, gate, ring, span)


def _dev(t: torch.Tensor):
    return device_info(t.device)


# -- the ops: shapes, variants, inputs -------------------------------------------------------------

@dataclass(frozen=True)
class PrefillShape:
    rows: int                  # T, query tokens (runtime)
    h: int
    kv: int
    d: int
    window: int | None = None
    softcap: float | None = None
    kv_prefix: int = 0         # cached keys before the chunk in the gate's and timing's inputs

    @property
    def key(self) -> tuple:
        return (self.h, self.kv, self.d, self.window, self.softcap, self.kv_prefix)


@dataclass(frozen=True)
class DecodeShape:
    rows: int                  # context length: keys 0..rows-1, the query at rows-1 (runtime)
    h: int
    kv: int
    d: int
    window: int | None = None
    softcap: float | None = None

    @property
    def key(self) -> tuple:
        return (self.h, self.kv, self.d, self.window, self.softcap)


def attn_str(s) -> str:
    extra = (f"_win{s.window}" if s.window else "") + (f"_cap{s.softcap:g}" if s.softcap else "")
    return f"h{s.h}kv{s.kv}d{s.d}{extra}"


def tile_variant(bm: int, bn: int, w: int, s: int, pack: bool = False) -> Variant:
    """bm query rows x bn keys a step; _gqa: the rows are the group's heads of bm // group tokens."""
    return variant(f"bm{bm}_bn{bn}_w{w}_s{s}" + ("_gqa" if pack else ""), bm=bm, bn=bn, w=w, s=s, pack=pack)


def scalar_variant(bm: int, bn: int) -> Variant:
    return variant(f"scalar_bm{bm}_bn{bn}", bm=bm, bn=bn, w=4, s=1, scalar=True)


# (bm, bn, warps, stages) by head dim, none spilling much on sm_90 (ptxas): D=256 and 512
# keep q and acc [bm, D] within registers and two stages of K/V tiles within shared memory.
GPU_TILES = {
    64: [(128, 64, 4, 3), (128, 128, 8, 3), (64, 64, 4, 3), (128, 32, 4, 3), (64, 32, 4, 4), (64, 128, 4, 3)],
    128: [(128, 64, 8, 3), (128, 32, 4, 3), (64, 64, 4, 3), (128, 128, 8, 2), (64, 32, 4, 3), (128, 64, 4, 2)],
    256: [(128, 64, 8, 2), (128, 32, 8, 2), (128, 32, 8, 3), (64, 64, 8, 2), (64, 32, 4, 2), (128, 64, 8, 1),
          (64, 64, 4, 2)],
    512: [(64, 32, 8, 1), (32, 64, 8, 1), (16, 32, 4, 1), (32, 32, 8, 1), (32, 64, 8, 2), (64, 32, 8, 2)],
}
# Under the interpreter, whose cost is per program: big tiles that still take every path.
CPU_TILES = [(64, 32, 4, 1), (32, 16, 4, 1)]


def gpu_tiles(d: int) -> list:
    return GPU_TILES[max(64, d)]


def prefill_trusted(d: int, dev) -> Variant:
    """Scalar (no tl.dot), small blocks; on a GPU about 8K products a step, so D=512 stays in registers."""
    if dev.capability is None:
        return scalar_variant(32, 16)
    return scalar_variant(max(1, min(16, 8192 // (16 * d))), 16)


def shape_ok(h: int, kv: int, d: int) -> bool:
    return d in HEAD_DIMS and kv > 0 and h % kv == 0


class AttentionOp(Op):
    name = "attention"
    sources = (__file__, COMMON)
    shape_type = PrefillShape

    def accepts(self, s: PrefillShape) -> bool:
        return pow2_dim(s.d)

    def shape_str(self, s: PrefillShape) -> str:
        return f"{s.rows}x{attn_str(s)}" + (f"_pre{s.kv_prefix}" if s.kv_prefix else "")

    def with_rows(self, s: PrefillShape, rows: int) -> PrefillShape:
        return PrefillShape(rows, s.h, s.kv, s.d, s.window, s.softcap, s.kv_prefix)

    def catalogue(self, s: PrefillShape, dev) -> list[Variant]:
        tiles = CPU_TILES if dev.capability is None else gpu_tiles(s.d)
        packs = (False, True) if s.h > s.kv else (False,)
        return [tile_variant(*t, pack=pk) for t in tiles for pk in packs if not pk or t[0] >= s.h // s.kv]

    def candidates(self, s: PrefillShape, dev) -> list[Variant]:
        """No tile of many more rows than the chunk has."""
        rows = max(16, next_pow2(s.rows * (s.h // s.kv)))
        forms = [v for v in self.catalogue(s, dev) if v.p["bm"] <= rows]
        if dev.capability is not None and s.h > s.kv:
            # the GQA-packed form wins or ties at every tile (docs/compiler.md): measuring only it
            # halves the cold compile
            forms = [v for v in forms if v.p.get("pack") or v == self.trusted(s, dev)]
        return forms

    def trusted(self, s: PrefillShape, dev) -> Variant:
        return prefill_trusted(s.d, dev)

    def default(self, s: PrefillShape, dev) -> Variant:
        if dev.capability is None:
            return tile_variant(*CPU_TILES[0])
        return tile_variant(*gpu_tiles(s.d)[0])

    def inputs(self, s: PrefillShape, dtype, device, gen) -> dict:
        """q a strided view (as Qwen3.5's split of q and gate); K/V buffers with spare capacity."""
        kv_len = s.kv_prefix + s.rows
        cap = kv_len + 16
        qg = torch.randn(s.rows, s.h, 2 * s.d, generator=gen, device=device).to(dtype)
        k = torch.randn(cap, s.kv, s.d, generator=gen, device=device).to(dtype)
        v = torch.randn(cap, s.kv, s.d, generator=gen, device=device).to(dtype)
        return {"q": qg[..., : s.d], "k_buf": k, "v_buf": v, "q_start": s.kv_prefix, "kv_len": kv_len,
                "scale": s.d ** -0.5, "window": s.window, "softcap": s.softcap}

    def outputs(self, s: PrefillShape, inputs: dict) -> dict:
        q = inputs["q"]
        return {"o": torch.empty(q.shape, dtype=q.dtype, device=q.device)}

    def launch(self, v: Variant, inputs: dict, outputs: dict, plan=None) -> None:
        i = inputs
        run_prefill(i["q"], i["k_buf"], i["v_buf"], i["q_start"], i["kv_len"], i["scale"], i["window"], i["softcap"],
                    v, outputs["o"])

    def compile(self, v: Variant, s: PrefillShape, dtype, device) -> list:
        if interpreting() or v.run is not None:
            return []
        q = torch.empty((1, s.h, s.d), dtype=dtype, device=device)
        k = torch.empty((1, s.kv, s.d), dtype=dtype, device=device)
        p = v.p
        pack = s.h // s.kv if p.get("pack") else 1
        return [prefill_kernel.warmup(q, k, k, q, 1, 0, 1, s.h * s.d, s.d, 1.0, 1.0, NO_RING, H=s.h, KV=s.kv, D=s.d,
                                      WINDOW=s.window or 0, SOFTCAP=s.softcap is not None, BLOCK_M=p["bm"],
                                      BLOCK_N=p["bn"], PACK=pack, SCALAR=p.get("scalar", False), RNE=False,
                                      **dot_flags(dtype), num_warps=p["w"], num_stages=p["s"], grid=(1,))]

    def kernel_sources(self, v: Variant) -> list:
        return [prefill_kernel, key_ranges, ring_shift, attend, scores, matmul_f32, round16, tanh_f32, round_to]

    def supports(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor | None = None) -> bool:
        return supports(q, k_buf, v_buf)


def supports(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor | None = None) -> bool:
    """Shapes and layouts both attention kernels take (v_buf, when given, laid out as k_buf)."""
    v_buf = k_buf if v_buf is None else v_buf
    return (q.dtype in SUPPORTED and k_buf.dtype == q.dtype and v_buf.dtype == q.dtype and q.dim() == 3
            and k_buf.dim() == 3 and shape_ok(q.shape[1], k_buf.shape[1], q.shape[2]) and k_buf.shape == v_buf.shape
            and k_buf.shape[2] == q.shape[2] and q.stride(2) == 1 and k_buf.is_contiguous() and v_buf.is_contiguous())


def decode_variant(chunk: int, bn: int, w: int, s: int = 2) -> Variant:
    """chunk keys per split (a multiple of bn), bn keys a step."""
    return variant(f"c{chunk}_bn{bn}_w{w}_s{s}", chunk=chunk, bn=bn, w=w, s=s)


def decode_trusted_variant(bn: int) -> Variant:
    return variant(f"scalar_one_split_bn{bn}", chunk=0, bn=bn, w=4, s=1, scalar=True)


# (chunk, bn, warps): short chunks fill the GPU at short contexts, long ones cut the combine's work.
GPU_DECODE = ([(c, bn, 4) for c in (64, 128, 256, 512, 1024) for bn in (32, 64) if bn <= c]
              + [(c, 64, 8) for c in (512, 1024)] + [(c, 128, 8) for c in (256, 512, 1024, 2048)])
CPU_DECODE = [(32, 16, 4), (64, 32, 4)]


class DecodeAttentionOp(Op):
    name = "attention_decode"
    sources = (__file__, COMMON, ACTS_FILE)   # the combine's gate uses activation.act_f32
    shape_type = DecodeShape

    def accepts(self, s: DecodeShape) -> bool:
        return pow2_dim(s.d)

    def shape_str(self, s: DecodeShape) -> str:
        return f"{s.rows}x{attn_str(s)}"

    def with_rows(self, s: DecodeShape, rows: int) -> DecodeShape:
        return DecodeShape(rows, s.h, s.kv, s.d, s.window, s.softcap)

    def catalogue(self, s: DecodeShape, dev) -> list[Variant]:
        if dev.capability is None:
            return [decode_variant(*t) for t in CPU_DECODE]
        # keys of one step in registers: bn x D bf16 per tile, at most 64 KB
        return [decode_variant(c, bn, w) for c, bn, w in GPU_DECODE if bn * s.d <= 32768]

    def candidates(self, s: DecodeShape, dev) -> list[Variant]:
        """At least two keys' blocks per split, and no more than about 64 splits per SM's worth of work."""
        forms = self.catalogue(s, dev)
        if dev.capability is None:
            return forms
        return [v for v in forms if cdiv(s.rows, v.p["chunk"]) * s.kv <= 64 * dev.sms and v.p["chunk"] >= 2 * v.p["bn"]]

    def trusted(self, s: DecodeShape, dev) -> Variant:
        if dev.capability is None:
            return decode_trusted_variant(16)
        # 8 keys a step at least: on the H200 (Triton 3.6) the scalar form with 16 query rows and 1, 2
        # or 4 keys a step computes wrong values (group 16, D 256: the 122B's and 397B's attention;
        # tools/diag_attn_decode.py), the tiled forms and 8 keys and more are right
        return decode_trusted_variant(max(8, min(16, 16384 // (next_pow2(s.h // s.kv) * s.d))))

    def default(self, s: DecodeShape, dev) -> Variant:
        if dev.capability is None:
            return decode_variant(*CPU_DECODE[1])
        return decode_variant(256 if s.rows >= 4096 else 64, 64 if s.d <= 256 else 32, 4)

    def inputs(self, s: DecodeShape, dtype, device, gen) -> dict:
        """A buffer with capacity past the position (splits past it must be neutral)."""
        cap = cdiv(s.rows + 1, 256) * 256
        qg = torch.randn(1, s.h, 2 * s.d, generator=gen, device=device).to(dtype)
        k = torch.randn(cap, s.kv, s.d, generator=gen, device=device).to(dtype)
        v = torch.randn(cap, s.kv, s.d, generator=gen, device=device).to(dtype)
        pos = torch.tensor([s.rows - 1], dtype=torch.int64, device=device)
        return {"q": qg[..., : s.d], "k_buf": k, "v_buf": v, "pos": pos, "scale": s.d ** -0.5, "window": s.window,
                "softcap": s.softcap}

    def outputs(self, s: DecodeShape, inputs: dict) -> dict:
        q = inputs["q"]
        return {"o": torch.empty(q.shape, dtype=q.dtype, device=q.device)}

    def launch(self, v: Variant, inputs: dict, outputs: dict, plan=None) -> None:
        i = inputs
        run_decode(i["q"], i["k_buf"], i["v_buf"], i["pos"], i["scale"], i["window"], i["softcap"], v, outputs["o"])

    def compile(self, v: Variant, s: DecodeShape, dtype, device) -> list:
        if interpreting() or v.run is not None:
            return []
        q = torch.empty((1, s.h, s.d), dtype=dtype, device=device)
        k = torch.empty((1, s.kv, s.d), dtype=dtype, device=device)
        pos = torch.zeros(1, dtype=torch.int64, device=device)
        ws = torch.empty((s.h, 1, s.d), dtype=torch.float32, device=device)
        p = v.p
        return [decode_split_kernel.warmup(q, k, k, pos, ws, ws, ws, s.d, p["bn"], 1, 1.0, 1.0, NO_RING, H=s.h,
                                           KV=s.kv, D=s.d, WINDOW=s.window or 0, SOFTCAP=s.softcap is not None,
                                           ROWS=decode_rows(v, s.h // s.kv), BLOCK_N=p["bn"],
                                           SCALAR=p.get("scalar", False), RNE=False, **dot_flags(dtype),
                                           num_warps=p["w"], num_stages=p.get("s", 2), grid=(1,), **pdl(q)),
                decode_combine_kernel.warmup(ws, ws, ws, pos, q, p["bn"], 1, D=s.d, WINDOW=s.window or 0,
                                             SPLIT_BLOCK=combine_block(s.d), RNE=False, num_warps=4, grid=(1,),
                                             **pdl(q))]

    def kernel_sources(self, v: Variant) -> list:
        return [decode_split_kernel, decode_combine_kernel, ring_shift, attend, scores, matmul_f32, round16, tanh_f32,
                round_to, pdl_wait]

    def supports(self, q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor | None = None) -> bool:
        return supports(q, k_buf, v_buf) and q.shape[0] == 1


PREFILL_OP = register(AttentionOp())
DECODE_OP = register(DecodeAttentionOp())
