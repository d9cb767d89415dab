"""The CUDA C DP4A GEMV (kiln/ops/quant/dp4a.py) against its arithmetic written in torch: x made
integer per lane chunk exactly as the kernel makes it, then an f64 product; the kernel must equal it
within f32 sums and the output's rounding. On ragged rows, a K whose last slab is partial, every
split, both row passes, bits 4 and 8, groups 32 to 128, bf16 and f16, one and two rows; with act(g) * u
computed as x is loaded, bit for bit act_mul's then the plain form; with the norm (and the residual add)
computed as x is loaded, bit for bit the rmsnorm kernel's then the plain form. Where NVRTC loads but no
GPU is here, every catalogue form still has to compile."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.ops import nvrtc  # noqa: E402
from kiln.ops.quant import dp4a  # noqa: E402
from kiln.ops.quant import kernels as qk  # noqa: E402
from kiln.weights.quantized import quantize, unpack  # noqa: E402

SHAPES = [(200, 4096, 4, 64), (4096, 3584, 4, 32), (333, 2048, 8, 128), (1000, 3072, 4, 128), (64, 1024, 8, 32)]


def emulated(x: torch.Tensor, w, bits: int, group: int) -> torch.Tensor:
    """y [M, N] in f64 with x rounded as the kernel rounds it: per chunk of 128 / bits inputs,
    round(x * 2^sh) * 2^-sh with 2^14 <= max|x| * 2^sh < 2^15 (f32 exponent arithmetic)."""
    vpl = 128 // bits
    xf = x.float().reshape(x.shape[0], -1, vpl)
    amax = xf.abs().amax(-1, keepdim=True)
    e = (amax.view(torch.int32) >> 23) & 0xFF
    sh = (141 - e).double()
    xh = torch.round(xf.double() * torch.exp2(sh)) * torch.exp2(-sh)
    xs = xf.sum(-1).double()                                 # [M, chunks]: the exact sums, as the bias takes them
    q = unpack(w.packed, bits).double().reshape(w.shape[0], -1, vpl)          # [N, chunks, vpl]
    per = group // vpl
    s = w.scales.double().repeat_interleave(per, dim=1)                       # [N, chunks]
    b = w.biases.double().repeat_interleave(per, dim=1)
    dots = torch.einsum("ncv,mcv->mnc", q, xh)
    return (s[None] * dots + b[None] * xs[:, None, :]).sum(-1)


def bound(x: torch.Tensor, w, bits: int) -> torch.Tensor:
    """Sum of |terms| a row, the scale of f32 summation error: |s q x| + |b x| over K."""
    deq = (unpack(w.packed, bits).float().reshape(w.shape[0], -1, w.group_size) * w.scales.float()[..., None]).reshape(
        w.shape[0], -1)
    bias = w.biases.float().repeat_interleave(w.group_size, dim=1)
    return x.float().abs() @ (deq.abs() + bias.abs()).T


def forms(n, k, bits, group):
    s = qk.QGemvShape(1, n, k, bits, group)
    return qk.dp4a_forms(s, qk.GPU_DP4A + qk.GPU_DP4A_WIDE + qk.GPU_DP4A_NARROW + [(16, 2, 1, 1), (32, 8, 2, 2)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n,k,bits,group", SHAPES)
def test_dp4a_equals_its_arithmetic(n, k, bits, group, dtype):
    if not torch.cuda.is_available() or not nvrtc.available(torch.device("cuda")):
        pytest.skip("needs a CUDA GPU and NVRTC")
    g = torch.Generator().manual_seed(n + k + bits)
    w = quantize((torch.randn(n, k, generator=g) * k ** -0.5).to(dtype), bits, group).to("cuda")
    for m in (1, 2):
        x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-6, 4, (m, k), generator=g).float())
        x = x.to(dtype).cuda()
        ref = emulated(x.cpu(), w.to("cpu"), bits, group)
        tol = bound(x.cpu(), w.to("cpu"), bits).double() * 2 ** -20
        for v in forms(n, k, bits, group):
            y = torch.full((m, n), float("nan"), dtype=dtype, device="cuda")
            qk.qgemv(x, w, v, y)
            torch.cuda.synchronize()
            got = y.cpu().double()
            ulp = torch.exp2(torch.floor(torch.log2(ref.abs().clamp_min(1e-30)))) * (2 ** -7 if dtype == torch.bfloat16
                                                                                     else 2 ** -10)
            err = (got - ref).abs()
            assert torch.isfinite(got).all(), f"{v.name}: unwritten outputs"
            assert (err <= ulp + tol).all(), f"{v.name} m={m}: max err {err.max():.3g}, worst row {err.argmax()}"


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["silu", "sigmoid"])
@pytest.mark.parametrize("n,k,bits,group", [SHAPES[1], SHAPES[2]])
def test_dp4a_act_prologue_equals_act_mul_then_the_gemv(n, k, bits, group, act):
    """act(g) * u computed as x is loaded equals act_mul's output through the plain form, bit for bit."""
    if not torch.cuda.is_available() or not nvrtc.available(torch.device("cuda")):
        pytest.skip("needs a CUDA GPU and NVRTC")
    from kiln.ops.gemm.activation import act_mul
    g = torch.Generator().manual_seed(n + bits)
    for dtype in (torch.bfloat16, torch.float16):
        w = quantize((torch.randn(n, k, generator=g) * k ** -0.5).to(dtype), bits, group).to("cuda")
        x = (torch.randn(2, 2 * k, generator=g) * 3).to(dtype).cuda()
        s = qk.QGemvShape(1, n, k, bits, group, act=act)
        vs = qk.dp4a_forms(s, qk.DP4A_ACT)
        assert vs
        for v in vs:
            fused = torch.full((2, n), float("nan"), dtype=dtype, device="cuda")
            qk.qgemv(x, w, v, fused, act=act)
            plain = qk.qgemv(act_mul(x[:, :k], x[:, k:], act).contiguous(), w, v)
            assert torch.equal(fused, plain), f"{v.name} {dtype}: max diff {(fused - plain).abs().max()}"


