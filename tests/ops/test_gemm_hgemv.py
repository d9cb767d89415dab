"""The CUDA C 16-bit GEMV (kiln/ops/gemm/hgemv.py) against an f64 product: within f32 sums and the
output's rounding, on ragged rows, a K whose last slab is partial, every split, both row passes,
bf16 and f16, one and two rows; with act(g) * u computed as x is loaded, bit for bit act_mul's then
the plain form. Where NVRTC loads but no GPU is here, the forms still compile."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.ops import nvrtc  # noqa: E402
from kiln.ops.gemm import gemm, hgemv  # noqa: E402

SHAPES = [(200, 4096), (1000, 1024), (333, 2056), (7168, 1024), (64, 3584)]


def forms(n, k):
    return gemm.hgemv_fitting(gemm.GemmShape(1, n, k), gemm.GPU_HGEMV + [(16, 2, 1, 1), (32, 8, 2, 2)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k", SHAPES)
def test_hgemv_equals_the_product(n, k, dtype):
    if not torch.cuda.is_available() or not nvrtc.available(torch.device("cuda")):
        pytest.skip("needs a CUDA GPU and NVRTC")
    g = torch.Generator().manual_seed(n + k)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    for m in (1, 2):
        x = (torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-4, 4, (m, k), generator=g).float())).to(dtype)
        ref = x.double() @ w.double().T
        tol = (x.double().abs() @ w.double().abs().T) * 2 ** -20         # f32 summation error's scale
        ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30)))) * (2 ** -7 if dtype == torch.bfloat16
                                                                                 else 2 ** -10)
        vs = forms(n, k)
        assert vs
        xc, wc = x.cuda(), w.cuda()
        for v in vs:
            y = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
            gemm.gemm(xc, wc, v, y)
            torch.cuda.synchronize()
            got = y.cpu().double()
            err = (got - ref).abs()
            assert torch.isfinite(got).all(), f"{v.name}: unwritten outputs"
            assert (err <= ulp + tol).all(), f"{v.name} m={m}: max err {err.max():.3g}, worst {err.argmax()}"


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["silu", "sigmoid"])
@pytest.mark.parametrize("n,k", [SHAPES[1], SHAPES[4]])
def test_hgemv_act_prologue_equals_act_mul_then_the_gemv(n, k, act):
    """act(g) * u computed as x is loaded equals act_mul's output through the plain form, bit for bit."""
    if not torch.cuda.is_available() or not nvrtc.available(torch.device("cuda")):
        pytest.skip("needs a CUDA GPU and NVRTC")
    from kiln.ops.gemm.activation import act_mul
    g = torch.Generator().manual_seed(n + k)
    for dtype in (torch.bfloat16, torch.float16):
        w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype).cuda()
        gu = (torch.randn(2, 2 * k, generator=g) * 3).to(dtype).cuda()
        for v in forms(n, k):
            fused = torch.full((2, n), float("nan"), dtype=dtype, device="cuda")
            gemm.gemm(gu, w, v, fused, act=act)
            plain = gemm.gemm(act_mul(gu[:, :k], gu[:, k:], act).contiguous(), w, v)
            assert torch.equal(fused, plain), f"{v.name} {dtype}: max diff {(fused - plain).abs().max()}"


def test_hgemv_forms_compile():
    """Every form for decode's shapes compiles for sm_90 (NVRTC, no GPU needed)."""
    if not nvrtc.compiler_available():
        pytest.skip("no libnvrtc here")
    for n, k in SHAPES + [(248320, 1024), (12352, 4096), (2048, 512)]:
        for i, v in enumerate(forms(n, k)):
            p = v.p
            for f16, act in ((False, -1), (True, -1), (False, 0), (True, 1)) if i == 0 else ((False, -1),):
                d = hgemv.defines(n, k, p["bn"], p["w"], p["r"], p["sk"], f16, act)
                assert nvrtc.compile_cubin(hgemv.SOURCE, hgemv.NAME, d, (9, 0))[:4] == b"\x7fELF"


def test_hgemv_forms_fit_whole_chunks():
    """No form for a K off the 16-byte chunk; warps never more than the split's slabs."""
    assert forms(4096, 4100) == []
    assert forms(1024, 1024) and all(v.p["w"] * v.p["sk"] * 32 * 8 <= 1024 for v in forms(1024, 1024))
