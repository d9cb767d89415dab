"""The routed experts' GEMVs at decode on 16-bit stacks in CUDA C (NVRTC): the one-row GEMV of
kiln/ops/gemm/hgemv.py in a pair mode, one launch for every (token, slot) pair's expert.

Why: the moe op's Triton GEMV forms stream the 35B-A3B's experts at about 58% of the H200's bandwidth
(one decode token's routed experts, 48 MB in bf16: 19.24 us against 11.2 us of bytes, the tuner's
choice at 11bd38c's moe runs, bench/results/h200_tune_cache_moe_*), 40 of them a token. The 4-bit
stacks' pair mode on the dp4a GEMV took the 4-bit 35B from 489 to 558 tok/s on an H100
(bench/NOTES.md, 2026-12-06); this is the same for 16-bit weights.

Two launches and the moe op's combine: gate_up pairs, y1[pair] = x[pair // k] @ gate_up[idx[pair]]^T
([pair, 2I], rounded), then down pairs with act(g) * u computed as x is loaded (rounded as act_mul) and
each output rounded, times the pair's routing weight in f32, rounded (moe/kernels.py's `weighted`),
y[pair] ([pair, H]); kernels.combine adds each token's rows in expert id order. The same roundings as
the Triton forms and MoeReference; the products' f32 sums in hgemv's order (lanes, warps).

Layout as hgemv (a lane's 16-byte chunk of 8 inputs, a warp's slab of 32 chunks, a block's warps over
the slabs, R rows a pass), without split-K; grid (row blocks, 1, pairs). The expert id is the router's
output, written by the kernel just before: the wait comes first, then the weights' loads.
"""

from __future__ import annotations

import os

import torch

from .. import nvrtc
from ..common import cdiv, pdl
from ..gemm import hgemv

SOURCE = hgemv.SOURCE + r"""
// -D (besides hgemv's, SPLIT 1): XDIV (x row pair / XDIV), RW (the output times the pair's routing weight:
// 0 none, 1 16-bit as x, 2 f32), IDX32 (ids int32, else int64). N, K: one expert's [N, K] weight.
__device__ __forceinline__ float pair_weight(const void *rw, long long pair) {
#if RW == 2
    return ((const float *)rw)[pair];
#else
    return to_f32(((const u16 *)rw)[pair]);
#endif
}

extern "C" __global__ void __launch_bounds__(WARPS * 32)
kiln_hgemv_pairs(const u16 *x, const uint4 *w, const void *idx, const void *rw, u16 *y) {
    __shared__ float acc[WARPS][BN];
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    const int n0 = blockIdx.x * BN;
    const long long pair = blockIdx.z;
    pdl_wait();            // the expert ids (and x) are the kernels' before
    const long long e = IDX32 ? (long long)((const int *)idx)[pair] : ((const long long *)idx)[pair];
    w += e * ((long long)N * CH);
    x += pair / XDIV * (long long)(ACT >= 0 ? 2 * K : K);
    for (int i = threadIdx.x; i < WARPS * BN; i += WARPS * 32) (&acc[0][0])[i] = 0.f;
    __syncthreads();
    for (int slab = warp; slab < SLABS; slab += WARPS) {
        const int local = slab * 32 + lane;
        const bool live = local < CPS;
        const int chunk = live ? local : 0;
        uint4 wv[R];
        load_rows(w, n0, chunk, wv);
        float xv[8];
        load_f32(x + chunk * 8, xv, 8);
#if ACT >= 0
        float u[8];
        load_f32(x + K + chunk * 8, u, 8);
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
#if RW
    const float rwt = pair_weight(rw, pair);
#endif
    for (int t = threadIdx.x; t < BN; t += WARPS * 32) {
        const int n = n0 + t;
        float sum = 0.f;
#pragma unroll
        for (int v = 0; v < WARPS; v++) sum += acc[v][t];
#if RW
        sum = to_f32(from_f32(sum)) * rwt;
#endif
        if (n < N) y[pair * N + n] = from_f32(sum);
    }
}
"""

NAME = "kiln_hgemv_pairs"
def pairs_on() -> bool:
    """KILN_MOE_PAIRS=1 offers the pair forms to the tuner (off until their GPU tests and a measurement have run:
    written on 2026-12-06 without device time; tools/session_2026_12_06_set.sh)."""
    return os.environ.get("KILN_MOE_PAIRS", "0") == "1"


ACTS = {"silu": 0}          # act(g) * u as the down's prologue computes it (cuda_common.act_f32)
_KERNELS: dict[tuple, nvrtc.Kernel] = {}


def kernel(n: int, k: int, bn: int, warps: int, r: int, f16: bool, act: int, xdiv: int, rw: int,
           idx32: bool) -> nvrtc.Kernel:
    d = hgemv.defines(n, k, bn, warps, r, 1, f16, act) | {"XDIV": xdiv, "RW": rw, "IDX32": int(idx32)}
    key = tuple(d.values())
    if key not in _KERNELS:
        _KERNELS[key] = nvrtc.Kernel(SOURCE, NAME, d)
    return _KERNELS[key]


def fits(n: int, k: int, form: tuple) -> bool:
    """A form (bn, warps, r) for one expert's [n, k] weight: hgemv's rule, unsplit."""
    return hgemv.shape_fits(n, k, *form, 1)


def warps_for(k: int, warps: int) -> int:
    """warps cut to the slabs of a K-wide row (every warp takes at least one slab)."""
    return max(1, min(warps, cdiv(k // 8, 32)))


def takes(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, act: str) -> bool:
    """16-bit x and stacks of its dtype, contiguous and 16-byte aligned, an activation the prologue computes."""
    return (act in ACTS and x.dtype in hgemv.DTYPES and gate_up.dtype == down.dtype == x.dtype
            and gate_up.dim() == down.dim() == 3
            and all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (x, gate_up, down)))


def run_pairs(x: torch.Tensor, stack: torch.Tensor, idx: torch.Tensor, y: torch.Tensor, form: tuple, xdiv: int,
              act: int = -1, rw: torch.Tensor | None = None, warm: bool = False):
    """y[pair] = pro(x[pair // xdiv]) @ stack[idx[pair]]^T for every pair of idx (flattened), x rows [g | u]
    and the input act(g) * u where act >= 0, each output times rw[pair] (rounded first) where given."""
    n, k = stack.shape[1], stack.shape[2]
    bn, warps, r = form
    rw_kind = 0 if rw is None else 2 if rw.dtype == torch.float32 else 1
    kern = kernel(n, k, bn, warps, r, x.dtype == torch.float16, act, xdiv, rw_kind, idx.dtype == torch.int32)
    if warm:
        return kern.function(x.device)
    if idx.numel():
        kern((cdiv(n, bn), 1, idx.numel()), warps * 32, [x, stack, idx, y if rw is None else rw, y],
             pdl=pdl(x)["PDL"])
    return y


def routed(x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
           act: str, p: dict, y: torch.Tensor) -> torch.Tensor:
    """The routed experts' weighted rows y [T*k, H] (pair order) with the pair forms p["g"] (gate_up) and
    p["d"] (down); the combine is the caller's."""
    k, i = idx.shape[1], down.shape[2]
    h = torch.empty((idx.numel(), 2 * i), dtype=x.dtype, device=x.device)
    run_pairs(x, gate_up, idx, h, p["g"], k)
    return run_pairs(h, down, idx, y, p["d"], 1, ACTS[act], weights)
