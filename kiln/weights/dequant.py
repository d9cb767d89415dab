"""Dequantise GGUF tensor bytes into float32 torch tensors.

`dequantize(raw, ggml_type, shape)` turns one tensor's bytes, exactly as stored in a GGUF file,
into a float32 tensor of `shape`. Every block type is decoded with vectorised torch ops over
chunks of about 4M elements (the Python loop is over chunks, never over blocks), writing
straight into the preallocated result.

Results are bit-exact with `gguf.quants.dequantize`: every scale is widened from f16 to f32
first and the float32 ops follow its order: scale products first (d*sc, dmin*m), then (d*sc)*q,
then the offset added/subtracted last. (Products of an f16 scale, a <=8-bit sub-scale and a
<=6-bit quant need at most 23 significant bits, so they are exact in f32 whatever the order; the
one rounding that can differ is the final add/sub, so that must stay last: d*q + m, never
d*(q + m/d).) Each step is a separate torch op, no addcmul/fused kernels.

Block layouts (byte offsets inside one block; "f16" = IEEE half, little-endian):
  Q4_0  18 B / 32:  d f16 | qs[16] (low nibbles = elements 0..15, high = 16..31);  x = d*(q-8)
  Q4_1  20 B / 32:  d f16 | m f16 | qs[16];                                      x = d*q + m
  Q5_0  22 B / 32:  d f16 | qh[4] (bit j = 5th bit of element j) | qs[16];       x = d*(q-16)
  Q5_1  24 B / 32:  d f16 | m f16 | qh[4] | qs[16];                              x = d*q + m
  Q8_0  34 B / 32:  d f16 | qs int8[32];                                         x = q*d
  Q2_K  84 B / 256: scales[16] (lo=sc, hi=min) | qs[64] | d f16 | dmin f16
  Q3_K 110 B / 256: hmask[32] | qs[64] | scales[12] (16 x 6-bit) | d f16
  Q4_K 144 B / 256: d f16 | dmin f16 | scales[12] (8 x 6-bit sc + 8 x 6-bit min) | qs[128]
  Q5_K 176 B / 256: d f16 | dmin f16 | scales[12] | qh[32] | qs[128]
  Q6_K 210 B / 256: ql[128] | qh[64] | scales int8[16] | d f16
  Q8_K 292 B / 256: d f32 | qs int8[256] | bsums int16[16] (bsums unused)
"""

from __future__ import annotations

import math
import warnings

import numpy as np
import torch

from ..errors import KilnError

# gguf.GGMLQuantizationType values
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0 = 0, 1, 2, 3, 6, 7, 8
Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q8_K, BF16 = 10, 11, 12, 13, 14, 15, 30

_NAMES = {F32: "F32", F16: "F16", BF16: "BF16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1",
          Q8_0: "Q8_0", Q2_K: "Q2_K", Q3_K: "Q3_K", Q4_K: "Q4_K", Q5_K: "Q5_K", Q6_K: "Q6_K", Q8_K: "Q8_K"}


def type_name(ggml_type: int) -> str:
    """Name of a ggml type ("Q4_K"), or "type N" for a number no known type has."""
    t = int(ggml_type)
    if t in _NAMES:
        return _NAMES[t]
    try:
        import gguf

        return gguf.GGMLQuantizationType(t).name
    except Exception:
        return f"type {t}"


# -- helpers over a chunk of blocks: `b` is uint8 (n, type_size), rows contiguous ----------------

def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    """The f16 field at byte `off` of every block, widened to float32, shape (n, 1)."""
    return b[:, off:off + 2].contiguous().view(torch.float16).to(torch.float32)


def _nibbles(qs: torch.Tensor, dim: int) -> torch.Tensor:
    """Low nibbles and high nibbles of `qs`, stacked on a new axis `dim` (low first)."""
    return torch.stack((qs & 0x0F, qs >> 4), dim=dim)


def _bits(qh: torch.Tensor, nbits: int, step: int, mask: int) -> torch.Tensor:
    """(..., k) -> (..., nbits // step, k): field i is (qh >> (i*step)) & mask."""
    shifts = torch.arange(0, nbits, step, dtype=torch.uint8).view(-1, 1)
    return (qh.unsqueeze(-2) >> shifts) & mask


