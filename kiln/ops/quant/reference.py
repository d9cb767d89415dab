"""MLX affine quantisation, the reference: mx.quantize and mx.dequantize (mode "affine") in torch,
bit for bit (tests/ops/test_quant.py checks them against mlx itself). Written in
kiln/weights/quantized.py beside the format (drawn weights and packing use them below the ops layer);
this module is their name in the ops layer.

Per row, groups of G consecutive inputs (G in 32, 64, 128); bits b in 2, 3, 4, 5, 6, 8;
w = scale * q + bias with q in [0, 2^b - 1]. The quantiser takes the group's larger-magnitude
extreme as its edge, so that edge (and 0.0) is exact: scales may be negative, and the bias is the
group's min or max. q is packed LSB-first as one bit stream per row into uint32 words (a group's
G * b bits fill whole words); scales and biases are stored in the weight's dtype.
"""

from __future__ import annotations

# the format's container and mx's two functions, kept beside it (drawn weights and packing use them)
from ...weights.quantized import (  # noqa: F401
                                  BITS,
                                  EPS,
                                  GROUP_SIZES,
                                  QuantizedWeight,
                                  cat_rows,
                                  check_format,
                                  dequantize,
                                  pack,
                                  quantize,
                                  unpack,
)
