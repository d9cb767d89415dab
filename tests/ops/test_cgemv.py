"""The CPU backend's compiled GEMV (kiln/ops/quant/cgemv.py) against the dequantised product in f64:
every bits and group size, ragged row counts, arbitrary biases and GGUF's zero ones, 1-4 rows."""

from __future__ import annotations

import pytest
import torch

from kiln.ops.quant import cgemv
from kiln.weights.quantized import QuantizedWeight, dequantize, pack, quantize

pytestmark = pytest.mark.skipif(not cgemv.available(), reason="no C compiler builds the kernel here")


def _want(x, w):
    return (x.double() @ dequantize(w).double().t())


def _err(got, want) -> float:
    return ((got.double() - want).abs().max() / want.abs().max()).item()


@pytest.mark.parametrize("bits", [2, 3, 4, 5, 6, 8])
@pytest.mark.parametrize("n,k,group", [(37, 64, 32), (16, 256, 64), (100, 384, 128), (3, 128, 32)])
@pytest.mark.parametrize("rows", [1, 4])
def test_mlx_affine_weight_within_f32_rounding(bits, n, k, group, rows):
    g = torch.Generator().manual_seed(bits * 1000 + n + k + rows)
    w = quantize(torch.randn(n, k, generator=g) * 0.1, bits, group)      # biases arbitrary, scales f32
    x = torch.randn(rows, k, generator=g)
    got = cgemv.c_linear(x, cgemv.to_c(w))
    assert got.dtype == x.dtype and got.shape == (rows, n)
    assert _err(got, _want(x, w)) < 1e-5     # f32 sums; a wrong lane, pair or group lands near 1


@pytest.mark.parametrize("bits,half", [(8, 128), (5, 16), (4, 8)])
def test_gguf_zero_point_weight_reads_no_biases_and_keeps_f16_scales(bits, half):
    """Q8_0, Q5_0 and Q4_0 as kiln reads them: bias = -2^(bits-1) * d, d an f16 value (held in f32)."""
    g = torch.Generator().manual_seed(bits)
    n, k = 45, 96
    q = torch.randint(0, 1 << bits, (n, k), generator=g, dtype=torch.int32)
    d = (torch.rand(n, k // 32, generator=g) * 0.01 + 1e-3).half().float()
    w = QuantizedWeight(pack(q, bits), d, -half * d, bits, 32, torch.float32)
    c = cgemv.to_c(w)
    assert c.b.numel() == 0 and c.s.dtype == torch.float16
    x = torch.randn(2, k, generator=g) * torch.logspace(-4, 2, k)      # wide range within a group
    assert _err(cgemv.c_linear(x, c), _want(x, w)) < 1e-5


def test_bf16_activations_come_back_in_bf16():
    w = quantize(torch.randn(32, 64), 4, 32)
    x = torch.randn(1, 64).bfloat16()
    got = cgemv.c_linear(x, cgemv.to_c(w))
    assert got.dtype == torch.bfloat16
    assert _err(got, _want(x.float(), w)) < 1e-2


def test_zero_rows_of_x_give_zeros():
    w = quantize(torch.randn(20, 64), 8, 32)
    assert torch.equal(cgemv.c_linear(torch.zeros(3, 64), cgemv.to_c(w)), torch.zeros(3, 20))


def test_more_rows_than_a_call_takes_run_in_calls_each_row_as_alone():
    w = quantize(torch.randn(40, 64), 4, 32)
    c, x = cgemv.to_c(w), torch.randn(cgemv.MAX_ROWS * 2 + 3, 64)
    alone = torch.cat([cgemv.c_linear(x[i:i + 1], c) for i in range(x.shape[0])])
    assert torch.equal(cgemv.c_linear(x, c), alone)       # batch-invariant: a row's sums do not see the others


def test_fits_takes_up_to_8_bits_on_the_cpu():
    assert cgemv.fits(quantize(torch.randn(16, 64), 8, 32))
    assert not cgemv.fits(torch.randn(16, 64))