_SHIFT8 = torch.arange(8, dtype=torch.uint8)


def _qh_bits32(qh: torch.Tensor) -> torch.Tensor:
    """qh (n, 4) holding a little-endian uint32 -> (n, 32) with bit j of that uint32 at j."""
    return ((qh.unsqueeze(-1) >> _SHIFT8) & 1).reshape(qh.shape[0], 32)


def _q4_0(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:18], 1).reshape(n, 32).view(torch.int8) - 8
    torch.mul(d, q, out=out)  # d * float(q - 8)


def _q4_1(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:20], 1).reshape(n, 32)
    torch.mul(d, q, out=out)  # (d*q) + m: d*q is exact, the add is the one rounding
    out.add_(m)


def _q5_0(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    d = _f16(b, 0)
    q = _nibbles(b[:, 6:22], 1).reshape(n, 32) | (_qh_bits32(b[:, 2:6]) << 4)
    torch.mul(d, q.view(torch.int8) - 16, out=out)  # d * float(q - 16)


def _q5_1(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 8:24], 1).reshape(n, 32) | (_qh_bits32(b[:, 4:8]) << 4)
    torch.mul(d, q, out=out)  # (d*q) + m: d*q is exact, the add is the one rounding
    out.add_(m)


def _q8_0(b: torch.Tensor, out: torch.Tensor) -> None:
    d = _f16(b, 0)
    torch.mul(b[:, 2:34].view(torch.int8), d, out=out)  # float(q) * d in one pass (int8 -> f32 exact)


def _q2_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    sc = b[:, 0:16]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (sc & 0x0F)).unsqueeze(-1)  # gguf order: scale products first (exact in f32)
    ml = (dmin * (sc >> 4)).unsqueeze(-1)
    q = _bits(b[:, 16:80].reshape(n, 2, 32), 8, 2, 3).reshape(n, 16, 16)
    o = out.view(n, 16, 16)
    torch.mul(dl, q, out=o)  # (d*sc)*q - (dmin*m): the sub is the one rounding, last
    o.sub_(ml)


def _q3_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    d = _f16(b, 108)
    lo = _nibbles(b[:, 96:104], 1).reshape(n, 16)       # scale j: low 4 bits
    hi = _bits(b[:, 104:108], 8, 2, 3).reshape(n, 16)   # scale j: top 2 bits
    sc = (lo | (hi << 4)).view(torch.int8) - 32
    dl = (d * sc).unsqueeze(-1)  # gguf order: d*sc first (exact in f32)
    ql = _bits(b[:, 32:96].reshape(n, 2, 32), 8, 2, 3).reshape(n, 16, 16)
    hm = _bits(b[:, 0:32], 8, 1, 1).reshape(n, 16, 16)
    q = ql.view(torch.int8) - ((hm ^ 1) << 2).view(torch.int8)  # high bit clear means subtract 4
    torch.mul(dl, q, out=out.view(n, 16, 16))  # (d*sc)*q


def _k_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """12 packed bytes -> 8 six-bit scales and 8 six-bit mins (Q4_K / Q5_K)."""
    a, m, md = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = torch.cat((a & 0x3F, (md & 0x0F) | ((a >> 2) & 0x30)), dim=1)
    mn = torch.cat((m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)), dim=1)
    return sc, mn


def _q4_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    dl = (d * sc).unsqueeze(-1)  # gguf order: scale products first (exact in f32)
    ml = (dmin * mn).unsqueeze(-1)
    q = _nibbles(b[:, 16:144].reshape(n, 4, 32), 2).reshape(n, 8, 32)
    o = out.view(n, 8, 32)
    torch.mul(dl, q, out=o)  # (d*sc)*q - (dmin*m): the sub is the one rounding, last
    o.sub_(ml)


