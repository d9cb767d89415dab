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

from ...weights.quantized import (  # noqa: F401
    BITS,
    EPS,
    GROUP_SIZES,
    QuantizedWeight,
    cat_rows,
    check_format,
    pack,
    quantize,  # the format's container and mx.quantize (drawn weights use it)
    unpack,
)


def dequantize(w: QuantizedWeight) -> torch.Tensor:
    """mx.dequantize: scale * q + bias in the scales' dtype, each step rounded to it."""
    q = unpack(w.packed, w.bits).to(w.scales.dtype)
    g = w.group_size
    q = q.reshape(*q.shape[:-1], -1, g)
    out = w.scales[..., None] * q + w.biases[..., None]
    return out.reshape(*w.shape).to(w.dtype)      # scales kept wider (GGUF's, exact): one rounding here
