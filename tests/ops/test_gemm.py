"""The projection kernels (kiln.ops.gemm: the GEMM and its GEMV, gate|up with its activation, the down
projection of act(g) * u, RMSNorm fused into the next GEMM, act_mul) equal their reference ops on a
grid of small shapes, ragged ones included: under Triton's interpreter on CPU (CI), natively on a
GPU; CudaOps routes to them and falls back. The `gpu` tests check every GPU variant (Hopper's TMA
and persistent forms too) on real model shapes."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from kiln.backends.cuda import CudaOps  # noqa: E402
from kiln.ops.gemm import activation, gelu, gemm, gemm_act, norm_gemm  # noqa: E402
from kiln.tune.device import device_info  # noqa: E402

from .support import DEVICE, DTYPES, REF, STYLES, assert_rounding_close, rand  # noqa: E402

# (M, N, K): ragged rows, columns below a tile, K not a multiple of BK, a single decode row.
GEMM_SHAPES = [(37, 80, 96), (130, 6, 120), (1, 136, 72), (64, 48, 40)]


def gemm_forms(m, n, k, dtype):
    """Every code path: the trusted tiles, split-K (even and ragged), and the TMA forms."""
    forms = [gemm.TRUSTED, gemm.tile_variant(16, 64, 32, 4, 1), gemm.tile_variant(64, 32, 32, 4, 1, sk=2),
             gemm.tile_variant(32, 32, 16, 4, 1, sk=3), gemm.tile_variant(32, 32, 16, 4, 1, sk=3, sum_kernel=True)]
    if dtype != torch.float32 and n % 8 == 0 and k % 8 == 0:
        forms += [gemm.tile_variant(32, 64, 32, 4, 1, tma=True),
                  gemm.tile_variant(16, 32, 32, 4, 1, tma=True, persistent=True)]
    return forms


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", GEMM_SHAPES)
def test_gemm_equals_reference_linear(m, n, k, dtype):
    x, w = rand(m, k, dtype=dtype), rand(n, k, dtype=dtype, seed=1, scale=k ** -0.5)
    want = REF.linear(x, w)
    for v in gemm_forms(m, n, k, dtype):
        assert_rounding_close(gemm.gemm(x, w, v, sms=3), want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", [(37, 80, 96), (130, 48, 200)])
def test_tma_split_k_gemm_equals_reference(m, n, k, dtype):
    """TMA tiles with split-K (the copy engine zero-fills past K; the last arrival adds the partials):
    the interpreter runs tensor descriptors, so this form is checked here though only Hopper offers it."""
    x, w = rand(m, k, dtype=dtype, scale=2.0), rand(n, k, dtype=dtype, seed=1, scale=k ** -0.5)
    want = REF.linear(x, w)
    for sk in (2, 3):
        v = gemm.tile_variant(64, 32, 32, 4, 1, sk=sk, tma=True)
        assert v.name.startswith("tma_") and v.name.endswith(f"_sk{sk}")
        y = torch.full_like(want, float("nan"))
        assert_rounding_close(gemm.gemm(x, w, v, y), want, exact_fraction=0.95)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("m,n,k", [(1, 80, 96), (1, 37, 200), (3, 48, 72)])
def test_gemv_equals_reference(m, n, k, dtype):
    """Decode's GEMV form (no tensor cores; split-K with a last-arrival sum), ragged N and K, and
    correct for a few rows too (the gate runs it on a full block of rows)."""
    x, w = rand(m, k, dtype=dtype, scale=2.0), rand(n, k, dtype=dtype, seed=1, scale=k ** -0.5)
    want = REF.linear(x, w)
    for v in [gemm.gemv_variant(*g) for g in gemm.CPU_GEMV]:
        y = torch.full_like(want, float("nan"))
        assert_rounding_close(gemm.gemm(x, w, v, y), want, exact_fraction=0.95)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["silu", "sigmoid"])
@pytest.mark.parametrize("m,n,k", [(1, 80, 96), (37, 72, 40), (130, 16, 200)])
def test_gemm_act_equals_reference(m, n, k, act, dtype):
    """gate|up in one pass with act(gate) * up in the epilogue (and split-K's last-arrival sum): the
    unfused ops' roundings, up to the GEMM's summation order."""
    x = rand(m, k, dtype=dtype, scale=2.0)
    w = rand(2 * n, k, dtype=dtype, seed=1, scale=2 * k ** -0.5)
    gate, up = w.split(n)
    want = REF.act_mul(REF.linear(x, gate), REF.linear(x, up), act)
    shape = gemm_act.GemmActShape(m, n, k, act)
    forms = gemm_act.OP.candidates(shape, device_info(DEVICE))
    assert gemm_act.UNFUSED in forms and any(v.run is None for v in forms)
    assert n < 64 or any(v.run is None and v.p["sk"] > 1 for v in forms)      # split-K where its tile fits
    for v in forms:
        y = torch.full_like(want, float("nan"))
        gemm_act.OP.run(v, {"x": x, "w": w, "act": act}, {"y": y})
        assert_rounding_close(y, want, exact_fraction=0.95)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["silu", "sigmoid"])
@pytest.mark.parametrize("n,k", [(80, 96), (37, 200)])
def test_act_gemm_equals_reference(n, k, act, dtype):
    """Decode's down projection of act(g) * u: the GEMV forms compute act(g) * u (rounded as act_mul
    rounds) as they load x, ragged N and K, split-K included; the same as act_mul then the GEMM."""
    gu = rand(1, 2 * k, dtype=dtype, scale=3.0)
    w = rand(n, k, dtype=dtype, seed=1, scale=k ** -0.5)
    g, u = gu.split(k, dim=-1)
    want = REF.linear(REF.act_mul(g, u, act), w)
    forms = gemm_act.ACT_OP.candidates(gemm_act.ActGemmShape(1, n, k, act), device_info(DEVICE))
    assert gemm_act.ACT_UNFUSED in forms and sum(v.run is None for v in forms) == len(gemm.CPU_GEMV)
    for v in forms:
        y = torch.full_like(want, float("nan"))
        gemm_act.ACT_OP.run(v, {"gu": gu, "w": w, "act": act}, {"y": y})
        assert_rounding_close(y, want, exact_fraction=0.95)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("act", ["silu", "sigmoid"])
def test_act_mul_equals_reference_on_strided_views(act, dtype):
    """act(g) * u over the halves of a concatenated projection (row-strided views), ragged widths,
    and over Qwen3.5's per-head interleaved gate [T, H, D] (stride 2D per head)."""
    gu = rand(7, 2 * 1100, dtype=dtype, scale=3.0)
    g, u = gu.split(1100, dim=-1)
    assert_rounding_close(activation.act_mul(g, u, act), REF.act_mul(g, u, act), exact_fraction=0.99)
    qg = rand(5, 3, 2 * 40, dtype=dtype, seed=4, scale=3.0)
    q, gate = qg.chunk(2, dim=-1)
    o = rand(5, 3, 40, dtype=dtype, seed=5)
    got = CudaOps(DEVICE).act_mul(gate, o, act)
    assert got.shape == o.shape and got.is_contiguous()
    assert_rounding_close(got, REF.act_mul(gate, o, act), exact_fraction=0.99)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_gelu_mul_equals_reference_on_strided_views(dtype, monkeypatch):
    """Gemma's GELU (tanh form) times up in one launch, through CudaOps.act_mul, over the halves of a
    concatenated projection (row-strided views), ragged widths. Above g = -3 as the reference rounds.
    Below it torch's 0.5 g (1 + tanh(u)) cancels: its f32 1 + tanh is off by up to ~2 ulp of 1.0
    (2.4e-7), so its act is off by up to 1.2e-7 |g| (most of the value out there), where the kernel's
    g sigmoid(2u) keeps the value's own precision: compared within that bound (it vanishes in the
    down projection's sum)."""
    gu = rand(7, 2 * 1100, dtype=dtype, scale=4.0)
    g, u = gu.split(1100, dim=-1)
    calls, real = [], gelu.gelu_mul
    monkeypatch.setattr(gelu, "gelu_mul", lambda *a: calls.append(1) or real(*a))
    got = CudaOps(DEVICE).act_mul(g, u, "gelu_pytorch_tanh")
    want = REF.act_mul(g, u, "gelu_pytorch_tanh")
    assert calls and got.is_contiguous()
    far = g < -3
    assert_rounding_close(got[~far], want[~far], exact_fraction=0.99)
    ulp = lambda t: t.float().abs() * torch.finfo(dtype).eps + 1e-30  # noqa: E731
    bound = 1.2e-7 * (g.float() * u.float()).abs() * 1.01 + ulp(want) + ulp(got)
    assert ((got.float() - want.float()).abs() <= bound)[far].all()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("m,n,k", [(37, 80, 96), (1, 136, 72), (64, 6, 40)])
