"""A one-row 16-bit GEMV in CUDA C (NVRTC), the dp4a form's layout on bf16/f16 weights.

Why: at decode the Triton GEMV forms read the small models' weights at 55-65% of HBM bandwidth
(bench/NOTES.md: 0.8b's 7168x1024 gate|up 5.2 us against 3.4 us of bytes on the H200); the GEMVs of
1024- and 2048-wide models are latency-bound, so every 16-byte load of a pass is issued before the
pass's arithmetic, and the first pass's before the PDL wait.

Layout (as kiln/ops/quant/dp4a.py): each lane owns a chunk of 8 inputs (one 16-byte load of every
row), held in f32 registers; a warp covers a slab of 32 chunks; a block's warps take the slabs of its
K split in turn and add into shared memory; R rows a pass, reduced across the warp by halving
exchanges. Per row and lane: 8 FMAs in input order, then lanes, warps and splits in a fixed order.
"""

from __future__ import annotations

import torch

from .. import cuda_common, nvrtc
from ..common import cdiv, pdl

SOURCE = cuda_common.HELPERS + r"""
// -D: N, K, BN (rows a block), WARPS, R (rows a pass), SPLIT, F16 (x and w f16, else bf16), ACT (-1: x as
// given; 0 silu, 1 sigmoid: x rows are [g | u], 2K wide, and the input is act(g) * u rounded as act_mul)
#define CH (K / 8)                       // chunks a row
#define CPS (CH / SPLIT)                 // chunks a split
#define SLABS ((CPS + 31) / 32)          // slabs a split (32 chunks, a warp's lanes)

// R rows from row r of this block's chunk (rows past N read row N-1, never stored).
__device__ __forceinline__ void load_rows(const uint4 *w, int r, int chunk, uint4 *out) {
#pragma unroll
    for (int i = 0; i < R; i++) out[i] = load_stream(w + (long long)min(r + i, N - 1) * CH + chunk);
}

__device__ __forceinline__ float dot8(uint4 w, const float *x) {
    const u32 wd[4] = {w.x, w.y, w.z, w.w};
    float acc = 0.f;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        acc = fmaf(to_f32((u16)(wd[j] & 0xFFFF)), x[2 * j], acc);
        acc = fmaf(to_f32((u16)(wd[j] >> 16)), x[2 * j + 1], acc);
    }
    return acc;
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
kiln_hgemv(const u16 *x, const uint4 *w, u16 *y, float *ws, int *counts, int M) {
    __shared__ float acc[WARPS][BN];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int n0 = blockIdx.x * BN, split = blockIdx.y;
    for (int m = 0; m < M; m++) {
        for (int i = threadIdx.x; i < WARPS * BN; i += WARPS * 32) (&acc[0][0])[i] = 0.f;
        __syncthreads();
        for (int slab = warp; slab < SLABS; slab += WARPS) {
            const int local = slab * 32 + lane;
            const bool live = local < CPS;
            const int chunk = split * CPS + (live ? local : 0);
            uint4 wv[R];
            load_rows(w, n0, chunk, wv);
            pdl_wait();            // x is the kernel before's output
            float xv[8];
            load_f32(x + (long long)m * (ACT >= 0 ? 2 * K : K) + chunk * 8, xv, 8);
#if ACT >= 0
            float u[8];
            load_f32(x + (long long)m * 2 * K + K + chunk * 8, u, 8);
#pragma unroll
            for (int i = 0; i < 8; i++) xv[i] = to_f32(from_f32(to_f32(from_f32(act_f32(xv[i]))) * u[i]));
#endif
#pragma unroll 1
            for (int r0 = 0; r0 < BN; r0 += R) {
                uint4 cw[R];
#pragma unroll
                for (int i = 0; i < R; i++) cw[i] = wv[i];
                if (r0 + R < BN) load_rows(w, n0 + r0 + R, chunk, wv);    // next pass: in flight
                float part[R];
#pragma unroll
                for (int i = 0; i < R; i++) part[i] = live ? dot8(cw[i], xv) : 0.f;
                const float total = reduce_rows(part, lane);
                if ((lane & (32 / R - 1)) == 0) acc[warp][r0 + lane / (32 / R)] += total;
            }
        }
        __syncthreads();
        pdl_wait();                // warps without a slab store too
        store_block(acc, y, ws, n0, split, m, M);
        __syncthreads();
    }
    if (SPLIT > 1) finish_splits(y, ws, counts, n0, M);
}
"""

NAME = "kiln_hgemv"
DTYPES = (torch.bfloat16, torch.float16)
_KERNELS: dict[tuple, nvrtc.Kernel] = {}


def shape_fits(n: int, k: int, bn: int, warps: int, r: int, split: int) -> bool:
    """Whole 16-byte chunks a split, at least one slab a warp, R dividing the block's rows."""
    if k % 8 or (k // 8) % split:
        return False
    slabs = cdiv(k // 8 // split, 32)
    return slabs >= warps and bn % r == 0 and r in (1, 2, 4, 8, 16, 32) and bn <= max(16, 1 << (n - 1).bit_length())


def defines(n: int, k: int, bn: int, warps: int, r: int, split: int, f16: bool, act: int = -1) -> dict:
    return {"N": n, "K": k, "BN": bn, "WARPS": warps, "R": r, "SPLIT": split, "F16": f16, "ACT": act}


def kernel(*args) -> nvrtc.Kernel:
    d = defines(*args)
    key = tuple(d.values())
    if key not in _KERNELS:
        _KERNELS[key] = nvrtc.Kernel(SOURCE, NAME, d)
    return _KERNELS[key]


def takes(x: torch.Tensor, w: torch.Tensor) -> bool:
    """16-bit x and w of one dtype, contiguous and 16-byte aligned (the kernel's 16-byte loads)."""
    return (x.dtype in DTYPES and w.dtype == x.dtype
            and all(t.data_ptr() % 16 == 0 and t.is_contiguous() for t in (x, w)))


def run(x: torch.Tensor, w: torch.Tensor, y: torch.Tensor, bn: int, warps: int, r: int, split: int, counts=None,
        warm: bool = False, act: int = -1):
    """y [M, N] = x [M, K] @ w [N, K]^T with this form (act >= 0: x [M, 2K] = [g | u] and the input
    act(g) * u, rounded as act_mul rounds); `warm`: compile (and load) only."""
    m, (n, k) = x.shape[0], w.shape
    if x.dtype not in DTYPES:
        raise ValueError(f"{NAME} reads 16-bit values, not {x.dtype}")
    kern = kernel(n, k, bn, warps, r, split, x.dtype == torch.float16, act)
    if warm:
        return kern.function(x.device)
    ws = y if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=x.device)
    kern((cdiv(n, bn), split), warps * 32, [x, w, y, ws, y if split == 1 else counts, m], pdl=pdl(x)["PDL"])
    return y
