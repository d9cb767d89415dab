"""CUDA C shared by the NVRTC kernels (kiln/ops/quant/dp4a.py, kiln/ops/gemm/hgemv.py): 16-bit
conversions, streaming loads, the PDL wait, the warp's row reduction and the row-block stores with a
serial split-K finish, act(g) as act_mul computes it. The including kernel defines N, K, BN, WARPS, R,
SPLIT, F16 and ACT (-D)."""

HELPERS = r"""
typedef unsigned int u32;
typedef unsigned short u16;

__device__ __forceinline__ float to_f32(u16 h) {
#if F16
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f;
#else
    return __uint_as_float(((u32)h) << 16);
#endif
}

__device__ __forceinline__ u16 from_f32(float f) {
    u16 h;
#if F16
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
    return h;
}


__device__ __forceinline__ uint4 load_stream(const uint4 *p) {  // read once: keep it out of L1
    uint4 v;
    asm volatile("ld.global.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}


// n values of x from src (16-byte aligned) as f32.
__device__ __forceinline__ void load_f32(const u16 *src, float *v, int n) {
#pragma unroll
    for (int t = 0; t < n / 8; t++) {
        uint4 u = ((const uint4 *)src)[t];
        u32 w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
        for (int j = 0; j < 4; j++) {
            v[t * 8 + 2 * j] = to_f32((u16)(w[j] & 0xFFFF));
            v[t * 8 + 2 * j + 1] = to_f32((u16)(w[j] >> 16));
        }
    }
}


// Programmatic dependent launch: wait for the kernel before (its writes visible), then let the next
// one start; a no-op when launched without the attribute. Weights are loaded before it: never written.
__device__ __forceinline__ void pdl_wait() {
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}


// Sum a[0..R) across the warp: row i's total lands in lanes (i * 32 / R) .. ; returns the lane's row's.
__device__ __forceinline__ float reduce_rows(float *a, int lane) {
#pragma unroll
    for (int h = R / 2, off = 16; h >= 1; h /= 2, off /= 2) {
        bool up = (lane & off) != 0;
#pragma unroll
        for (int j = 0; j < h; j++) {
            float send = up ? a[j] : a[j + h];
            float keep = up ? a[j + h] : a[j];
            a[j] = keep + __shfl_xor_sync(0xffffffffu, send, off);
        }
    }
#pragma unroll
    for (int off = 16 / R; off >= 1; off /= 2) a[0] += __shfl_xor_sync(0xffffffffu, a[0], off);
    return a[0];
}



// act(g) as act_mul_kernel computes it (Triton's lowering, read off its PTX): exp(-g) as ex2.approx of
// (0 - g) * log2(e), then div.full; so round(round(act(g)) * u) equals act_mul's output bit for bit.
__device__ __forceinline__ float act_f32(float g) {
    float e, a, d;
    const float t = (0.0f - g) * __int_as_float(0x3FB8AA3B);
    asm("ex2.approx.f32 %0, %1;" : "=f"(e) : "f"(t));
    d = 1.0f + e;
#if ACT == 0
    asm("div.full.f32 %0, %1, %2;" : "=f"(a) : "f"(g), "f"(d));
#else
    asm("div.full.f32 %0, %1, %2;" : "=f"(a) : "f"(1.0f), "f"(d));
#endif
    return a;
}

// After a row's slabs (acc: each warp's sums of the block's BN rows): the block's outputs, or its
// split's partials in ws [SPLIT, M, N].
__device__ __forceinline__ void store_block(float (*acc)[BN], u16 *y, float *ws, int n0, int split, int m, int M) {
    for (int t = threadIdx.x; t < BN; t += WARPS * 32) {
        const int n = n0 + t;
        float sum = 0.f;
#pragma unroll
        for (int v = 0; v < WARPS; v++) sum += acc[v][t];
        if (n < N) {
            if (SPLIT == 1) y[(long long)m * N + n] = from_f32(sum);
            else ws[((long long)split * M + m) * N + n] = sum;
        }
    }
}

// Split-K: the last block of this row block to arrive adds the splits in order (as the Triton forms'
// gemv_splitk_finish), then resets its counter for the next launch.
__device__ void finish_splits(u16 *y, const float *ws, int *counts, int n0, int M) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&counts[blockIdx.x], 1) == SPLIT - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int m = 0; m < M; m++)
        for (int t = threadIdx.x; t < BN; t += WARPS * 32) {
            const int n = n0 + t;
            if (n >= N) continue;
            float sum = 0.f;
            for (int sp = 0; sp < SPLIT; sp++) sum += __ldcg(ws + ((long long)sp * M + m) * N + n);
            y[(long long)m * N + n] = from_f32(sum);
        }
    if (threadIdx.x == 0) counts[blockIdx.x] = 0;
}
"""