def test_rmsnorm_gemm_equals_reference(m, n, k, style, dtype):
    x = rand(m, k, dtype=dtype, scale=3.0)
    nw = rand(k, dtype=dtype, seed=1, scale=0.2, shift=0.0 if style == "offset" else 1.0)
    w = rand(n, k, dtype=dtype, seed=2, scale=k ** -0.5)
    want = REF.rmsnorm_linear(x, nw, 1e-6, style, w)
    for v in (norm_gemm.fused_variant(32, 32, 32, 4, 1), norm_gemm.fused_variant(16, 64, 16, 4, 1)):
        assert_rounding_close(norm_gemm.rmsnorm_gemm(x, nw, 1e-6, style, w, v), want)
    for v in (norm_gemm.UNFUSED, norm_gemm.UNFUSED_TRUSTED):
        y = torch.empty_like(want)
        norm_gemm.OP.run(v, {"x": x, "norm_w": nw, "w": w, "eps": 1e-6, "style": style}, {"y": y})
        assert_rounding_close(y, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("n,k", [(136, 72), (37, 200)])
def test_rmsnorm_gemv_with_the_residual_add_equals_reference(n, k, style, dtype):
    """Decode's norm in the GEMV's prologue: every program norms the whole row, one writes s = x + r;
    with and without the add, against the rmsnorm kernel then the GEMM (unfused: the same op's form)."""
    x, r = rand(1, k, dtype=dtype, scale=3.0), rand(1, k, dtype=dtype, seed=3)
    nw = rand(k, dtype=dtype, seed=1, scale=0.2, shift=0.0 if style == "offset" else 1.0)
    w = rand(n, k, dtype=dtype, seed=2, scale=k ** -0.5)
    want_s, h = REF.add_rmsnorm(x, r, nw, 1e-6, style)
    want = REF.linear(h, w)
    forms = norm_gemm.OP.candidates(norm_gemm.NormGemmShape(1, n, k, style, True), device_info(DEVICE))
    assert {v.name for v in forms if v.p.get("gemv")} == {gemm.gemv_variant(*g).name for g in gemm.CPU_GEMV}
    if DEVICE.type == "cpu":    # the LM head's one-row shape gets no GEMV forms under the interpreter (slow)
        lm_head = norm_gemm.NormGemmShape(1, n, k, style)
        assert not [v for v in norm_gemm.OP.candidates(lm_head, device_info(DEVICE)) if v.p.get("gemv")]
    one_pass = gemm.gemv_variant(16, 1 << (k - 1).bit_length(), 1, 4, 1, True)     # whole row in one span: x read once
    for add in (False, True):
        for v in [gemm.gemv_variant(*g) for g in gemm.CPU_GEMV] + [one_pass, norm_gemm.UNFUSED,
                                                                    norm_gemm.UNFUSED_TRUSTED]:
            inputs = {"x": x, "norm_w": nw, "w": w, "eps": 1e-6, "style": style, "r": r if add else None}
            out = {"y": torch.full_like(want, float("nan"))} | ({"s": torch.full_like(x, float("nan"))} if add else {})
            norm_gemm.OP.run(v, inputs, out)
            assert_rounding_close(out["y"], want if add else REF.rmsnorm_linear(x, nw, 1e-6, style, w),
                                  exact_fraction=0.95)
            if add:
                assert torch.equal(out["s"], want_s)


@pytest.mark.parametrize("act", ["silu", "sigmoid"])
def test_cuda_ops_norm_mlp_in_two_gemvs_equals_reference(act, monkeypatch):
    """CudaOps.add_rmsnorm_gated_mlp when the tuner chose the GEMV forms: gate|up with the add and
    the norm in its prologue, then the down GEMV computing act(g) * u: (s, mlp) as the reference's."""
    h, i = 96, 80
    x, r = rand(1, h, dtype=torch.bfloat16, scale=2.0), rand(1, h, dtype=torch.bfloat16, seed=1)
    nw = rand(h, dtype=torch.bfloat16, seed=2, scale=0.2)
    gate_up = rand(2 * i, h, dtype=torch.bfloat16, seed=3, scale=h ** -0.5)     # packed: gate rows, then up's
    down = rand(h, i, dtype=torch.bfloat16, seed=4, scale=i ** -0.5)
    ops = CudaOps(DEVICE)
    picks = {"rmsnorm_gemm": gemm.gemv_variant(*gemm.CPU_GEMV[1]), "act_gemm": gemm.gemv_variant(*gemm.CPU_GEMV[0]),
             "gemm_act": gemm_act.UNFUSED}
    used = []
    monkeypatch.setattr(ops, "choose", lambda op, shape: used.append(op.name) or picks.get(op.name) or
                        op.default(shape, ops.dev))
    s, m = ops.add_rmsnorm_gated_mlp(x, r, nw, 1e-6, "offset", gate_up, down, act)
    want_s, want_m = REF.add_rmsnorm_gated_mlp(x, r, nw, 1e-6, "offset", gate_up, down, act)
    assert {"rmsnorm_gemm", "act_gemm"} <= set(used)
    assert torch.equal(s, want_s)
    assert_rounding_close(m, want_m, exact_fraction=0.9)


def test_cuda_ops_norm_then_projections_in_one_gemv_equals_reference(monkeypatch):
    """CudaOps.add_rmsnorm_linear_split when the tuner chose the GEMV form: the next layer's
    packed projections with the residual add and its input norm in the GEMV's prologue; with the
    unfused choice, the same result through add_rmsnorm then linear_split."""
    h, sizes = 72, [40, 24, 8]
    x, r = rand(1, h, dtype=torch.bfloat16, scale=2.0), rand(1, h, dtype=torch.bfloat16, seed=1)
    nw = rand(h, dtype=torch.bfloat16, seed=2, scale=0.2)
    packed = rand(sum(sizes), h, dtype=torch.bfloat16, seed=3, scale=h ** -0.5)
    want_s, want = REF.add_rmsnorm_linear_split(x, r, nw, 1e-6, "offset", packed, sizes)
    for pick in (gemm.gemv_variant(*gemm.CPU_GEMV[1]), norm_gemm.UNFUSED):
        ops = CudaOps(DEVICE)
        monkeypatch.setattr(ops, "choose", lambda op, shape: pick if op.name == "rmsnorm_gemm" else
                            op.default(shape, ops.dev))
        s, ys = ops.add_rmsnorm_linear_split(x, r, nw, 1e-6, "offset", packed, sizes)
        assert torch.equal(s, want_s) and [y.shape for y in ys] == [w_.shape for w_ in want]
        for y, w_ in zip(ys, want):
            assert_rounding_close(y, w_, exact_fraction=0.9)


def test_cuda_ops_route_and_fall_back():
    ops = CudaOps(DEVICE)
    x = rand(3, 7, 48, dtype=torch.bfloat16)           # [batch, T, K]: any leading shape
    w, b = rand(40, 48, dtype=torch.bfloat16, seed=1), rand(40, dtype=torch.bfloat16, seed=2)
    assert_rounding_close(ops.linear(x, w), REF.linear(x, w))
    assert torch.equal(ops.linear(x, w, b), REF.linear(x, w, b))           # bias: the reference
    nw = rand(48, dtype=torch.bfloat16, seed=3, scale=0.1)
    assert_rounding_close(ops.rmsnorm(x, nw, 1e-6, "offset"), REF.rmsnorm(x, nw, 1e-6, "offset"))
    assert_rounding_close(ops.rmsnorm_linear(x[0], nw, 1e-6, "offset", w),
                          REF.rmsnorm_linear(x[0], nw, 1e-6, "offset", w))
    assert torch.equal(ops.linear(x.double(), w.double()), REF.linear(x.double(), w.double()))   # no f64 kernels


# -- on the GPU: every variant of the catalogue on the model's real shapes --------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("m,n,k", [(451, 1024, 3584), (1, 6144, 1024), (300, 16, 1024)])
def test_gpu_every_gemm_variant_equals_cublas(m, n, k):
    dev = device_info(DEVICE)
    x, w = rand(m, k, dtype=torch.bfloat16), rand(n, k, dtype=torch.bfloat16, seed=1, scale=k ** -0.5)
    want = F.linear(x.float(), w.float())
    catalogue = gemm.OP.catalogue(gemm.GemmShape(m, n, k), dev)
    assert any(v.p.get("tma") for v in catalogue) == (dev.tma and n % 8 == 0)
    # What the tuner measures for these columns at the prefill chunk and at decode, and every TMA form.
    forms = {v: None for s in (512, 1) for v in gemm.OP.candidates(gemm.GemmShape(s, n, k), dev)}
    forms.update({v: None for v in catalogue if v.p.get("tma")})
    for v in forms:
        y = gemm.gemm(x, w, v, sms=dev.sms).float()
        assert (y - want).abs().max().item() <= 2e-2 * want.abs().max().item(), v.name


@pytest.mark.gpu
@gpu
def test_gpu_gemm_forms_past_2_31_output_elements():
    """An LM head of 262,144 columns over 8,200 rows writes 2.15e9 elements: row offsets past 2^31
    must not wrap (the GEMV's did, an illegal access on gemma3-270m's teacher-forced compare)."""
    dev, (m, n, k) = device_info(DEVICE), (8200, 262144, 64)
    x, w = rand(m, k, dtype=torch.bfloat16), rand(n, k, dtype=torch.bfloat16, seed=1, scale=k ** -0.5)
    tail = slice(m - 3, m)   # the rows whose offsets pass 2^31
    want = F.linear(x[tail].float(), w.float())
    for v in (gemm.gemv_variant(16, 64, 1, 4), gemm.gemv_variant(16, 64, 2, 4),
              gemm.OP.default(gemm.GemmShape(m, n, k), dev)):
        y = gemm.gemm(x, w, v, sms=dev.sms)[tail].float()
        assert (y - want).abs().max().item() <= 2e-2 * want.abs().max().item(), v.name
        del y
        torch.cuda.empty_cache()
