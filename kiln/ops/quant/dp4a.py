"""A one-row quantised GEMV in CUDA C (NVRTC): integer dot products (DP4A) on the packed values.

Why: the Triton forms stream a 4-bit weight at 45-55% of HBM bandwidth on the 9B's shapes
(bench/NOTES.md, 2026-12-02); in f32 each value costs a shift, a mask and an FMA, about 100 issue
slots for every 16 bytes of words, close to what the SMs can issue at 4.27 TB/s. Here four values
cost one DP4A: a 16-byte load's eight nibble words (w & 0x0F0F0F0F and (w >> 4) & 0x0F0F0F0F) meet
x as bytes.

x is made integer once a lane: each lane owns a chunk of VPL consecutive inputs (one 16-byte load
of every row) and writes them as v = round(x * 2^(14 - e)), e the exponent of the chunk's largest
|x|, in two byte digits (v = 256 hi + lo, hi signed, lo unsigned). bf16 and f16 inputs whose
exponent is within 7 (bf16) or 4 (f16) of the chunk's largest are exact; smaller ones are within
2^-16 of that largest, far inside the reference's own rounding of every weight to bf16. Per row and
chunk: dot = 256 dp4a(q, hi) + dp4a(q, lo), exact in int32; the chunk adds
scale * unit * dot + bias * sum(x) in f32 (sum(x) exact in f32 order), as the FMA form does.

Layout: a warp covers a slab of 32 chunks of every row of its block, its lanes' digits held in
registers; a block's warps take the slabs of its K split in turn and add into shared memory; R rows a
pass (R 16-byte loads in flight a lane), their lane partials reduced across the warp by halving
exchanges (R - 1 + log2(32 / R) shuffles for R rows). Split-K over grid.y finishes serially (the
last block to arrive adds the splits in order), as gemv_splitk_finish does.
"""

from __future__ import annotations

import torch

from .. import cuda_common, nvrtc
from ..common import cdiv, pdl

