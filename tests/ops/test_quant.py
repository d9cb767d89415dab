"""MLX affine quantisation (kiln/ops/quant/reference.py) against mlx itself: mx.quantize's packed
words, scales and biases and mx.dequantize's values, bit for bit, for every bits value and group
size, in f32, bf16 and f16, on random groups, groups with an outlier, constant groups, all-negative
and all-positive groups and groups of zeros."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kiln.ops.quant import reference as quant

mx = pytest.importorskip("mlx.core")

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


def to_mlx(t: torch.Tensor):
    if t.dtype == torch.bfloat16:       # numpy has no bf16: through its bits
        return mx.array(t.view(torch.int16).numpy()).view(mx.bfloat16)
    return mx.array(t.numpy())


def from_mlx(a) -> torch.Tensor:
    if a.dtype == mx.bfloat16:
        return torch.from_numpy(np.array(a.view(mx.int16))).view(torch.bfloat16)
    if a.dtype == mx.uint32:
        return torch.from_numpy(np.array(a).view(np.int32))
    return torch.from_numpy(np.array(a))


def weights(kind: str, dtype, seed: int) -> torch.Tensor:
    w = torch.randn(6, 384, generator=torch.Generator().manual_seed(seed))
    if kind == "outlier":
        w[:, 7] *= 60
    elif kind == "constant":
        w[:] = 0.3
    elif kind == "negative":
        w = -w.abs()
    elif kind == "positive":
        w = w.abs() + 1
    elif kind == "zeros":
        w[:3] = 0
    return w.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("bits", quant.BITS)
@pytest.mark.parametrize("group_size", quant.GROUP_SIZES)
def test_quantize_and_dequantize_are_mlxs_bits(dtype, bits, group_size):
    for seed, kind in enumerate(["random", "outlier", "constant", "negative", "positive", "zeros"]):
        w = weights(kind, dtype, seed)
        packed, scales, biases = mx.quantize(to_mlx(w), group_size=group_size, bits=bits)
        ours = quant.quantize(w, bits, group_size)
        assert torch.equal(ours.packed, from_mlx(packed)), kind
        assert torch.equal(ours.scales, from_mlx(scales)) and torch.equal(ours.biases, from_mlx(biases)), kind
        want = from_mlx(mx.dequantize(packed, scales, biases, group_size=group_size, bits=bits))
        got = quant.dequantize(ours)
        assert got.dtype == want.dtype and torch.equal(got, want), kind


@pytest.mark.parametrize("bits", quant.BITS)
def test_pack_and_unpack_are_inverse(bits):
    q = torch.randint(0, 2 ** bits, (5, 256), generator=torch.Generator().manual_seed(bits))
    packed = quant.pack(q, bits)
    assert packed.shape == (5, 256 * bits // 32) and packed.dtype == torch.int32
    assert torch.equal(quant.unpack(packed, bits), q)


def test_the_edge_of_each_group_comes_back_exactly():
    """The quantiser puts each group's larger-magnitude extreme on a grid point: it comes back exactly."""
    w = torch.randn(4, 128, generator=torch.Generator().manual_seed(3))
    back = quant.dequantize(quant.quantize(w, 4, 64)).reshape(-1, 64)
    groups = w.reshape(-1, 64)
    edge = torch.where(groups.min(-1).values.abs() > groups.max(-1).values.abs(), groups.min(-1).values,
                       groups.max(-1).values)
    assert torch.equal(back.gather(1, groups.sub(edge[:, None]).abs().argmin(-1, keepdim=True))[:, 0], edge)


def test_bad_formats_are_refused():
    with pytest.raises(ValueError, match="bits"):
        quant.quantize(torch.zeros(2, 64), bits=7, group_size=64)
    with pytest.raises(ValueError, match="multiple of the group size"):
        quant.quantize(torch.zeros(2, 48), bits=4, group_size=32)
