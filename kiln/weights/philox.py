"""NumPy's Philox stream (Philox4x64-10, numpy.random.Philox) drawn on the GPU, so that a
synthesized model's values are made where they are quantised instead of on 16 host threads and
copied over PCIe (the 397B's 387G expert values took 215 s that way on the H200's host).

The stream, as numpy.random.Generator(Philox(key=k)).random(dtype=float32) gives it: call c (from 1)
enciphers the counter (c, 0, 0, 0) under the key (k mod 2^64, k >> 64) in ten rounds; each of its
four 64-bit words gives two values, its low 32 bits first, each (u32 >> 8) * 2^-24. The reference is
numpy's generator itself (tests/weights/test_philox.py compares them); the kernel computes any value
from its index alone, so every GPU thread draws its own part of a block.
"""

from __future__ import annotations

import numpy as np
import torch
import triton
import triton.language as tl

M0, M1 = tl.constexpr(0xD2E7470EE14C6C93), tl.constexpr(0xCA5A826395121157)   # Random123's Philox4x64
W0, W1 = tl.constexpr(0x9E3779B97F4A7C15), tl.constexpr(0xBB67AE8584CAA73B)   # multipliers, key increments
LOW = tl.constexpr(0xFFFFFFFF)
TILE = 512          # counters a program enciphers: 4,096 values


@triton.jit
def _mulhilo(b, A: tl.constexpr):
    """(hi, lo) 64-bit halves of the 128-bit product A * b, from 32-bit halves (exact in uint64)."""
    a_lo: tl.constexpr = A & LOW
    a_hi: tl.constexpr = A >> 32
    b_lo, b_hi = b & LOW, b >> 32
    ll, lh = b_lo * a_lo, b_hi * a_lo
    hl, hh = b_lo * a_hi, b_hi * a_hi
    mid = (ll >> 32) + (lh & LOW) + (hl & LOW)
    return hh + (lh >> 32) + (hl >> 32) + (mid >> 32), b * A


@triton.jit
def philox_kernel(key_ptr, out_ptr, N, BLOCK: tl.constexpr, scale, shift, TILE: tl.constexpr):
    """Program (block b, tile t): values [8 t TILE, 8 (t + 1) TILE) of block b's stream (key
    key_ptr[2b], key_ptr[2b + 1]) mapped v * scale + shift (two f32 roundings), into out[b BLOCK + j]
    for j < BLOCK (the last block: j < N - b BLOCK, N the values in all)."""
    b = tl.program_id(0)
    k0 = tl.load(key_ptr + 2 * b).to(tl.uint64, bitcast=True)
    k1 = tl.load(key_ptr + 2 * b + 1).to(tl.uint64, bitcast=True)
    c0 = (tl.program_id(1) * TILE + tl.arange(0, TILE)).to(tl.uint64) + 1
    c1 = tl.zeros([TILE], dtype=tl.uint64)
    c2 = tl.zeros([TILE], dtype=tl.uint64)
    c3 = tl.zeros([TILE], dtype=tl.uint64)
    for r in tl.static_range(10):
        if r > 0:
            k0 += W0
            k1 += W1
        hi0, lo0 = _mulhilo(c0, M0)
        hi1, lo1 = _mulhilo(c2, M1)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
    col = tl.arange(0, 4)[None, :]
    words = tl.where(col == 0, c0[:, None], tl.where(col == 1, c1[:, None], tl.where(col == 2, c2[:, None],
                                                                                 c3[:, None])))
    halves = tl.reshape(tl.join(words & LOW, words >> 32), [TILE, 8])      # word 0 low, word 0 high, ...
    v = (halves >> 8).to(tl.float32) * (1.0 / 16777216.0)
    v = v * scale + shift
    j = (tl.program_id(1) * TILE + tl.arange(0, TILE))[:, None] * 8 + tl.arange(0, 8)[None, :]
    at = b.to(tl.int64) * BLOCK + j
    tl.store(out_ptr + at, v, mask=(j < BLOCK) & (at < N))


def key_words(keys: list[int]) -> np.ndarray:
    """128-bit keys as the kernel reads them: [low, high] 64-bit words each, in int64."""
    return np.array([[k & (2 ** 64 - 1), k >> 64] for k in keys], dtype=np.uint64).view(np.int64)


def uniform(keys: list[int], out: torch.Tensor, block: int, scale: float, shift: float) -> torch.Tensor:
    """out (f32, contiguous, on the GPU or under the interpreter) filled with blocks of `block` values,
    block i the first values of key i's stream mapped v * scale + shift; the last block may be short
    (out.numel() ends it)."""
    n = out.numel()
    if n > len(keys) * block or n <= (len(keys) - 1) * block:
        raise ValueError(f"{n} values do not fill {len(keys)} blocks of {block}")
    k = torch.from_numpy(key_words(keys)).to(out.device)
    grid = (len(keys), -(-min(block, n) // (8 * TILE)))
    f32 = lambda v: float(np.float32(v))      # noqa: E731  (the kernel's f32 scalars, exactly)
    # no fused multiply-add: v * scale and + shift round apart, as NumPy's two steps (kiln.ops'
    # EXACT_ROUNDING; weights sits below ops)
    philox_kernel[grid](k, out, n, BLOCK=block, scale=f32(scale), shift=f32(shift), TILE=TILE, num_warps=4,
                        enable_fp_fusion=False)
    return out


def reference(key: int, n: int) -> np.ndarray:
    """The first n values of key's stream, by numpy's own generator (the CPU draw's)."""
    return np.random.Generator(np.random.Philox(key=key)).random(n, dtype=np.float32)