SOURCE = cuda_common.HELPERS + r"""
// -D: N, K, G, BITS (4 or 8), BN (rows a block), WARPS, R (rows a pass), SPLIT, F16 (x is f16, else bf16),
// ACT (-1: x as given; 0 silu, 1 sigmoid: x rows are [g | u], 2K wide, and the input is act(g) * u),
// NORM (0: none; 1: the input is rmsnorm(x); 2: rmsnorm(s), s = round(x + r) written by block (0, 0)), STYLE
// (the norm's weight: 0 llama, 1 offset, 2 plain, as norm/kernels.py's style_scaled),
// PAIRS (routed experts: blockIdx.z the (token, slot) pair, the weights expert idx[pair] of [E, N, K]
// stacks, x row pair / XDIV, y row pair, M 1, no split), RW (the pair's output weighted by its routing
// weight rw[pair] as moe/kernels.py's `weighted`: 0 none, 1 16-bit as x, 2 f32), IDX32 (idx int32, else
// int64), HOST (a negative idx names row -1 - idx of the second stacks hq, hs, hb: streamed experts' misses),
// EPI (ACT in the epilogue: the weight is [gate; up], N = 2I rows, y [M, I] = act(x Wg^T) * (x Wu^T); a block
// takes BN / 2 gate rows and the same up rows), NOUT (the add + norm in the epilogue: once every block has stored
// y = x W^T (N the hidden size), the last to arrive writes s = round(y + r) into sum_out and rmsnorm(s) over y,
// as the rmsnorm kernel with its add computes them; r is `res` [M, N], the norm's weight `nw` [N], STYLE)
#define VPL (128 / BITS)                 // values a lane's 16-byte load holds: its chunk
#define CH (K / VPL)                     // chunks a row
#define CPS (CH / SPLIT)                 // chunks a split
#define SLABS ((CPS + 31) / 32)          // slabs a split (32 chunks, a warp's lanes)
#define NW (VPL / 4)                     // digit words a chunk (4 bytes each)
#define GROUPS (K / G)
#define PRO_ACT (ACT >= 0 && EPI == 0)  // x rows are [g | u]: the input is act(g) * u
#define BROWS (EPI ? BN / 2 : BN)        // outputs a block
static_assert(NORM == 0 || SLABS >= WARPS, "row_rstd's barrier needs every warp in its first slab");
static_assert(PAIRS == 0 || (SPLIT == 1 && NORM == 0), "routed experts: no split, no norm prologue");
static_assert(RW == 0 || PAIRS, "a routing weight is a pair's");
static_assert(HOST == 0 || PAIRS, "second stacks are a pair's");
static_assert(NOUT == 0 || (NORM == 0 && ACT < 0 && PAIRS == 0 && N % 8 == 0), "the norm epilogue: a plain GEMV");
static_assert(EPI == 0 || (ACT >= 0 && NORM == 0 && PAIRS == 0 && BN % 2 == 0 && N % 2 == 0),
              "the act epilogue: an activation, no norm, no pairs, half the block's rows each of gate and up");

__device__ __forceinline__ int dp4a_us(u32 a, u32 b, int c) {     // a unsigned bytes, b signed bytes
    int d; asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d;
}

__device__ __forceinline__ u32 dp4a_uu(u32 a, u32 b, u32 c) {
    u32 d; asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c)); return d;
}

// The byte of value i of a chunk in the digit words: 4-bit values pair with the nibble words
// (word j's low nibbles are values 8j, 8j+2, 8j+4, 8j+6; its high ones 8j+1, ...), 8-bit ones in order.
__device__ __forceinline__ int slot_of(int i) {
#if BITS == 4
    return (i / 8) * 8 + (i % 2) * 4 + (i % 8) / 2;
#else
    return i;
#endif
}

// normed * w rounded as the style says (norm/kernels.py's style_scaled).
__device__ __forceinline__ float styled(float normed, float w) {
#if STYLE == 0
    return to_f32(from_f32(to_f32(from_f32(normed)) * w));
#elif STYLE == 1
    return to_f32(from_f32(normed * (1.0f + w)));
#else
    return to_f32(from_f32(normed * w));
#endif
}

// n values of the norm's source at column c of row xm: x, or s = round(x + r) (NORM 2).
__device__ __forceinline__ void norm_source(const u16 *xm, const u16 *rm, int c, float *v, int n) {
    load_f32(xm + c, v, n);
#if NORM == 2
    float r[VPL > 8 ? VPL : 8];
    load_f32(rm + c, r, n);
#pragma unroll
    for (int i = 0; i < n; i++) v[i] = to_f32(from_f32(v[i] + r[i]));
#endif
}

__device__ __forceinline__ void store8(u16 *p, const float *v) {     // 8 values rounded, one 16-byte store
    u32 h[4];
#pragma unroll
    for (int j = 0; j < 4; j++) h[j] = (u32)from_f32(v[2 * j]) | ((u32)from_f32(v[2 * j + 1]) << 16);
    *(uint4 *)p = make_uint4(h[0], h[1], h[2], h[3]);
}

// rstd from each thread's partial sum of squares of an n-wide row, as the rmsnorm kernel computes it: f32
// sums (lanes by halving exchanges, then warps in order), div.full by n, rsqrt.approx. Every thread calls it.
__device__ float block_rstd(float sq, float n, float eps) {
    __shared__ float red[WARPS];
#pragma unroll
    for (int off = 16; off >= 1; off /= 2) sq += __shfl_xor_sync(0xffffffffu, sq, off);
    if (threadIdx.x % 32 == 0) red[threadIdx.x / 32] = sq;
    __syncthreads();
    float total = 0.f, mean, rstd;
#pragma unroll
    for (int v = 0; v < WARPS; v++) total += red[v];
    __syncthreads();
    asm("div.full.f32 %0, %1, %2;" : "=f"(mean) : "f"(total), "f"(n));
    asm("rsqrt.approx.f32 %0, %1;" : "=f"(rstd) : "f"(mean + eps));
    return rstd;
}

// rstd of the norm's source row, every thread of the block taking part (all are in their first slab).
// Block (0, 0) (`store`) writes s = round(x + r) as it goes.
__device__ float row_rstd(const u16 *xm, const u16 *rm, u16 *sm, bool store, float eps) {
    float sq = 0.f;
    for (int c = threadIdx.x; c < K / 8; c += WARPS * 32) {
        float v[8];
        norm_source(xm, rm, c * 8, v, 8);
#if NORM == 2
        if (store) store8(sm + c * 8, v);
#endif
#pragma unroll
        for (int i = 0; i < 8; i++) sq += v[i] * v[i];
    }
    return block_rstd(sq, (float)K, eps);
}

// Lane's chunk of row m's x as digits (hi signed, lo unsigned), its unit and its sum; through the norm
// (rstd, weights nw, residual row rm) where NORM says.
__device__ __forceinline__ void digits(const u16 *x, const u16 *rm, const u16 *nw, float rstd, int chunk, u32 *hi,
                                       u32 *lo, float &unit, float &xs) {
    float v[VPL];
#if NORM > 0
    norm_source(x, rm, chunk * VPL, v, VPL);
    float wn[VPL];
    load_f32(nw + chunk * VPL, wn, VPL);
#pragma unroll
    for (int i = 0; i < VPL; i++) v[i] = styled(v[i] * rstd, wn[i]);
#else
    load_f32(x + chunk * VPL, v, VPL);
#endif
#if PRO_ACT                   // x is [g | u]: the input is round(round(act(g)) * u), where act_mul rounds
    float u[VPL];
    load_f32(x + K + chunk * VPL, u, VPL);
#pragma unroll
    for (int i = 0; i < VPL; i++) v[i] = to_f32(from_f32(to_f32(from_f32(act_f32(v[i]))) * u[i]));
#endif
    float amax = 0.f;
    xs = 0.f;
#pragma unroll
    for (int i = 0; i < VPL; i++) { amax = fmaxf(amax, fabsf(v[i])); xs += v[i]; }
    int e = (int)((__float_as_uint(amax) >> 23) & 0xFF);         // biased exponent (0: zero or subnormal)
    int sh = 141 - e;                                              // 14 - (e - 127)
    float f1 = sh > 100 ? 0x1p100f : 1.f;
    int sh2 = sh > 100 ? sh - 100 : sh;
    float f2 = __uint_as_float((u32)(sh2 + 127) << 23);
    unit = (sh > 100 ? 0x1p-100f : 1.f) * __uint_as_float((u32)(127 - sh2) << 23);
#pragma unroll
    for (int j = 0; j < NW; j++) { hi[j] = 0u; lo[j] = 0u; }
#pragma unroll
    for (int i = 0; i < VPL; i++) {
        int q = __float2int_rn(v[i] * f1 * f2);                    // |q| <= 32640 for bf16 and f16 x
        int s = slot_of(i);
        hi[s / 4] |= ((u32)(q >> 8) & 0xFFu) << (8 * (s % 4));
        lo[s / 4] |= ((u32)q & 0xFFu) << (8 * (s % 4));
    }
}

// The weight row of the block's row t (n0 its first output): row n0 + t, or with EPI the gate rows n0.. in the
// block's first half and the same up rows (N / 2 + n0..) in its second; rows past the end read the last.
__device__ __forceinline__ long long row_at(int n0, int t) {
#if EPI
    return (long long)(t < BN / 2 ? 0 : N / 2) + min(n0 + t % (BN / 2), N / 2 - 1);
#else
    return min(n0 + t, N - 1);
#endif
}

// R rows from the block's row t of this chunk: words, scales, biases (rows past the end are never stored).
__device__ __forceinline__ void load_rows(const uint4 *q, const u16 *s, const u16 *b, int n0, int t, int chunk,
                                          int grp, uint4 *w, float *sc, float *bi) {
#pragma unroll
    for (int i = 0; i < R; i++) {
        const long long n = row_at(n0, t + i);
        w[i] = load_stream(q + n * (K * BITS / 128) + chunk);
        sc[i] = to_f32(s[n * GROUPS + grp]);
        bi[i] = to_f32(b[n * GROUPS + grp]);
    }
}

// Whether this block is the last of `total` to arrive at *count (every thread calls it; the last one's
// threads then see every block's writes, and reset the count for the next launch).
__device__ bool arrived_last(int *count, int total) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(count, 1) == total - 1;
    __syncthreads();
    if (last) __threadfence();
    return last;
}

#if EPI
// round(round(act(g)) * u) of the GEMV's rounded outputs g, u: act_mul's roundings
__device__ __forceinline__ u16 act_out(float g, float u) {
    return from_f32(to_f32(from_f32(act_f32(to_f32(from_f32(g))))) * to_f32(from_f32(u)));
}

// store_block with the act epilogue: each output's gate and up sums (warps in order, as store_block adds),
// or its split's partials of both in ws [SPLIT, M, N]
__device__ __forceinline__ void store_act(float (*acc)[BN], u16 *y, float *ws, int n0, int split, int m, int M) {
    for (int t = threadIdx.x; t < BN / 2; t += WARPS * 32) {
        const int o = n0 + t;
        float g = 0.f, u = 0.f;
#pragma unroll
        for (int v = 0; v < WARPS; v++) { g += acc[v][t]; u += acc[v][t + BN / 2]; }
        if (o >= N / 2) continue;
        if (SPLIT == 1) { y[(long long)m * (N / 2) + o] = act_out(g, u); continue; }
        ws[((long long)split * M + m) * N + o] = g;
        ws[((long long)split * M + m) * N + N / 2 + o] = u;
    }
}

// finish_splits with the act epilogue: the last block to arrive adds each output's gate and up splits in order
__device__ void finish_act(u16 *y, const float *ws, int *counts, int n0, int M) {
    if (!arrived_last(&counts[blockIdx.x], SPLIT)) return;
    for (int m = 0; m < M; m++)
        for (int t = threadIdx.x; t < BN / 2 && n0 + t < N / 2; t += WARPS * 32) {
            float g = 0.f, u = 0.f;
            for (int sp = 0; sp < SPLIT; sp++) {
                g += __ldcg(ws + ((long long)sp * M + m) * N + n0 + t);
                u += __ldcg(ws + ((long long)sp * M + m) * N + N / 2 + n0 + t);
            }
            y[(long long)m * (N / 2) + n0 + t] = act_out(g, u);
        }
    if (threadIdx.x == 0) counts[blockIdx.x] = 0;
}
#endif

#if NOUT
// 8 16-bit values of a 16-byte word as f32
__device__ __forceinline__ void unpack8(uint4 u, float *v) {
    const u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int j = 0; j < 4; j++) { v[2 * j] = to_f32((u16)(w[j] & 0xFFFF)); v[2 * j + 1] = to_f32((u16)(w[j] >> 16)); }
}

#define OCH (N / 8)                                    // 16-byte chunks of an output row
#define CPT ((OCH + WARPS * 32 - 1) / (WARPS * 32))    // a thread's chunks of it
static_assert(CPT <= NOUT_CHUNKS, "the norm epilogue holds a thread's chunks of the row in registers");

// The norm epilogue: the last block to arrive at counts[gridDim.x] (every block's stores and split finishes done)
// writes s = round(y + r) and then rmsnorm(s) over y, each thread's squares summed over its chunks in order. Why
// registers: a thread's y, r and norm weights are loaded in one round trip and its s kept, not read back; the first
// form (a loop of dependent L2 loads, s re-read) made the tail ~3.7 us on an H100 (bench/NOTES.md, 2026-12-06).
__device__ void finish_norm(u16 *y, const u16 *r, u16 *so, const u16 *nw, float eps, int *counts, int M) {
    if (!arrived_last(&counts[gridDim.x], gridDim.x * gridDim.y)) return;
    for (int m = 0; m < M; m++) {
        u16 *ym = y + (long long)m * N, *sm = so + (long long)m * N;
        const uint4 *rm = (const uint4 *)(r + (long long)m * N);
        uint4 yv[CPT], rv[CPT], wv[CPT];
#pragma unroll
        for (int i = 0; i < CPT; i++) {
            const int c = threadIdx.x + i * WARPS * 32;
            if (c < OCH) { yv[i] = __ldcg((const uint4 *)ym + c); rv[i] = rm[c]; wv[i] = ((const uint4 *)nw)[c]; }
        }
        float v[CPT][8], sq = 0.f;
#pragma unroll
        for (int i = 0; i < CPT; i++) {
            const int c = threadIdx.x + i * WARPS * 32;
            if (c >= OCH) continue;
            float rr[8];
            unpack8(yv[i], v[i]);
            unpack8(rv[i], rr);
#pragma unroll
            for (int j = 0; j < 8; j++) { v[i][j] = to_f32(from_f32(v[i][j] + rr[j])); sq += v[i][j] * v[i][j]; }
            store8(sm + c * 8, v[i]);
        }
        const float rstd = block_rstd(sq, (float)N, eps);
#pragma unroll
        for (int i = 0; i < CPT; i++) {
            const int c = threadIdx.x + i * WARPS * 32;
            if (c >= OCH) continue;
            float wn[8];
            unpack8(wv[i], wn);
#pragma unroll
            for (int j = 0; j < 8; j++) v[i][j] = styled(v[i][j] * rstd, wn[j]);
            store8(ym + c * 8, v[i]);
        }
    }
    if (threadIdx.x == 0) counts[gridDim.x] = 0;
}
#endif

#if RW
__device__ __forceinline__ float rw_at(const void *rw, long long pair) {
#if RW == 2
    return ((const float *)rw)[pair];
#else
    return to_f32(((const u16 *)rw)[pair]);
#endif
}

// store_block for one pair's row: the output rounded, times the routing weight in f32, rounded
__device__ __forceinline__ void store_weighted(float (*acc)[BN], u16 *y, int n0, float w) {
    for (int t = threadIdx.x; t < BN; t += WARPS * 32) {
        const int n = n0 + t;
        float sum = 0.f;
#pragma unroll
        for (int v = 0; v < WARPS; v++) sum += acc[v][t];
        if (n < N) y[n] = from_f32(to_f32(from_f32(sum)) * w);
    }
}
#endif

extern "C" __global__ void __launch_bounds__(WARPS * 32)
kiln_qgemv_dp4a(const u16 *x, const uint4 *q, const u16 *s, const u16 *b, u16 *y, float *ws, int *counts, int M,
                const u16 *nw, const u16 *res, u16 *sum_out, float eps, const void *idx, const void *rw,
                const uint4 *hq, const u16 *hs, const u16 *hb) {
    __shared__ float acc[WARPS][BN];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int n0 = blockIdx.x * BROWS, split = blockIdx.y;
    const bool store = blockIdx.x == 0 && blockIdx.y == 0;
#if PAIRS
    pdl_wait();            // the expert ids are the router's output, written by the kernel just before
    const long long pair = blockIdx.z;
    long long e = IDX32 ? (long long)((const int *)idx)[pair] : ((const long long *)idx)[pair];
#if HOST
    if (e < 0) { q = hq; s = hs; b = hb; e = -1 - e; }
#endif
    q += e * ((long long)N * (K * BITS / 128));
    s += e * ((long long)N * GROUPS);
    b += e * ((long long)N * GROUPS);
    x += pair / XDIV * (long long)(PRO_ACT ? 2 * K : K);
    y += pair * N;
#endif
    for (int m = 0; m < M; m++) {
        const u16 *rm = res + (long long)m * K;
        float rstd = 0.f;
        for (int i = threadIdx.x; i < WARPS * BN; i += WARPS * 32) (&acc[0][0])[i] = 0.f;
        __syncthreads();
        for (int slab = warp; slab < SLABS; slab += WARPS) {
            const int local = slab * 32 + lane;
            const bool live = local < CPS;
            const int chunk = split * CPS + (live ? local : 0);
            const int grp = chunk * VPL / G;
            uint4 w[R];
            float sc[R], bi[R];
            load_rows(q, s, b, n0, 0, chunk, grp, w, sc, bi);
            pdl_wait();            // x is the kernel before's output
#if NORM > 0
            if (slab == warp) rstd = row_rstd(x + (long long)m * K, rm, sum_out + (long long)m * K, store, eps);
#endif
            u32 hi[NW], lo[NW];
            float unit, xs;
            digits(x + (long long)m * (PRO_ACT ? 2 * K : K), rm, nw, rstd, chunk, hi, lo, unit, xs);
#pragma unroll 1
            for (int r0 = 0; r0 < BN; r0 += R) {
                uint4 cw[R];
                float csc[R], cbi[R];
#pragma unroll
                for (int i = 0; i < R; i++) { cw[i] = w[i]; csc[i] = sc[i]; cbi[i] = bi[i]; }
                if (r0 + R < BN) load_rows(q, s, b, n0, r0 + R, chunk, grp, w, sc, bi);   // next pass: in flight
                float part[R];
#pragma unroll
                for (int i = 0; i < R; i++) {
                    u32 wd[4] = {cw[i].x, cw[i].y, cw[i].z, cw[i].w};
                    int dh = 0;
                    u32 dl = 0u;
#pragma unroll
                    for (int j = 0; j < 4; j++) {
#if BITS == 4
                        u32 a0 = wd[j] & 0x0F0F0F0Fu, a1 = (wd[j] >> 4) & 0x0F0F0F0Fu;
                        dh = dp4a_us(a0, hi[2 * j], dh);
                        dh = dp4a_us(a1, hi[2 * j + 1], dh);
                        dl = dp4a_uu(a0, lo[2 * j], dl);
                        dl = dp4a_uu(a1, lo[2 * j + 1], dl);
#else
                        dh = dp4a_us(wd[j], hi[j], dh);
                        dl = dp4a_uu(wd[j], lo[j], dl);
#endif
                    }
                    const float dot = (float)(dh * 256 + (int)dl);
                    part[i] = live ? fmaf(csc[i], unit * dot, cbi[i] * xs) : 0.f;
                }
                const float total = reduce_rows(part, lane);
                if ((lane & (32 / R - 1)) == 0) acc[warp][r0 + lane / (32 / R)] += total;
            }
        }
        __syncthreads();
        pdl_wait();                // warps without a slab store too
#if RW
        store_weighted(acc, y, n0, rw_at(rw, pair));
#elif EPI
        store_act(acc, y, ws, n0, split, m, M);
#else
        store_block(acc, y, ws, n0, split, m, M);
#endif
        __syncthreads();
    }
#if EPI
    if (SPLIT > 1) finish_act(y, ws, counts, n0, M);
#else
    if (SPLIT > 1) finish_splits(y, ws, counts, n0, M);
#endif
#if NOUT
    finish_norm(y, res, sum_out, nw, eps, counts, M);
#endif
}
"""