EPI_SHAPES = [(2000, 3072, 4, 128), (666, 2048, 8, 128), (7168, 1024, 4, 64)]   # [gate; up]: I 1000, 333, 3584


@pytest.mark.gpu
@pytest.mark.parametrize("act", ["silu", "sigmoid"])
@pytest.mark.parametrize("n,k,bits,group", EPI_SHAPES)
def test_dp4a_act_epilogue_equals_the_gemv_then_act_mul(n, k, bits, group, act):
    """act(gate) * up computed as the outputs are stored equals the same form's plain [gate | up] output
    through act_mul, bit for bit: every catalogue form (splits too), outputs ragged against the block's
    half, one and two rows, bf16 and f16."""
    if not torch.cuda.is_available() or not nvrtc.available(torch.device("cuda")):
        pytest.skip("needs a CUDA GPU and NVRTC")
    from kiln.ops.gemm.activation import act_mul
    g = torch.Generator().manual_seed(n + k + bits)
    s = qk.QGemvShape(1, n, k, bits, group, out_act=act)
    vs = qk.dp4a_forms(s, qk.GPU_DP4A + qk.GPU_DP4A_WIDE + qk.GPU_DP4A_NARROW + [(16, 2, 1, 1), (32, 8, 2, 2)])
    assert any(v.p["sk"] > 1 for v in vs) and any(v.p["sk"] == 1 for v in vs)
    for dtype in (torch.bfloat16, torch.float16):
        w = quantize((torch.randn(n, k, generator=g) * k ** -0.5).to(dtype), bits, group).to("cuda")
        x = (torch.randn(2, k, generator=g) * 2).to(dtype).cuda()
        for v in vs:
            for m in (1, 2):
                fused = torch.full((m, n // 2), float("nan"), dtype=dtype, device="cuda")
                qk.qgemv(x[:m], w, v, fused, act_out=act)
                gate, up = qk.qgemv(x[:m], w, v).split(n // 2, dim=-1)
                want = act_mul(gate.contiguous(), up.contiguous(), act)
                assert torch.equal(fused, want), f"{v.name} {dtype} m={m}: max diff {(fused - want).abs().max()}"


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,bits,group,style", [(1024, 3584, 4, 64, "offset"), (1000, 2048, 8, 128, "llama"),
                                                  (2048, 1024, 4, 32, "plain")])
def test_dp4a_norm_epilogue_equals_the_gemv_then_the_add_and_norm(n, k, bits, group, style):
    """rmsnorm(x W^T + r) and s = x W^T + r, written by the GEMV's last block, equal the same form's
    plain output through the rmsnorm kernel with its add, bit for bit, on two rows (each its own rstd):
    blocks of 8 to 64 rows, 1 to 8 warps, 1 to 8 rows a pass, 1 to 4 splits, N ragged against the block.
    Scales 1/8, biases 0, values below 16 (8-bit words masked to their low nibbles), four +-1 in each x
    row and r in 8ths below 4: every product and s is exact, |s| < 12 in 8ths, and the row's sum of
    squares (~10 a value on average, in 64ths) stays far inside f32's 2^24 units, exact in any order
    (unmasked 8-bit values, ~1,400 a square, would sum past it)."""
    if not torch.cuda.is_available() or not nvrtc.available(torch.device("cuda")):
        pytest.skip("needs a CUDA GPU and NVRTC")
    from kiln.ops.norm import kernels as norm_kernels
    from kiln.weights.quantized import QuantizedWeight
    g = torch.Generator().manual_seed(n + k + bits)
    s = qk.QGemvShape(1, n, k, bits, group, out_norm=style)
    vs = qk.dp4a_forms(s, [(16, 4, 4, 1), (32, 8, 8, 2), (8, 4, 4, 2), (64, 4, 8, 4), (16, 2, 1, 1)])
    assert any(v.p["sk"] > 1 for v in vs) and any(v.p["sk"] == 1 for v in vs)
    for dtype in (torch.bfloat16, torch.float16):
        packed = torch.randint(-2 ** 31, 2 ** 31 - 1, (n, k * bits // 32), generator=g, dtype=torch.int32)
        packed &= 0x0F0F0F0F if bits == 8 else -1
        sb = torch.full((n, k // group), 0.125, dtype=dtype)
        w = QuantizedWeight(packed, sb, torch.zeros_like(sb), bits, group).to("cuda")
        x = torch.zeros(2, k)
        for row in x:
            row[torch.randperm(k, generator=g)[:4]] = torch.randint(0, 2, (4,), generator=g).float() * 2 - 1
        x = x.to(dtype).cuda()
        r = (torch.randint(-31, 32, (2, n), generator=g).float() / 8).to(dtype).cuda()
        nw = (torch.randn(n, generator=g) * 0.2 + (0.0 if style == "offset" else 1.0)).to(dtype).cuda()
        for v in vs:
            y, got_s = (torch.full((2, n), float("nan"), dtype=dtype, device="cuda") for _ in range(2))
            qk.qgemv(x, w, v, y, norm_out={"w": nw, "r": r, "s": got_s, "eps": 1e-6, "style": style})
            ref_s = torch.empty_like(r)
            ref = norm_kernels.rmsnorm(qk.qgemv(x, w, v), nw, 1e-6, style, norm_kernels.TRUSTED, add=r, s=ref_s)
            assert torch.equal(got_s, ref_s), f"{v.name} {dtype}: s differs"
            assert torch.equal(y, ref), f"{v.name} {dtype}: max diff {(y - ref).abs().max()}"


@pytest.mark.gpu
@pytest.mark.parametrize("rw_dtype", [None, "x", torch.float32])
@pytest.mark.parametrize("n,k,bits,group", [(1024, 2048, 4, 64), (200, 512, 8, 32)])
def test_dp4a_pairs_equal_each_experts_plain_gemv(n, k, bits, group, rw_dtype):
    """The routed experts' pair mode (dp4a.run_pairs): each pair's row is the plain form's output on that
    pair's expert and x row, bit for bit (the same kernel arithmetic, the weights offset by the expert
    id), weighted as moe/kernels.py's `weighted` (the output rounded, times the weight in f32, rounded);
    also with act(g) * u in the prologue (x rows [g | u]). Ids repeat an expert and skip others; 3 tokens
    of 4 slots (xdiv 4), then the down projection's one x row a pair (xdiv 1)."""
    if not torch.cuda.is_available() or not nvrtc.available(torch.device("cuda")):
        pytest.skip("needs a CUDA GPU and NVRTC")
    g = torch.Generator().manual_seed(n + k + bits)
    e, slots, t = 6, 4, 3
    for dtype in (torch.bfloat16, torch.float16):
        stack = quantize((torch.randn(e * n, k, generator=g) * k ** -0.5).to(dtype), bits, group)
        stack = type(stack)(*(a.reshape(e, n, -1) for a in (stack.packed, stack.scales, stack.biases)), bits, group)
        stack = stack.to("cuda")
        idx = torch.tensor([[5, 0, 2, 5], [1, 1, 3, 0], [4, 2, 0, 3]], device="cuda").reshape(-1)
        rwt = None if rw_dtype is None else torch.rand(t * slots, generator=g).to(
            dtype if rw_dtype == "x" else rw_dtype).cuda()
        for act, xdiv, rows in ((None, slots, t), ("silu", 1, t * slots)):
            x = (torch.randn(rows, (2 if act else 1) * k, generator=g) * 2).to(dtype).cuda()
            for v in forms(n, k, bits, group)[:6]:
                p = v.p
                if p["sk"] != 1:
                    continue
                y = torch.full((t * slots, n), float("nan"), dtype=dtype, device="cuda")
                dp4a.run_pairs(x, stack, idx, y, p["bn"], p["w"], p["r"], xdiv, -1 if act is None else 0, rwt)
                for pair, ex in enumerate(idx.tolist()):
                    w1 = type(stack)(stack.packed[ex], stack.scales[ex], stack.biases[ex], bits, group)
                    want = qk.qgemv(x[pair // xdiv:pair // xdiv + 1], w1, v, act=act)
                    if rwt is not None:
                        want = (want.float() * rwt[pair].float()).to(dtype)
                    assert torch.equal(y[pair:pair + 1], want), f"{v.name} {dtype} act={act} pair {pair}"


@pytest.mark.gpu
@pytest.mark.parametrize("n,k,bits,group", [(1024, 2048, 4, 64), (200, 512, 8, 32)])
def test_dp4a_pairs_read_negative_ids_from_the_second_stacks(n, k, bits, group):
    """Streamed experts (host=): int32 ids, a negative id -1 - r naming row r of the second stacks (the
    misses staged into device scratch, or in mapped host memory); each pair's row equals the plain form
    on the expert it names, bit for bit, with the act prologue and an f32 routing weight."""
    if not torch.cuda.is_available() or not nvrtc.available(torch.device("cuda")):
        pytest.skip("needs a CUDA GPU and NVRTC")
    g = torch.Generator().manual_seed(n + k + bits + 1)

    def stack(e, dtype):
        w = quantize((torch.randn(e * n, k, generator=g) * k ** -0.5).to(dtype), bits, group)
        return type(w)(*(a.reshape(e, n, -1) for a in (w.packed, w.scales, w.biases)), bits, group).to("cuda")

    for dtype in (torch.bfloat16, torch.float16):
        slots, scratch = stack(3, dtype), stack(4, dtype)
        idx = torch.tensor([2, -1, 0, -4, -2, 1, -3, 2], dtype=torch.int32, device="cuda")
        rwt = torch.rand(idx.numel(), generator=g).cuda()
        x = (torch.randn(idx.numel(), 2 * k, generator=g) * 2).to(dtype).cuda()
        for v in [f for f in forms(n, k, bits, group) if f.p["sk"] == 1][:4]:
            p = v.p
            y = torch.full((idx.numel(), n), float("nan"), dtype=dtype, device="cuda")
            dp4a.run_pairs(x, slots, idx, y, p["bn"], p["w"], p["r"], 1, 0, rwt, host=scratch)
            for pair, r in enumerate(idx.tolist()):
                src, row = (slots, r) if r >= 0 else (scratch, -1 - r)
                w1 = type(src)(src.packed[row], src.scales[row], src.biases[row], bits, group)
                want = (qk.qgemv(x[pair:pair + 1], w1, v, act="silu").float() * rwt[pair]).to(dtype)
                assert torch.equal(y[pair:pair + 1], want), f"{v.name} {dtype} pair {pair} id {r}"


def test_pair_forms_compile():
    """The pair mode's forms (with and without the act prologue and the routing weight, bf16 and f16,
    4 and 8 bits) compile for sm_90 (NVRTC, no GPU needed)."""
    if not nvrtc.compiler_available():
        pytest.skip("no libnvrtc here")
    for n, k, bits in ((1024, 2048, 4), (2048, 512, 4), (1024, 2048, 8)):
        for v in forms(n, k, bits, 64):
            p = v.p
            if p["sk"] != 1:
                continue
            cases = ((-1, 8, 0, False, False), (0, 1, 1, False, False), (0, 1, 2, True, False),
                     (-1, 8, 0, False, True), (0, 1, 2, False, True))     # the last: streamed (int32 ids, host)
            for act, xdiv, rw, f16, streamed in cases:
                d = dp4a.defines(n, k, bits, 64, p["bn"], p["w"], p["r"], 1, f16, act, xdiv=xdiv, rw=rw,
                                 idx32=streamed, host=streamed)
                assert nvrtc.compile_cubin(dp4a.SOURCE, dp4a.NAME, d, (9, 0))[:4] == b"\x7fELF"


@pytest.mark.gpu
@pytest.mark.parametrize("style", ["llama", "offset", "plain"])
@pytest.mark.parametrize("add", [False, True])
@pytest.mark.parametrize("n,k,bits,group", [SHAPES[1], SHAPES[2]])
def test_dp4a_norm_prologue_equals_rmsnorm_then_the_gemv(n, k, bits, group, style, add):
    """rmsnorm(x [+ r]) computed as x is loaded equals the rmsnorm kernel's output through the plain
    form, bit for bit, and s = x + r equals the kernel's, on two rows (each its own rstd, r and s rows).
    x and r are multiples of 1/8 below 4 in size,
    so every sum of squares (of x + r too: under 2^18, in 64ths) is exact in f32 in any order: the rstd
    cannot differ by summation order."""
    if not torch.cuda.is_available() or not nvrtc.available(torch.device("cuda")):
        pytest.skip("needs a CUDA GPU and NVRTC")
    from kiln.ops.norm import kernels as norm_kernels
    g = torch.Generator().manual_seed(n + bits + add)
    grid = lambda: torch.randint(-31, 32, (2, k), generator=g).float() / 8      # noqa: E731
    for dtype in (torch.bfloat16, torch.float16):
        w = quantize((torch.randn(n, k, generator=g) * k ** -0.5).to(dtype), bits, group).to("cuda")
        x, r = grid().to(dtype).cuda(), grid().to(dtype).cuda() if add else None
        nw = (torch.randn(k, generator=g) * 0.2 + (0.0 if style == "offset" else 1.0)).to(dtype).cuda()
        s = qk.QGemvShape(1, n, k, bits, group, style=style, add=add)
        vs = qk.dp4a_forms(s, qk.DP4A_NORM)
        assert vs
        nv = norm_kernels.TRUSTED
        ref_s = torch.empty_like(x)
        normed = norm_kernels.rmsnorm(x, nw, 1e-6, style, nv, add=r, s=ref_s if add else None)
        for v in vs:
            fused = torch.full((2, n), float("nan"), dtype=dtype, device="cuda")
            got_s = torch.full_like(x, float("nan"))
            norm = {"w": nw, "eps": 1e-6, "style": style, "r": r, "s": got_s if add else None}
            qk.qgemv(x, w, v, fused, norm=norm)
            plain = qk.qgemv(normed.contiguous(), w, v)
            assert torch.equal(fused, plain), f"{v.name} {dtype}: max diff {(fused - plain).abs().max()}"
            if add:
                assert torch.equal(got_s, ref_s), f"{v.name} {dtype}: s differs"


def test_catalogue_forms_compile():
    """Every form the catalogue offers for these shapes compiles for sm_90 (NVRTC, no GPU needed)."""
    if not nvrtc.compiler_available():
        pytest.skip("no libnvrtc here")
    for n, k, bits, group in SHAPES + [(248320, 4096, 4, 64), (4096, 12288, 4, 64), (5120, 17408, 4, 64)]:
        for i, v in enumerate(forms(n, k, bits, group)):
            p = v.p
            first = i == 0        # every prologue and dtype on the first form, the plain bf16 one on the rest
            for f16 in (False, True) if first else (False,):
                for act, norm, style in ((-1, 0, 0), (0, 0, 0), (-1, 1, 1), (-1, 2, 0), (-1, 2, 2)) if first else (
                        (-1, 0, 0),):
                    d = dp4a.defines(n, k, bits, group, p["bn"], p["w"], p["r"], p["sk"], f16, act, norm, style)
                    cubin = nvrtc.compile_cubin(dp4a.SOURCE, dp4a.NAME, d, (9, 0))
                    assert cubin[:4] == b"\x7fELF"


def test_prologue_forms_compile():
    """Every prologue form (act, norm with and without the add) compiles for sm_90 on decode's shapes."""
    if not nvrtc.compiler_available():
        pytest.skip("no libnvrtc here")
    for n, k in ((4096, 12288), (24576, 4096), (12352, 4096)):
        for pro, table, extra in (({"act": "silu"}, qk.DP4A_ACT, {"act": 0}),
                                  ({"style": "offset", "add": True}, qk.DP4A_NORM, {"norm": 2, "style": 1})):
            for v in qk.dp4a_forms(qk.QGemvShape(1, n, k, 4, 64, **pro), table):
                p = v.p
                d = dp4a.defines(n, k, 4, 64, p["bn"], p["w"], p["r"], p["sk"], False, **extra)
                assert nvrtc.compile_cubin(dp4a.SOURCE, dp4a.NAME, d, (9, 0))[:4] == b"\x7fELF"


@pytest.mark.parametrize("epilogue", [{"out_norm": "offset"}, {"out_act": "silu"}], ids=["norm", "act"])
def test_epilogue_forms_compile(epilogue):
    """Every norm and act epilogue form on decode's shapes (projections into the residual stream, a
    [gate; up] GEMV) compiles for sm_90."""
    if not nvrtc.compiler_available():
        pytest.skip("no libnvrtc here")
    extra = {"style": 1, "nout": True} if "out_norm" in epilogue else {"act": 0, "epi": True}
    for n, k in ((5120, 17408), (1024, 3584)) if "out_norm" in epilogue else ((34816, 5120), (7168, 1024)):
        s = qk.QGemvShape(1, n, k, 4, 64, **epilogue)
        vs = qk.dp4a_forms(s, qk.GPU_DP4A + qk.GPU_DP4A_WIDE + (qk.GPU_DP4A_NARROW if n <= qk.GPU_DP4A_SMALL_N else []))
        assert vs
        for v in vs:
            p = v.p
            d = dp4a.defines(n, k, 4, 64, p["bn"], p["w"], p["r"], p["sk"], False, **extra)
            assert nvrtc.compile_cubin(dp4a.SOURCE, dp4a.NAME, d, (9, 0))[:4] == b"\x7fELF", v.name


def test_forms_fit_only_whole_chunks():
    """No form for bits whose 16-byte load is not whole groups (2, 3) or a K off the chunk; forms for the
    act and norm prologues."""
    assert forms(4096, 4096, 2, 64) == []
    assert forms(4096, 4096 + 8, 4, 8) == []
    assert qk.dp4a_forms(qk.QGemvShape(1, 4096, 4096, 4, 64, style="llama", add=True), qk.DP4A_NORM)
    assert qk.dp4a_forms(qk.QGemvShape(1, 4096, 4096, 4, 64, act="silu"), qk.DP4A_ACT)
    assert forms(4096, 4096, 4, 64) and all(v.p["w"] <= 4 for v in forms(4096, 4096, 4, 64))


def test_weights_whose_scales_are_not_xs_dtype_take_the_fma_form():
    """The kernel reads scales and biases as x's 16-bit type: a weight with f32 scales (a GGUF's
    kept-quantised tensors) or f16 scales under bf16 x is refused by dp4a (plain and pair mode), and a
    dp4a choice on it runs the fma default instead: the fma form's output, not the CUDA C kernel's."""
    from kiln.weights.quantized import QuantizedWeight
    g = torch.Generator().manual_seed(7)
    x = torch.randn(1, 256, generator=g).to(torch.bfloat16)
    w = quantize((torch.randn(64, 256, generator=g) * 0.06).to(torch.bfloat16), 4, 64)
    wide = QuantizedWeight(w.packed, w.scales.float(), w.biases.float(), 4, 64, out_dtype=torch.bfloat16)
    half = QuantizedWeight(w.packed, w.scales.half(), w.biases.half(), 4, 64, out_dtype=torch.bfloat16)
    assert dp4a.weights_take(x, w) and not dp4a.weights_take(x, wide) and not dp4a.weights_take(x, half)
    stack = QuantizedWeight(*(t.reshape(1, *t.shape) for t in (wide.packed, wide.scales, wide.biases)), 4, 64,
                            out_dtype=torch.bfloat16)
    assert not dp4a.pairs_take(x, stack, torch.zeros(1, dtype=torch.long), None)
    fma = qk.OP.default(qk.QGemvShape(1, 64, 256, 4, 64), qk.device_info(x.device))
    want = qk.qgemv(x, wide, fma)
    assert torch.equal(qk.qgemv(x, wide, qk.dp4a_variant(16, 4, 4, 1)), want)