def _q5_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scales(b[:, 4:16])
    dl = (d * sc).unsqueeze(-1)  # gguf order: scale products first (exact in f32)
    ml = (dmin * mn).unsqueeze(-1)
    ql = _nibbles(b[:, 48:176].reshape(n, 4, 32), 2).reshape(n, 8, 32)
    qh = _bits(b[:, 16:48], 8, 1, 1)  # (n, 8, 32): sub-block j takes bit j
    o = out.view(n, 8, 32)
    torch.mul(dl, ql | (qh << 4), out=o)  # (d*sc)*q - (dmin*m): the sub is the one rounding, last
    o.sub_(ml)


def _q6_k(b: torch.Tensor, out: torch.Tensor) -> None:
    n = b.shape[0]
    d = _f16(b, 208)
    dl = (d * b[:, 192:208].view(torch.int8)).unsqueeze(-1)  # gguf order: d*sc first (exact in f32)
    ql = _nibbles(b[:, 0:128].reshape(n, 2, 64), 2).reshape(n, 8, 32)
    qh = _bits(b[:, 128:192].reshape(n, 2, 32), 8, 2, 3).reshape(n, 8, 32)
    q = (ql | (qh << 4)).view(torch.int8) - 32
    torch.mul(dl, q.view(n, 16, 16), out=out.view(n, 16, 16))  # (d*sc)*q


def _q8_k(b: torch.Tensor, out: torch.Tensor) -> None:
    d = b[:, 0:4].contiguous().view(torch.float32)
    torch.mul(d, b[:, 4:260].view(torch.int8), out=out)  # d * float(q)


# type -> (elements per block, bytes per block, kernel)
_BLOCKS = {
    Q4_0: (32, 18, _q4_0),
    Q4_1: (32, 20, _q4_1),
    Q5_0: (32, 22, _q5_0),
    Q5_1: (32, 24, _q5_1),
    Q8_0: (32, 34, _q8_0),
    Q2_K: (256, 84, _q2_k),
    Q3_K: (256, 110, _q3_k),
    Q4_K: (256, 144, _q4_k),
    Q5_K: (256, 176, _q5_k),
    Q6_K: (256, 210, _q6_k),
    Q8_K: (256, 292, _q8_k),
}
# Elements decoded per kernel call: bounds the temporaries and keeps them in cache; on 2 cores
# 4M is faster than both much smaller chunks (per-op overhead) and no chunking at all.
_CHUNK_ELEMS = 1 << 22
_PLAIN = {F32: 4, F16: 2, BF16: 2}

SUPPORTED: set[int] = set(_PLAIN) | set(_BLOCKS)


def _as_torch_bytes(raw: np.ndarray) -> torch.Tensor:
    arr = np.asarray(raw)
    if arr.dtype != np.uint8:
        arr = np.ascontiguousarray(arr).reshape(-1).view(np.uint8)
    arr = np.ascontiguousarray(arr.reshape(-1))
    with warnings.catch_warnings():
        # a read-only memmap: torch warns that the tensor is not writable; we only ever read it
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(arr)


