"""The RMSNorm kernels (kiln.ops.norm) equal the reference op on a grid of small shapes, ragged ones
included: under Triton's interpreter on CPU (CI), natively on a GPU. The `gpu` test checks every GPU
variant on a real model's shape."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.backends.cuda import CudaOps  # noqa: E402
from kiln.ops.norm import kernels as norm_kernels  # noqa: E402
from kiln.ops.norm import sandwich  # noqa: E402
from kiln.tune.device import device_info  # noqa: E402

from .support import DEVICE, DTYPES, REF, STYLES, assert_rounding_close, rand  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("shape", [(37, 96), (130, 40), (1, 200)])
def test_rmsnorm_equals_reference(shape, style, dtype):
    x = rand(*shape, dtype=dtype, scale=3.0)
    w = rand(shape[-1], dtype=dtype, seed=1, scale=0.2, shift=0.0 if style == "offset" else 1.0)
    want = REF.rmsnorm(x, w, 1e-6, style)
    for v in (norm_kernels.TRUSTED, norm_kernels.norm_variant(4, 2), norm_kernels.norm_variant(64, 4)):
        assert_rounding_close(norm_kernels.rmsnorm(x, w, 1e-6, style, v), want)


def test_rmsnorm_reads_strided_heads():
    """q after Qwen3.5's per-head split is a strided view [T, H, D]: normed per head, in place of a copy."""
    qg = rand(5, 3, 2 * 40, dtype=torch.bfloat16, scale=2.0)
    q = qg.chunk(2, dim=-1)[0]
    w = rand(40, dtype=torch.bfloat16, seed=2, scale=0.2)
    assert not q.is_contiguous()
    assert_rounding_close(norm_kernels.rmsnorm(q, w, 1e-6, "offset", norm_kernels.norm_variant(4, 4)),
                          REF.rmsnorm(q, w, 1e-6, "offset"))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("shape", [(1, 96), (37, 200)])
def test_add_rmsnorm_equals_reference(shape, style, dtype):
    """The residual sum is rounded then normalised: s bit-equal to torch's add, y as rmsnorm of it."""
    x, r = rand(*shape, dtype=dtype, scale=3.0), rand(*shape, dtype=dtype, seed=3)
    w = rand(shape[-1], dtype=dtype, seed=1, scale=0.2, shift=0.0 if style == "offset" else 1.0)
    want_s, want_y = REF.add_rmsnorm(x, r, w, 1e-6, style)
    for v in (norm_kernels.TRUSTED, norm_kernels.norm_variant(4, 2)):
        s = torch.full_like(x, float("nan"))
        y = norm_kernels.rmsnorm(x, w, 1e-6, style, v, add=r, s=s)
        assert torch.equal(s, want_s)
        assert_rounding_close(y, want_y)
    s, y = CudaOps(DEVICE).add_rmsnorm(x, r, w, 1e-6, style)
    assert torch.equal(s, want_s) and not torch.isnan(y).any()


# -- on the GPU: every variant of the catalogue on a real model's shape --------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("style", STYLES)
def test_gpu_rmsnorm_variants_equal_reference(style):
    x = rand(513, 1024, dtype=torch.bfloat16, scale=3.0)
    w = rand(1024, dtype=torch.bfloat16, seed=1, scale=0.2, shift=0.0 if style == "offset" else 1.0)
    want = REF.rmsnorm(x, w, 1e-6, style)
    for v in norm_kernels.OP.catalogue(norm_kernels.NormShape(513, 1024, style), device_info(DEVICE)):
        assert_rounding_close(norm_kernels.rmsnorm(x, w, 1e-6, style, v), want, exact_fraction=0.95)


# -- Gemma 4's residual step (kiln.ops.norm.sandwich) ---------------------------------------------------

@pytest.mark.parametrize("form", ["attention", "moe", "dense", "ple"])
@pytest.mark.parametrize("rows", [1, 5])
def test_residual_norms_equal_reference(form, rows, monkeypatch):
    """The reference's composition (each norm, sum and product rounded where it rounds) to the order of
    the sums of squares: a norm computed in another order may land one bf16 ulp off, and what is built
    on it carries that. So s is within eps * (3|s| + 2|x|) of the reference (an ulp of the normed
    branch, which is at most |s| + |x|, plus s's own rounding; doubled where two branches feed a norm),
    each normed output within two ulps of its value, the router's input (three roundings on a normed
    value) within three; and nearly all values bit-equal. Forms as Gemma 4 calls it: after attention
    (two norms of s and the router's input), after the MLP and experts (two branches, the layer
    scalar, the next norm), dense, and the PLE branch."""
    d, dtype = 200, torch.bfloat16
    eps = torch.finfo(dtype).eps
    x, a, b = (rand(rows, d, dtype=dtype, seed=s, scale=sc) for s, sc in ((1, 3.0), (2, 1.0), (3, 2.0)))
    w = [rand(d, dtype=dtype, seed=10 + j, scale=0.2, shift=1.0) for j in range(6)]
    scalar = torch.tensor([0.37], dtype=dtype, device=x.device)
    kwargs = {"attention": dict(outs=(w[1], w[2]), router=w[3]),
              "moe": dict(a_w=w[1], b=b, b_w=w[2], scalar=scalar, outs=(w[3],)),
              "dense": dict(scalar=scalar, outs=(w[3],)),
              "ple": dict(a_w=w[1], b=b, b_w=w[2])}[form]
    want_s, want_ys = REF.residual_norms(x, a, 1e-6, "plain", w[0], **kwargs)
    assert len(want_ys) == len(kwargs.get("outs", ())) + ("router" in kwargs)
    ulps = [2] * len(kwargs.get("outs", ())) + [3] * ("router" in kwargs)

    def near(got, want, bound):
        assert got.dtype == want.dtype and got.shape == want.shape and not torch.isnan(got).any()
        assert ((got.float() - want.float()).abs() <= bound).all()
        assert (got == want).float().mean().item() >= 0.98

    for v in (sandwich.TRUSTED, sandwich.CPU_TRUSTED, norm_kernels.norm_variant(4, 2)):
        got_s, got_ys = sandwich.residual_norms(x, a, 1e-6, "plain", w[0], v, **kwargs)
        near(got_s, want_s, eps * (3 * want_s.float().abs() + 2 * x.float().abs()))
        assert len(got_ys) == len(want_ys)
        for got, want, n in zip(got_ys, want_ys, ulps):
            near(got, want, n * eps * want.float().abs().clamp_min(1e-3))
    launched = []
    monkeypatch.setattr(sandwich, "residual_norms", lambda *a, **k: launched.append(1) or (want_s, want_ys))
    CudaOps(DEVICE).residual_norms(x, a, 1e-6, "plain", w[0], **kwargs)
    assert launched, "the cuda backend runs the fused kernel"


def test_residual_norms_op_gate_passes_every_candidate():
    """The registry op, in the form Gemma 4's MoE layers call after the MLP: every candidate passes
    the gate against the trusted variant."""
    from kiln.tune import gate

    op, dev = sandwich.OP, device_info(DEVICE)
    s = sandwich.ResidualShape(5, 96, "plain", True, True, 1, False)
    gen = torch.Generator(DEVICE).manual_seed(3)
    cases = gate.trusted_cases(op, s, op.trusted(s, dev), torch.bfloat16, DEVICE, gen)
    for v in op.candidates(s, dev):
        assert gate.check(op, v, cases).ok, v.name
