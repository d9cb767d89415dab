"""Quantised projections on the CPU kept quantised: torch's weight-only int4 kernel.

The reference dequantises each weight to the activation dtype and runs F.linear: every call reads
(and first writes) 16 or 32 bits a weight. torch's CPU kernel `_weight_int4pack_mm_for_cpu` reads
the 4-bit values as they are, with a scale and a zero a group: w = (q - 8) * scale + zero, so an
MLX affine group (w = scale * q + bias) maps exactly in real arithmetic with zero = bias + 8 * scale.
The kernel is fast with bf16 activations only (f32 and f16 take a scalar path ~10-100x slower on our
2-core CI machine), so x, the scales and the zeros are rounded to bf16 on the way in: the rounding of
a bf16 run (docs/cpu.md), which is why the form is measured and gated against the reference at load
rather than taken as exact.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...weights.quantized import QuantizedWeight, dequantize, unpack

INT4_GROUPS = (32, 64, 128)        # the kernel takes 256 too; MLX affine stops at 128


@dataclass
class Int4Weight:
    """A 4-bit QuantizedWeight in the kernel's layout: `packed` its values, `sz` [K / group, N, 2]
    the bf16 scales and zeros."""
    packed: torch.Tensor
    sz: torch.Tensor
    group: int
    shape: tuple


def int4_fits(w) -> bool:
    return (isinstance(w, QuantizedWeight) and w.packed.dim() == 2 and w.bits == 4 and w.group_size in INT4_GROUPS
            and w.shape[0] % 16 == 0       # the kernel's packing takes 16 rows at a time
            and w.packed.device.type == "cpu" and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))


def to_int4(w: QuantizedWeight) -> Int4Weight:
    """The kernel's copy of w (the values repacked, the scales and zeros in bf16)."""
    q = unpack(w.packed, 4).to(torch.int32).contiguous()
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    scales = w.scales.float()
    zeros = w.biases.float() + 8 * scales       # (q - 8) * scale + zero = scale * q + bias
    sz = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
    return Int4Weight(packed, sz, w.group_size, tuple(w.shape))


def int4_linear(x: torch.Tensor, w: Int4Weight) -> torch.Tensor:
    """x @ w^T with x rounded to bf16 and the result returned in x's dtype."""
    k = w.shape[1]
    x2 = x.reshape(-1, k).to(torch.bfloat16).contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2, w.packed, w.group, w.sz)
    return y.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def dense16(w) -> torch.Tensor:
    """w (quantised or plain) dequantised once into f16 (a Q8_0 value scale * q is at most 2^-11
    from it): the CPU's 16-bit GEMV path that reads half of f32's bytes (f16's single-row product is
    the fast one on our CI CPU; bf16's is not)."""
    return _dense(w).to(torch.float16)


def dense_bf16(w) -> torch.Tensor:
    """w dequantised once into bf16: the fast product for a prefill chunk's rows on our CI CPU
    (~3x f32's at 64 rows, while f16's is ~3x slower than f32's there)."""
    return _dense(w).to(torch.bfloat16)


def bf16_linear(x: torch.Tensor, wb: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x.to(torch.bfloat16), wb).to(x.dtype)


def _dense(w) -> torch.Tensor:
    return dequantize(w) if isinstance(w, QuantizedWeight) else w


def dense16_linear(x: torch.Tensor, w16: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x.to(torch.float16), w16).to(x.dtype)
