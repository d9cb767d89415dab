"""A quantised GEMV for the CPU backend, compiled at load with the weight's shape as constants.

torch's CPU kernels read a GGUF Q8_0 or Q5_0 weight no faster than an f16 copy of it: the int8
kernel (`_weight_int8pack_mm`) runs at ~12 GB/s on our 2-core CI machine and takes one scale a row,
and the int4 kernel takes 4 bits only. A decode step is bound by the bytes it reads (~28 GB/s here),
so this form keeps each value in one signed byte (q - 2^(bits-1), exact for every bits <= 8) with its
group's scale and bias, and a small C kernel (gcc, OpenMP on torch's own libgomp) computes
y = sum_g scale_g * (c_g . x_g) + bias'_g * sum(x_g) in f32 with bias' = bias + 2^(bits-1) * scale.
GGUF's Q8_0, Q5_0 and Q4_0 have bias' = 0 exactly, so their kernel reads no bias, and their f16
scales are kept as f16: the LM head of gemma3-270m (Q8_0, 262144 x 640) reads 178 MB a token
instead of the f16 copy's 335 MB. The arithmetic is f32 on exact values (the f16 copy rounds each
value to f16); only the order of the sums differs from the reference's.

No compiler, or a failed build: the form is not offered (`available()`), and the others run.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from ...fsutil import cache_dir
from ...weights.quantized import QuantizedWeight, unpack

MAX_ROWS = 4        # rows a kernel call takes (its x split lives on the stack); more rows, more calls
SOURCE = r"""
#include <stdint.h>
#include <math.h>
#include <immintrin.h>
#define NG (K / G)
#define PAIRS (G / 2)
#if SF16
typedef uint16_t stype;
static inline __m512 svec(const stype *p) { return _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)p)); }
#else
typedef float stype;
static inline __m512 svec(const stype *p) { return _mm512_loadu_ps(p); }
#endif

/* x split per group into two int16 parts: x = (hi + lo / 2^15) / 2^sh, within 2^-29 of the group's max. */
static void split_x(const float *x, int32_t *hi, int32_t *lo, float *unit, float *xs) {
    for (int g = 0; g < NG; g++) {
        float amax = 0.f, sum = 0.f;
        for (int i = 0; i < G; i++) { float a = fabsf(x[g * G + i]); amax = a > amax ? a : amax; sum += x[g * G + i]; }
        xs[g] = sum;
        int sh = amax > 0.f ? 13 - ilogbf(amax) : 0;
        unit[g] = ldexpf(1.f, -sh);
        for (int j = 0; j < PAIRS; j++) {
            int16_t h[2], l[2];
            for (int t = 0; t < 2; t++) {
                float v = ldexpf(x[g * G + 2 * j + t], sh);
                float r = nearbyintf(v);
                h[t] = (int16_t)r;
                l[t] = (int16_t)nearbyintf((v - r) * 32768.f);
            }
            hi[g * PAIRS + j] = (int32_t)(uint16_t)h[0] | ((int32_t)(uint16_t)h[1] << 16);
            lo[g * PAIRS + j] = (int32_t)(uint16_t)l[0] | ((int32_t)(uint16_t)l[1] << 16);
        }
    }
}

/* y[m, n] = sum_g s[n,g] * (c[n, g] . x[m, g]) + b[n,g] * sum(x[m, g]); rows in blocks of 16, one a lane:
   q [N/16][K/2][16][2] int8, s and b [N/16][NG][16]. */
void kiln_cgemv(const float *restrict x, int m_rows, const int8_t *restrict q, const stype *restrict s,
                const stype *restrict b, float *restrict y, int64_t n_rows) {
    int32_t hi[MAX_ROWS][K / 2], lo[MAX_ROWS][K / 2];
    float unit[MAX_ROWS][NG], xs[MAX_ROWS][NG];
    for (int m = 0; m < m_rows; m++) split_x(x + m * K, hi[m], lo[m], unit[m], xs[m]);
    const int64_t blocks = (n_rows + 15) / 16;
    #pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < blocks; blk++) {
        const int8_t *qb = q + blk * (int64_t)K * 16;
        const stype *sb = s + blk * NG * 16;
        for (int m = 0; m < m_rows; m++) {
            __m512 acc = _mm512_setzero_ps();
            for (int g = 0; g < NG; g++) {
                __m512i ah = _mm512_setzero_si512(), al = _mm512_setzero_si512();
                const int8_t *qg = qb + g * G * 16;
                for (int j = 0; j < PAIRS; j++) {
                    __m512i w = _mm512_cvtepi8_epi16(_mm256_loadu_si256((const __m256i *)(qg + j * 32)));
                    ah = _mm512_dpwssd_epi32(ah, w, _mm512_set1_epi32(hi[m][g * PAIRS + j]));
                    al = _mm512_dpwssd_epi32(al, w, _mm512_set1_epi32(lo[m][g * PAIRS + j]));
                }
                __m512 d = _mm512_fmadd_ps(_mm512_cvtepi32_ps(al), _mm512_set1_ps(1.f / 32768.f),
                                           _mm512_cvtepi32_ps(ah));
                acc = _mm512_fmadd_ps(_mm512_mul_ps(d, _mm512_set1_ps(unit[m][g])), svec(sb + g * 16), acc);
#if HASB
                acc = _mm512_fmadd_ps(svec(b + blk * NG * 16 + g * 16), _mm512_set1_ps(xs[m][g]), acc);
#endif
            }
            float out[16];
            _mm512_storeu_ps(out, acc);
            int64_t n0 = blk * 16;
            for (int r = 0; r < 16 && n0 + r < n_rows; r++) y[m * n_rows + n0 + r] = out[r];
        }
    }
}
"""


@dataclass
class CWeight:
    """A weight in the kernel's layout: `q` [N, K] int8, `s` / `b` [N, K / group] (f16 where that
    holds them exactly, else f32; `b` empty when every bias' is 0), and the compiled kernel."""
    q: torch.Tensor
    s: torch.Tensor
    b: torch.Tensor
    shape: tuple
    fn: object


