"""MLX affine quantisation, the reference: mx.quantize and mx.dequantize (mode "affine") in torch,
bit for bit (tests/ops/test_quant.py checks them against mlx itself).

Per row, groups of G consecutive inputs (G in 32, 64, 128); bits b in 2, 3, 4, 5, 6, 8;
w = scale * q + bias with q in [0, 2^b - 1]. The quantiser takes the group's larger-magnitude
extreme as its edge, so that edge (and 0.0) is exact: scales may be negative, and the bias is the
group's min or max. q is packed LSB-first as one bit stream per row into uint32 words (a group's
G * b bits fill whole words); scales and biases are stored in the weight's dtype.
"""

from __future__ import annotations

import torch

from ...weights.quantized import QuantizedWeight, cat_rows, pack, unpack  # noqa: F401  (the format's container)

BITS = (2, 3, 4, 5, 6, 8)
GROUP_SIZES = (32, 64, 128)
EPS = 1e-7      # the smallest scale mlx lets a group have (a constant group)


def check_format(bits: int, group_size: int) -> None:
    if bits not in BITS or group_size not in GROUP_SIZES:
        raise ValueError(f"affine quantisation takes bits in {BITS} and group sizes in {GROUP_SIZES}, "
                         f"got bits {bits}, group size {group_size}")


def quantize(w: torch.Tensor, bits: int = 4, group_size: int = 64) -> QuantizedWeight:
    """mx.quantize(w, group_size, bits): every step in f32 as mlx's CPU kernel takes it."""
    check_format(bits, group_size)
    if w.shape[-1] % group_size:
        raise ValueError(f"the last dimension ({w.shape[-1]}) is not a multiple of the group size {group_size}")
    groups = w.float().reshape(-1, group_size)                                   # [n, G]
    n_bins = float(2 ** bits - 1)
    w_max, w_min = groups.max(-1).values, groups.min(-1).values
    low_edge = w_min.abs() > w_max.abs()
    scale = torch.clamp((w_max - w_min) / n_bins, min=EPS)
    scale = torch.where(low_edge, scale, -scale)
    edge = torch.where(low_edge, w_min, w_max)
    q0 = torch.round(edge / scale)
    exact = q0 != 0
    scale = torch.where(exact, edge / torch.where(exact, q0, 1.0), scale)
    bias = torch.where(exact, edge, torch.zeros_like(edge))
    q = torch.round((groups - bias[:, None]) / scale[:, None]).clamp(0, n_bins).to(torch.int64)
    rows = w.shape[:-1]
    packed = pack(q.reshape(*rows, w.shape[-1]), bits)
    cast = lambda t: t.to(w.dtype).reshape(*rows, -1)  # noqa: E731
    return QuantizedWeight(packed, cast(scale), cast(bias), bits, group_size)


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """mx.dequantize: scale * q + bias in the scales' dtype, each step rounded to it."""
    q = unpack(w.packed, w.bits).to(w.scales.dtype)
    g = w.group_size
    q = q.reshape(*q.shape[:-1], -1, g)
    out = w.scales[..., None] * q + w.biases[..., None]
    return out.reshape(*w.shape).to(w.dtype)      # scales kept wider (GGUF's, exact): one rounding here