NAME = "kiln_qgemv_dp4a"
NOUT_CHUNKS = 8     # the norm epilogue's 16-byte chunks of the output row a thread at most (in registers)
BITS = (4, 8)
_KERNELS: dict[tuple, nvrtc.Kernel] = {}


def shape_fits(n: int, k: int, bits: int, group: int, bn: int, warps: int, r: int, split: int) -> bool:
    """A lane's chunk (one 16-byte load) inside one group; whole chunks a split; at least one slab a
    warp; R rows a pass dividing the block's rows."""
    vpl = 128 // bits if bits in BITS else 0
    if not vpl or k % vpl or group % vpl or k % group:
        return False
    chunks = k // vpl
    slabs = cdiv(chunks // split, 32) if chunks % split == 0 else 0
    return slabs >= warps and bn % r == 0 and r in (1, 2, 4, 8, 16, 32) and bn <= max(16, 1 << (n - 1).bit_length())


def defines(n: int, k: int, bits: int, group: int, bn: int, warps: int, r: int, split: int, f16: bool,
            act: int = -1, norm: int = 0, style: int = 0, xdiv: int = 0, rw: int = 0, idx32: bool = False,
            host: bool = False, epi: bool = False, nout: bool = False) -> dict:
    return {"N": n, "K": k, "G": group, "BITS": bits, "BN": bn, "WARPS": warps, "R": r, "SPLIT": split, "F16": f16,
            "ACT": act, "NORM": norm, "STYLE": style, "PAIRS": int(xdiv > 0), "XDIV": max(xdiv, 1), "RW": rw,
            "IDX32": int(idx32), "HOST": int(host), "EPI": int(epi), "NOUT": int(nout), "NOUT_CHUNKS": NOUT_CHUNKS}


def kernel(*args, **kw) -> nvrtc.Kernel:
    """The compiled form for `defines`' arguments (cached a process)."""
    d = defines(*args, **kw)
    key = tuple(d.values())
    if key not in _KERNELS:
        _KERNELS[key] = nvrtc.Kernel(SOURCE, NAME, d)
    return _KERNELS[key]


def takes(x: torch.Tensor, *ts: torch.Tensor) -> bool:
    """x 16-bit; x and the other tensors contiguous and 16-byte aligned (the kernel's 16-byte loads)."""
    return x.dtype in (torch.bfloat16, torch.float16) and all(t.data_ptr() % 16 == 0 and t.is_contiguous()
                                                               for t in (x, *ts))


def weights_take(x: torch.Tensor, w) -> bool:
    """The kernel reads scales and biases as x's 16-bit type (F16): a weight whose are another dtype
    (a GGUF's kept-quantised f32 scales) takes the fma forms."""
    return w.scales.dtype == w.biases.dtype == x.dtype


def run(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, biases: torch.Tensor, bits: int, group: int,
        y: torch.Tensor, bn: int, warps: int, r: int, split: int, counts=None, warm: bool = False, act: int = -1,
        norm: dict | None = None, epi: bool = False, norm_out: dict | None = None):
    """y [M, N] = x [M, K] @ dequantize(w)^T with this form (act >= 0: x [M, 2K] = [g | u] and the
    input act(g) * u, rounded as act_mul rounds; norm {w, eps, style (an index of STYLES)[, r, s]}: the
    input rmsnorm(x), or rmsnorm(x + r) with s = x + r written, rounded as the rmsnorm kernel rounds);
    `epi` (with act >= 0): w is [gate; up] and y [M, N / 2] = act(gate) * up, rounded as act_mul rounds
    the plain form's outputs; norm_out {w, r, s, eps, style (an index of STYLES)}: y [M, N] is written as
    rmsnorm(s) and s = y + r, rounded as the rmsnorm kernel with its add rounds them (`counts` given,
    cdiv(N, bn) + 1 of them); `warm`: compile (and load) only."""
    m, n, k = x.shape[0], packed.shape[0], packed.shape[1] * 32 // bits
    if x.dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"{NAME} reads 16-bit x, not {x.dtype}")
    norm_kind = 0 if norm is None else 1 if norm.get("r") is None else 2
    assert norm_kind != 2 or norm.get("s") is not None, "a residual add writes s = x + r: pass s"
    assert norm_out is None or (norm is None and act < 0 and counts is not None), "the norm epilogue: a plain GEMV"
    style = norm["style"] if norm is not None else norm_out["style"] if norm_out is not None else 0
    kern = kernel(n, k, bits, group, bn, warps, r, split, x.dtype == torch.float16, act, norm_kind, style, epi=epi,
                  nout=norm_out is not None)
    if warm:
        return kern.function(x.device)
    blocks = cdiv(n // 2, bn // 2) if epi else cdiv(n, bn)
    ws = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    counts = y if split == 1 and norm_out is None else counts
    pro = [y, y, y, 0.0] if norm is None else [norm["w"], norm["r"] if norm_kind == 2 else y,
                                               norm["s"] if norm_kind == 2 else y, float(norm["eps"])]
    if norm_out is not None:
        pro = [norm_out["w"], norm_out["r"], norm_out["s"], float(norm_out["eps"])]
    kern((blocks, split), warps * 32, [x, packed, scales, biases, y, ws, counts, m, *pro, y, y, y, y, y],
         pdl=pdl(x)["PDL"])
    return y


def pairs_take(x: torch.Tensor, stack, idx: torch.Tensor, rw: torch.Tensor | None, host=None) -> bool:
    """run_pairs takes these: x 16-bit, the [E, N, K] stacks' tensors (`host`'s too, where given) and x
    contiguous and 16-byte aligned, int64 or int32 expert ids, routing weights in x's dtype or f32."""
    stacks = (stack,) if host is None else (stack, host)
    return (all(takes(x, w.packed, w.scales, w.biases) and weights_take(x, w) and w.packed.dim() == 3
                and w.bits in BITS for w in stacks)
            and (host is None or (host.packed.shape[1:] == stack.packed.shape[1:] and host.bits == stack.bits
                                  and host.group_size == stack.group_size))     # (scale dtypes: weights_take)
            and idx.dtype in (torch.int64, torch.int32) and idx.is_contiguous()
            and (rw is None or (rw.is_contiguous() and rw.dtype in (x.dtype, torch.float32))))


def run_pairs(x: torch.Tensor, stack, idx: torch.Tensor, y: torch.Tensor, bn: int, warps: int, r: int, xdiv: int,
              act: int = -1, rw: torch.Tensor | None = None, warm: bool = False, host=None):
    """Routed experts, one launch: y[pair] = pro(x[pair // xdiv]) @ dequantize(stack[idx[pair]])^T for
    every pair of idx (flattened, int64 or int32), each weighted by rw[pair] when given (the output
    rounded, times the weight, rounded: moe/kernels.py's `weighted`); act >= 0: x rows [g | u] and the
    input act(g) * u. `host`: a stack like `stack` (device scratch, or mapped host memory) whose row
    -1 - idx[pair] a negative id names. The form (bn, warps, r) unsplit; `warm`: compile (and load) only."""
    n, k = stack.packed.shape[1], stack.packed.shape[2] * 32 // stack.bits
    rw_kind = 0 if rw is None else 2 if rw.dtype == torch.float32 else 1
    kern = kernel(n, k, stack.bits, stack.group_size, bn, warps, r, 1, x.dtype == torch.float16, act,
                  xdiv=xdiv, rw=rw_kind, idx32=idx.dtype == torch.int32, host=host is not None)
    if warm:
        return kern.function(x.device)
    if idx.numel():
        second = [y, y, y] if host is None else [host.packed, host.scales, host.biases]
        kern((cdiv(n, bn), 1, idx.numel()), warps * 32,
             [x, stack.packed, stack.scales, stack.biases, y, y, y, 1, y, y, y, 0.0, idx, y if rw is None else rw,
              *second], pdl=pdl(x)["PDL"])
    return y
