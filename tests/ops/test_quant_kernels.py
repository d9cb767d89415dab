"""The quantised GEMV (kiln.ops.quant.kernels) equals F.linear on mx.dequantize's weight: every bits
value and group size, every form (words, grouped, acc, gather), ragged output counts, several rows; under Triton's
interpreter on CPU, natively on a GPU. The tuner's gate passes every candidate and rejects a wrong
one; CudaOps routes a quantised projection to it at decode and to one dequantised GEMM beyond."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kiln.backends.cuda import CudaOps  # noqa: E402
from kiln.ops.quant import cuda as quant_cuda  # noqa: E402
from kiln.ops.quant import kernels  # noqa: E402
from kiln.ops.quant.reference import dequantize, quantize, unpack  # noqa: E402
from kiln.tune import gate  # noqa: E402
from kiln.tune.device import device_info  # noqa: E402
from kiln.tune.registry import extra_variant, variant  # noqa: E402

from .support import DEVICE, rand  # noqa: E402

BITS = (2, 3, 4, 5, 6, 8)


def quantized(n: int, k: int, bits: int, group: int, dtype=torch.float32, seed: int = 1):
    return quantize(rand(n, k, dtype=dtype, seed=seed, scale=k ** -0.5), bits, group)


def forms(bits: int, group: int, k: int) -> list:
    """Every form where it applies, at the interpreter's block sizes (K in one step and in several;
    the FMA form also split in two, with x in the words' layout and with its prefetch)."""
    out = [kernels.qgemv_variant(bn, bk, 4, *form) for bn, bk in ((8, 128), (16, 256))
           for form in kernels.FORMS if form[0] or 32 % bits == 0]
    if 32 % bits == 0:
        words, wg = k * bits // 32, group * bits // 32
        out += [kernels.fma_variant(8, words, 4, 1), kernels.fma_variant(16, wg, 4, 1, x3=True),
                kernels.fma_variant(8, wg, 4, 2, x3=True), kernels.fma_variant(8, wg, 4, 1, pf=True)]
    return out


@pytest.mark.parametrize("group", (32, 64, 128))
@pytest.mark.parametrize("bits", BITS)
def test_qgemv_equals_linear_on_the_dequantised_weight(bits, group):
    """f32: the FMA form sums in another order than dequantise-then-matmul, and nothing else."""
    n, k = 37, 256                       # 37 outputs: the last block of rows is ragged
    w = quantized(n, k, bits, group)
    x = rand(3, k, seed=2)
    want = F.linear(x, dequantize(w))
    for v in forms(bits, group, k):
        got = kernels.qgemv(x, w, v)
        err = (got - want).abs().max().item()
        assert err <= 1e-5 * want.abs().max().item(), (v.name, err)


@pytest.mark.parametrize("bits", (3, 4))
def test_qgemv_bf16_within_the_rounding_of_the_dequantised_weight(bits):
    """bf16: the reference rounds each dequantised weight to bf16, the kernel uses scale * q + bias in
    f32; the difference is that rounding, a few bf16 ulps of the output at most."""
    n, k = 64, 512
    w = quantized(n, k, bits, 64, dtype=torch.bfloat16)
    x = rand(1, k, dtype=torch.bfloat16, seed=3)
    exact = F.linear(x.float(), w.scales.float().repeat_interleave(64, -1) * _values(w) +
                     w.biases.float().repeat_interleave(64, -1))       # the FMA form's own arithmetic in f32
    for v in forms(bits, 64, k):
        got = kernels.qgemv(x, w, v).float()
        ulp = exact.abs().clamp_min(1e-2) * torch.finfo(torch.bfloat16).eps
        assert ((got - exact).abs() <= ulp).all(), v.name


def _values(w) -> torch.Tensor:
    return unpack(w.packed, w.bits).float()


def test_gate_passes_every_candidate_and_rejects_a_wrong_one():
    """The registry op through the tuner's gate (full and partial block): every candidate of a 3-bit
    and a 4-bit shape agrees with the trusted dequantise-then-linear; a form that drops the biases
    (off by sum(x) * bias, a plausible bug) is rejected."""
    op, dev = kernels.OP, device_info(DEVICE)

    def no_bias(inputs, outputs, plan):
        w = inputs["w"]
        kernels.qgemv(inputs["x"], type(w)(w.packed, w.scales, torch.zeros_like(w.biases), w.bits, w.group_size),
                      kernels.qgemv_variant(8, 128, 4, True), outputs["y"])

    for bits in (3, 4):
        s = kernels.QGemvShape(1, 40, 256, bits, 64)
        gen = torch.Generator(device=DEVICE).manual_seed(5)
        cases = gate.trusted_cases(op, s, op.trusted(s, dev), torch.bfloat16, DEVICE, gen)
        for v in op.candidates(s, dev):
            verdict = gate.check(op, v, cases)
            assert verdict.ok, (bits, v.name, verdict)
        with extra_variant("qgemv", variant("no_bias", run=no_bias)) as bad:
            assert not gate.check(op, bad, cases).ok


def test_cuda_ops_route_quantised_projections(monkeypatch):
    """Decode rows go to the quantised GEMV (packed projections as one launch, then split); more
    rows to one dequantised GEMM; both equal the reference."""
    ops = CudaOps(DEVICE)
    w = quantized(96, 128, 4, 32)
    calls = []
    real = kernels.qgemv
    monkeypatch.setattr(kernels, "qgemv", lambda *a, **k: calls.append(tuple(a[0].shape)) or real(*a, **k))
    x1, xs = rand(1, 128, seed=4), rand(quant_cuda.GEMV_ROWS + 3, 128, seed=5)
    parts = ops.linear_split(x1, w, [32, 64])
    assert calls == [(1, 128)] and [p.shape[-1] for p in parts] == [32, 64]
    want = F.linear(x1, dequantize(w))
    assert (torch.cat(parts, -1) - want).abs().max() <= 1e-5 * want.abs().max()
    y = ops.linear(xs, w)
    assert len(calls) == 1          # not the GEMV: one GEMM on the dequantised weight
    want = F.linear(xs, dequantize(w))
    assert (y - want).abs().max() <= 1e-5 * want.abs().max()


def test_quant_workloads_come_from_the_weights():
    w4, w8 = quantized(64, 128, 4, 64), quantized(32, 256, 8, 32)
    got = quant_cuda.quant_workloads({"a": w4, "b": w8, "c": w4, "d": torch.zeros(3, 3)})
    assert [s for _, s in got] == [kernels.QGemvShape(1, 32, 256, 8, 32), kernels.QGemvShape(1, 64, 128, 4, 64)]


# -- on the GPU: real model shapes ------------------------------------------------------------------

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bits", (2, 3, 4, 8))
def test_every_gpu_candidate_passes_the_gate_on_qwen35_9b_shapes(bits):
    op, dev = kernels.OP, device_info(DEVICE)
    for n, k in ((4096, 12288), (24576, 4096)):
        s = kernels.QGemvShape(1, n, k, bits, 64)
        cases = gate.trusted_cases(op, s, op.trusted(s, dev), torch.bfloat16, DEVICE,
                                   torch.Generator(device=DEVICE).manual_seed(0))
        # one block depth and warp count (each candidate compiles: every one would take minutes)
        for v in [v for v in op.candidates(s, dev) if (v.p.get("bk") == 512 or v.p.get("bw") == 64)
                  and v.p.get("w", 4) == 4 and v.p.get("bn", 16) == 16]:
            assert gate.check(op, v, cases).ok, (s, v.name)