def fits(w) -> bool:
    return (isinstance(w, QuantizedWeight) and w.packed.dim() == 2 and w.bits <= 8 and w.group_size % 16 == 0
            and w.packed.device.type == "cpu" and available())


def to_c(w: QuantizedWeight) -> CWeight:
    """The kernel's copy of w: values centred to signed bytes, rows in blocks of 16 (one a vector
    lane: the kernel's products run 16 rows at once), k in pairs (the int16 dot takes two)."""
    n, k = w.shape
    half = 1 << (w.bits - 1)
    pad = -n % 16
    c = (unpack(w.packed, w.bits).to(torch.int16) - half).to(torch.int8)
    q = torch.nn.functional.pad(c, (0, 0, 0, pad)).reshape(-1, 16, k // 2, 2).transpose(1, 2).contiguous()
    s = w.scales.float()
    b = w.biases.float() + half * s
    has_bias = bool(b.abs().max() > 0)
    f16 = all(torch.equal(t.half().float(), t) for t in ((s, b) if has_bias else (s,)))
    dt = torch.float16 if f16 else torch.float32

    def lanes(t):     # [N, groups] -> [N / 16, groups, 16]
        t = torch.nn.functional.pad(t, (0, 0, 0, pad))
        return t.reshape(-1, 16, t.shape[1]).transpose(1, 2).to(dt).contiguous()

    b = lanes(b) if has_bias else torch.empty(0, dtype=dt)
    return CWeight(q, lanes(s), b, (n, k), _kernel(k, w.group_size, f16, has_bias))


def c_linear(x: torch.Tensor, w: CWeight) -> torch.Tensor:
    """x @ w^T in f32, returned in x's dtype; MAX_ROWS rows a call (each row's arithmetic is the
    same whatever rows share its call: a batch gives each request its single-row result)."""
    n, k = w.shape
    x2 = x.reshape(-1, k).to(torch.float32).contiguous()
    y = torch.empty(x2.shape[0], n, dtype=torch.float32)
    for r0 in range(0, x2.shape[0], MAX_ROWS):
        xr, yr = x2[r0:r0 + MAX_ROWS], y[r0:r0 + MAX_ROWS]
        w.fn(xr.data_ptr(), xr.shape[0], w.q.data_ptr(), w.s.data_ptr(), w.b.data_ptr(), yr.data_ptr(), n)
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


_LOADED: dict[tuple, object] = {}
_FAILED: list[str] = []


def available() -> bool:
    """Whether a C compiler builds the kernel here (tried once a process)."""
    if not _FAILED and not _LOADED:
        try:
            _kernel(64, 32, True, False)
        except (OSError, subprocess.SubprocessError) as e:
            _FAILED.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
    return not _FAILED


def _kernel(k: int, group: int, f16: bool, has_bias: bool):
    key = (k, group, f16, has_bias)
    if key not in _LOADED:
        lib = ctypes.CDLL(str(_build(*key)))
        fn = lib.kiln_cgemv
        fn.restype = None
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                       ctypes.c_void_p, ctypes.c_int64]
        _LOADED[key] = fn
    return _LOADED[key]


def _build(k: int, group: int, f16: bool, has_bias: bool) -> Path:
    """The shared library for these constants, compiled once into the cache (keyed on the source,
    the flags and this CPU: -march=native)."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise OSError("no C compiler (cc or gcc) on PATH")
    flags = ["-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", f"-DK={k}", f"-DG={group}",
             f"-DSF16={int(f16)}", f"-DHASB={int(has_bias)}", f"-DMAX_ROWS={MAX_ROWS}"]
    tag = hashlib.sha256("|".join([SOURCE, cc, *flags, _cpu()]).encode()).hexdigest()[:16]
    out = cache_dir() / "cpu_kernels" / f"cgemv_{tag}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "cgemv.c"
        src.write_text(SOURCE)
        part = out.with_name(f".{out.name}.{os.getpid()}.tmp")
        done = subprocess.run([cc, *flags, str(src), "-o", str(part)], capture_output=True, text=True, timeout=120)
        if done.returncode != 0:
            part.unlink(missing_ok=True)
            raise OSError(f"{cc} failed: {(done.stderr.strip().splitlines() or ['?'])[0]}")
        os.replace(part, out)     # complete before any other process can load it
    return out


def _cpu() -> str:
    try:
        return next(ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name"))
    except (OSError, StopIteration):
        import platform
        return platform.processor() or platform.machine()