def dequantize(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Decode one GGUF tensor's bytes (`raw`, uint8) of type `ggml_type` into float32 of `shape`.

    `shape` is row-major (GGUF's ne[] reversed); its last dim must be a whole number of blocks.
    Raises KilnError for an unsupported type or a byte count that does not fit `shape`.
    """
    t = int(ggml_type)
    shape = tuple(int(s) for s in shape)
    if t not in SUPPORTED:
        raise KilnError(f"tensor type {type_name(t)} ({t}) is not supported "
                        f"(supported: {', '.join(type_name(s) for s in sorted(SUPPORTED))})")
    if any(s < 0 for s in shape):
        raise KilnError(f"bad tensor shape {shape}")
    n = math.prod(shape)
    if t in _PLAIN:
        block, tsize = 1, _PLAIN[t]
    else:
        block, tsize, _ = _BLOCKS[t]
        if shape and shape[-1] % block:
            raise KilnError(f"{type_name(t)} tensor of shape {shape}: row length {shape[-1]} "
                            f"is not a multiple of the block size {block}")
        if n % block:
            raise KilnError(f"{type_name(t)} tensor of shape {shape}: {n} elements is not a whole number of blocks")
    expected = n // block * tsize
    data = _as_torch_bytes(raw)
    if data.numel() != expected:
        raise KilnError(f"{type_name(t)} tensor of shape {shape} needs {expected} bytes, got {data.numel()}")
    if n == 0:
        return torch.empty(shape, dtype=torch.float32)

    if t == F32:
        return data.view(torch.float32).clone().view(shape)  # copy: never hand out a view of the mmap
    if t == F16:
        # numpy's widening keeps signalling-NaN payloads as they are (torch's sets the quiet bit)
        return torch.from_numpy(data.numpy().view(np.float16).astype(np.float32)).view(shape)
    if t == BF16:
        return data.view(torch.bfloat16).to(torch.float32).view(shape)  # exact: f32 bits = bf16 bits << 16

    block, tsize, kernel = _BLOCKS[t]
    chunk = max(1, _CHUNK_ELEMS // block)
    nb = n // block
    blocks = data.view(nb, tsize)
    out = torch.empty(nb, block, dtype=torch.float32)
    for i in range(0, nb, chunk):
        kernel(blocks[i:i + chunk], out[i:i + chunk])
    return out.view(shape)


# -- kept quantised: the 32-element blocks as MLX affine groups of 32 -------------------------------

AFFINE = {Q4_0: (4, 18), Q4_1: (4, 20), Q5_0: (5, 22), Q8_0: (8, 34),   # type -> (bits, block bytes)
          Q4_K: (4, 144), Q5_K: (5, 176)}    # super-blocks of 256: eight sub-blocks of 32, each a group


def affine_parts(raw: np.ndarray, ggml_type: int, shape: tuple[int, ...]):
    """(q values uint8 [..., K], scales f32 [..., K/32], biases f32 [..., K/32]) of a Q4_0, Q4_1,
    Q5_0, Q8_0, Q4_K or Q5_K tensor, with scale * q + bias equal, bit for bit, to what `dequantize` gives:
    Q4_1 is d*q + m as stored; Q4_0 d*(q - 8) is d*q + (-8d), Q5_0 d*q + (-16d) and Q8_0 (q + 128)
    as unsigned with -128d (every product of an f16 scale and a small integer is exact in f32, and so
    is their sum, the exact d*(q - c)). Q4_K and Q5_K: each 32-value sub-block has scale d*sc and bias
    -(dmin*m) (both exact in f32: an f16 times a 6-bit integer), and scale*q + bias is the
    dequantiser's (d*sc)*q - (dmin*m), the subtraction its one rounding."""
    t = int(ggml_type)
    bits, size = AFFINE[t]
    b = _as_torch_bytes(raw).view(-1, size)
    n = b.shape[0]
    d = _f16(b, 0)
    if t in (Q4_K, Q5_K):
        sc, mn = _k_scales(b[:, 4:16])
        scale, bias = d * sc, -(_f16(b, 2) * mn)                                  # [n, 8] each
        first = 16 if t == Q4_K else 48                                          # qs after Q5_K's qh[32]
        q = _nibbles(b[:, first:first + 128].reshape(n, 4, 32), 2).reshape(n, 8, 32)
        if t == Q5_K:
            q = q | (_bits(b[:, 16:48], 8, 1, 1) << 4)
        rows = shape[:-1]
        return q.reshape(*rows, shape[-1]), scale.reshape(*rows, -1), bias.reshape(*rows, -1)
    if t == Q4_1:
        q, bias = _nibbles(b[:, 4:20], 1).reshape(n, 32), _f16(b, 2)
    elif t == Q4_0:
        q, bias = _nibbles(b[:, 2:18], 1).reshape(n, 32), -8 * d
    elif t == Q5_0:
        q, bias = _nibbles(b[:, 6:22], 1).reshape(n, 32) | (_qh_bits32(b[:, 2:6]) << 4), -16 * d
    else:
        q, bias = (b[:, 2:34].view(torch.int8).to(torch.int16) + 128).to(torch.uint8), -128 * d
    rows = shape[:-1]
    return q.reshape(*rows, shape[-1]), d.reshape(*rows, -1), bias.reshape(*rows, -1)
