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
from kiln.ops.norm.reference import NormReference  # noqa: E402
from kiln.ops.quant import cuda as quant_cuda  # noqa: E402
from kiln.ops.quant import kernels  # noqa: E402
from kiln.ops.quant.reference import dequantize, quantize, unpack  # noqa: E402
from kiln.tune import gate  # noqa: E402
from kiln.tune.device import device_info  # noqa: E402
from kiln.tune.registry import extra_variant, variant  # noqa: E402

from .support import DEVICE, captured, rand  # noqa: E402

BITS = (2, 3, 4, 5, 6, 8)


def quantized(n: int, k: int, bits: int, group: int, dtype=torch.float32, seed: int = 1):
    return quantize(rand(n, k, dtype=dtype, seed=seed, scale=k ** -0.5), bits, group)


def forms(bits: int, group: int, k: int) -> list:
    """Every form where it applies, at the interpreter's block sizes (K in one step and in several;
    the FMA form in one step, split in two with x in the words' layout, and with its prefetch)."""
    out = [kernels.qgemv_variant(bn, bk, 4, *form) for bn, bk in ((8, 128), (16, 256))
           for form in kernels.FORMS if form[0] or 32 % bits == 0]
    if 32 % bits == 0:
        words, wg = k * bits // 32, group * bits // 32
        out += [kernels.fma_variant(8, words, 4, 1), kernels.fma_variant(8, wg, 4, 2, x3=True)]
        if group == 64:     # the prefetch and one-group steps at one group size (CI's time)
            out += [kernels.fma_variant(16, wg, 4, 1, pf=True)]
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


@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
@pytest.mark.parametrize("bits", (2, 4))
def test_tensor_core_form_within_the_rounding_of_the_dequantised_weight(bits, dtype):
    """The tensor-core form (16-bit 1 + q / 2^m against a block-diagonal x, then scale and bias once a
    group in f32): within a 16-bit ulp of the exact f32 arithmetic, whole and split groups, dead
    products in a split's last chunk, several rows, a ragged last block of rows."""
    n, k = 40, 512
    w = quantized(n, k, bits, 64, dtype=dtype)
    x = rand(2, k, dtype=dtype, seed=3)
    exact = F.linear(x.float(), w.scales.float().repeat_interleave(64, -1) * _values(w) +
                     w.biases.float().repeat_interleave(64, -1))
    for v in kernels.mma_forms(kernels.QGemvShape(1, n, k, bits, 64), kernels.TEST_MMA):
        got = kernels.qgemv(x, w, v).float()
        ulp = exact.abs().clamp_min(1e-2) * torch.finfo(dtype).eps
        assert ((got - exact).abs() <= ulp).all(), (v.name, (got - exact).abs().max())


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


@pytest.mark.parametrize("pairs,act", [("0", "silu"), ("1", "silu"), ("1", "gelu_pytorch_tanh"), ("1", None)])
def test_quant_workloads_come_from_the_weights(monkeypatch, pairs, act):
    monkeypatch.setenv("KILN_DP4A_PAIRS", pairs)
    w4, w8 = quantized(64, 128, 4, 64), quantized(32, 256, 8, 32)
    stack = quantize(rand(3, 96, 128, seed=2), 4, 64)     # routed experts [E, N, K]: one expert's shape
    got = quant_cuda.quant_workloads({"a": w4, "b": w8, "c": w4, "d": torch.zeros(3, 3), "e": stack,
                                      "f": torch.zeros(2, 3, 3)}, act=act)
    want = [kernels.QGemvShape(1, 32, 256, 8, 32), kernels.QGemvShape(1, 64, 128, 4, 64)]
    # the stack's expert shape only where the dp4a pair mode takes its tuned form (not Gemma's tanh GELU)
    dp4a = pairs == "1" and act == "silu"
    assert [s for _, s in got] == want + ([kernels.QGemvShape(1, 96, 128, 4, 64)] if dp4a else [])


@pytest.mark.parametrize("cuda_c", (False, True))
def test_act_epilogue_workloads_come_from_the_gate_up_gemvs(cuda_c):
    """A one-row gemm_act workload on a quantised [2I, K] weight adds its act epilogue shape where the
    dp4a forms run (`cuda_c`); not a prefill's rows, a torch activation or bits the dp4a forms lack."""
    from kiln.ops.gemm import gemm_act
    from kiln.tune.tuner import Workload

    gu4, gu3 = quantized(128, 64, 4, 32), quantized(64, 256, 3, 64)
    base = [Workload(gemm_act.OP, gemm_act.GemmActShape(1, 64, 64, "silu")),
            Workload(gemm_act.OP, gemm_act.GemmActShape(512, 64, 64, "silu")),            # prefill
            Workload(gemm_act.OP, gemm_act.GemmActShape(1, 64, 64, "gelu_pytorch_tanh")),
            Workload(gemm_act.OP, gemm_act.GemmActShape(1, 32, 256, "silu"))]            # 3-bit
    got = [s for _, s in quant_cuda.quant_workloads({"gu": gu4, "gu3": gu3}, base, cuda_c=cuda_c)]
    plain = [kernels.QGemvShape(1, 64, 256, 3, 64), kernels.QGemvShape(1, 128, 64, 4, 32)]
    assert got == sorted(plain + ([kernels.QGemvShape(1, 128, 64, 4, 32, out_act="silu")] if cuda_c else []),
                         key=lambda s: (s.key[:4], len(s.key)))


def test_the_act_epilogues_unfused_form_runs_the_plain_gemv_then_act_mul(monkeypatch):
    """`unfused` for an out_act shape runs the plan's plain choice without its epilogue, even where that
    choice is a dp4a form (which would compute the epilogue itself), then the act_mul kernel."""
    from types import SimpleNamespace

    calls = []

    def fake(x, w, v, y=None, **kw):
        calls.append((v.name, kw.get("act_out")))
        return torch.ones(x.shape[0], w.shape[0], dtype=x.dtype, device=x.device)

    monkeypatch.setattr(kernels, "qgemv", fake)
    plan = SimpleNamespace(dev=device_info(DEVICE), choose=lambda op, s: kernels.dp4a_variant(16, 4, 4, 1))
    y = torch.full((1, 40), float("nan"))
    kernels.unfused({"x": rand(1, 256, seed=1), "w": quantized(80, 256, 4, 64), "out_act": "silu"}, {"y": y}, plan)
    assert calls == [("dp4a_bn16_w4_r4_sk1", None)]
    assert torch.allclose(y, torch.full_like(y, F.silu(torch.tensor(1.0)).item()))


def test_gate_passes_the_norm_epilogue_candidates_and_rejects_one_without_the_add():
    """The norm epilogue's shape (y = rmsnorm(x W^T + r), s = x W^T + r) through the gate: its candidates
    pass; a form that norms x W^T without adding r is rejected."""
    op, dev = kernels.OP, device_info(DEVICE)
    s = kernels.QGemvShape(1, 64, 256, 4, 64, out_norm="offset")
    assert op.shape_str(s) == "1x64x256_q4g64_out_offset_add" and op.default(s, dev) is kernels.UNFUSED

    def no_add(inputs, outputs, plan):
        lin = kernels.qgemv(inputs["x"], inputs["w"], kernels.TRUSTED)
        outputs["s"].copy_(lin)
        outputs["y"].copy_(NormReference().rmsnorm(lin, inputs["out_w"], inputs["out_eps"], "offset"))

    cases = gate.trusted_cases(op, s, op.trusted(s, dev), torch.bfloat16, DEVICE,
                               torch.Generator(device=DEVICE).manual_seed(7))
    for v in op.candidates(s, dev):
        assert gate.check(op, v, cases).ok, v.name
    with extra_variant("qgemv", variant("no_add", run=no_add)) as bad:
        assert not gate.check(op, bad, cases).ok


def test_norm_epilogue_workloads_come_from_the_weights_into_the_residual_stream(monkeypatch):
    """With KILN_NORM_EPILOGUE=1 (off by default), where the dp4a forms run."""
    monkeypatch.setenv("KILN_NORM_EPILOGUE", "1")
    w_out, w_in = quantized(64, 128, 4, 64), quantized(96, 64, 4, 64)      # hidden 64: [64, 128] writes into it
    weights = {"o": w_out, "qkv": w_in}
    plain = [kernels.QGemvShape(1, 64, 128, 4, 64), kernels.QGemvShape(1, 96, 64, 4, 64)]
    got = [s for _, s in quant_cuda.quant_workloads(weights, cuda_c=True, norm_after=(64, "offset"))]
    assert got == [plain[0], kernels.QGemvShape(1, 64, 128, 4, 64, out_norm="offset"), plain[1]]
    assert [s for _, s in quant_cuda.quant_workloads(weights, cuda_c=False, norm_after=(64, "offset"))] == plain
    assert [s for _, s in quant_cuda.quant_workloads(weights, cuda_c=True)] == plain
    monkeypatch.setenv("KILN_NORM_EPILOGUE", "0")
    assert [s for _, s in quant_cuda.quant_workloads(weights, cuda_c=True, norm_after=(64, "offset"))] == plain


def test_a_projection_handed_on_is_added_and_normed_by_its_gemv_where_the_tuner_keeps_it(monkeypatch):
    """ops.linear_later at one row on a quantised weight hands on a Later (where CUDA C runs: faked
    here); add_rmsnorm, add_rmsnorm_linear_split and add_rmsnorm_gated_mlp take it as r and run the
    GEMV with the add + norm in its epilogue where a form is kept (the trusted one stands in), else
    compute the product first; every result equals the reference's on the computed product."""
    from types import SimpleNamespace

    from kiln.backends.reference import ReferenceOps
    from kiln.ops.gemm import cuda as gemm_cuda
    from kiln.ops.later import Later

    ops, ref = CudaOps(DEVICE), ReferenceOps()
    monkeypatch.setattr(gemm_cuda, "nvrtc", SimpleNamespace(kernels_run=lambda dev: True))
    monkeypatch.setenv("KILN_NORM_EPILOGUE", "0")
    assert not isinstance(ops.linear_later(rand(1, 256, seed=1), quantized(128, 256, 4, 64)), Later)     # off
    monkeypatch.setenv("KILN_NORM_EPILOGUE", "1")
    h, inner = 128, 256
    w_o, wqkv = quantized(h, inner, 4, 64, seed=2), quantized(96, h, 4, 32, seed=3)
    gate_up, down = quantized(2 * inner, h, 4, 64, seed=4), quantized(h, inner, 4, 64, seed=5)
    y, x, nw = rand(1, inner, seed=6), rand(1, h, seed=7), 1.0 + 0.1 * rand(h, seed=8)
    ran = []
    real = kernels.OP.run
    monkeypatch.setattr(kernels.OP, "run", lambda v, i, o, plan=None: ran.append(i.get("out_norm")) or real(v, i, o,
                                                                                                             plan))

    def close(a, b):
        return (a.float() - b.float()).abs().max() <= 1e-5 * b.float().abs().max()

    a = ops.linear_later(y, w_o)
    assert isinstance(a, Later) and torch.equal(ops.now(a), ops.linear(y, w_o))
    assert not isinstance(ops.linear_later(rand(2, inner, seed=9), w_o), Later)      # two rows: computed
    a0 = ref.linear(y, w_o)
    for kept in (True, False):
        form = (lambda o, x, w, r, nw, style: kernels.TRUSTED if kernels.OP.supports_norm_epilogue(
            x.reshape(1, -1), w, r.reshape(1, -1), nw, style) else None) if kept else (lambda *args: None)
        monkeypatch.setattr(quant_cuda, "norm_after_form", form)
        ran.clear()
        s, n = ops.add_rmsnorm(x, a, nw, 1e-6, "offset")
        s0, n0 = ref.add_rmsnorm(x, a0, nw, 1e-6, "offset")
        assert close(s, s0) and close(n, n0)
        s, parts = ops.add_rmsnorm_linear_split(x, a, nw, 1e-6, "offset", wqkv, [32, 64])
        s0, parts0 = ref.add_rmsnorm_linear_split(x, a0, nw, 1e-6, "offset", wqkv, [32, 64])
        assert close(s, s0) and all(close(p, q) for p, q in zip(parts, parts0))
        s, m = ops.add_rmsnorm_gated_mlp(x, a, nw, 1e-6, "offset", gate_up, down, "silu", later=True)
        s0, m0 = ref.add_rmsnorm_gated_mlp(x, a0, nw, 1e-6, "offset", gate_up, down, "silu")
        assert close(s, s0) and close(ops.now(m), m0)
        assert ran.count("offset") == (3 if kept else 0)


def test_a_model_whose_projections_are_handed_on_gives_the_same_tokens():
    """Qwen3.5's out_proj, o_proj and down through linear_later: a backend handing on every one as a Later
    (computed by the add + norm that takes it, or by `now` before the LM head) gives the tokens of one
    that computes them at once."""
    import kiln
    from kiln.backends.reference import ReferenceOps
    from kiln.ops.later import Later

    handed = []

    class Handing(ReferenceOps):
        def linear_later(self, x, w):
            handed.append(w.shape)
            return Later(x, w)

        def gated_mlp(self, x, gate_up, down, act, later=False):
            if not later:
                return super().gated_mlp(x, gate_up, down, act)
            g, u = self.linear_split(x, gate_up, [down.shape[1]] * 2)
            return self.linear_later(self.act_mul(g, u, act), down)

    llm = kiln.load("synth:tiny-qwen3.5", device="cpu", backend="reference", dtype="f32")
    want = llm.generate([5, 17, 200, 33, 91, 4], max_new_tokens=6, temperature=0).token_ids
    llm.model.ops.__class__ = Handing
    assert llm.generate([5, 17, 200, 33, 91, 4], max_new_tokens=6, temperature=0).token_ids == want
    layers = llm.model.cfg.num_hidden_layers
    assert len(handed) >= 2 * layers * 6        # each step: every layer's mixer output and MLP handed on


def test_gated_mlp_takes_the_act_epilogue_where_the_tuner_keeps_it(monkeypatch):
    """One row: where a form computing act(gate) * up as it stores is kept (here the trusted one stands
    in: no CUDA C off the GPU), gated_mlp and add_rmsnorm_gated_mlp run it on gate|up and the plain
    GEMV on down, and equal the reference composition; where it is not, the prologue path as before."""
    from kiln.backends.reference import ReferenceOps
    from kiln.ops.gemm import cuda as gemm_cuda

    ops, ref = CudaOps(DEVICE), ReferenceOps()
    k, ffn = 128, 256
    gate_up, down = quantized(2 * ffn, k, 4, 64, seed=2), quantized(k, ffn, 4, 64, seed=3)
    x, r, nw = rand(1, k, seed=4), rand(1, k, seed=5), 1.0 + 0.1 * rand(k, seed=6)
    ran = []
    real = kernels.OP.run
    monkeypatch.setattr(kernels.OP, "run", lambda v, i, o, plan=None: ran.append(
        (tuple(i["w"].shape), i.get("out_act"), i.get("act"), "norm_w" in i)) or real(v, i, o, plan))
    for kept in (True, False):
        form = (lambda o, x, w, act: kernels.TRUSTED if kernels.OP.supports_epilogue(x.reshape(1, -1), w, act)
                else None) if kept else (lambda *a: None)
        monkeypatch.setattr(quant_cuda, "gate_up_act_form", form)
        monkeypatch.setattr(gemm_cuda, "gate_up_act_form", form)
        ran.clear()
        y = ops.gated_mlp(x, gate_up, down, "silu")
        s, y2 = ops.add_rmsnorm_gated_mlp(x, r, nw, 1e-6, "llama", gate_up, down, "silu")
        s0, y0 = ref.add_rmsnorm_gated_mlp(x, r, nw, 1e-6, "llama", gate_up, down, "silu")
        assert torch.equal(s, s0) and (y2 - y0).abs().max() <= 1e-5 * y0.abs().max()
        y1 = ref.gated_mlp(x, gate_up, down, "silu")
        assert (y - y1).abs().max() <= 1e-5 * y1.abs().max()
        if kept:      # gate|up with its epilogue, then the plain down GEMV (linear: not through OP.run); the
            # add + norm in the norm's own kernel
            assert ran == [((2 * ffn, k), "silu", None, False)] * 2
        else:         # gate|up (linear), then the down GEMV reading act(g) * u; the norm in the gate|up GEMV's
            # prologue
            assert ran == [((k, ffn), None, "silu", False), ((2 * ffn, k), None, None, True),
                           ((k, ffn), None, "silu", False)]


def test_decode_gemvs_of_quantised_weights_are_not_tuned_in_bf16():
    from kiln.ops.gemm import gemm, gemm_act, norm_gemm
    from kiln.tune.tuner import Workload

    weights = {"q": quantized(64, 128, 4, 64), "gu": quantized(512, 128, 4, 64), "shared": quantized(32, 128, 4, 64),
               "dense": torch.zeros(32, 128)}
    keep = [Workload(gemm.OP, gemm.GemmShape(512, 64, 128)),           # prefill: a GEMM on the dequantised weight
            Workload(gemm.OP, gemm.GemmShape(1, 32, 128)),             # a dense weight has that shape too
            Workload(gemm.OP, gemm.GemmShape(1, 16, 128))]             # no quantised weight of that shape
    drop = [Workload(gemm.OP, gemm.GemmShape(1, 64, 128)),
            Workload(norm_gemm.OP, norm_gemm.NormGemmShape(1, 64, 128, "offset", add=True)),
            Workload(gemm_act.OP, gemm_act.GemmActShape(1, 256, 128, "silu"))]   # its weight: [2 * 256, 128]
    assert quant_cuda.dense_decode_workloads(weights, keep + drop) == keep


def test_few_row_moe_workloads_of_quantised_experts_are_not_tuned_in_bf16():
    """Up to GEMV_ROWS tokens, quantised stacks run quant_moe: the moe family's bf16 kernels never do,
    and tuning them drew the stacks whole (the 397B: 16 GiB). Prefill's chunk (dequantised whole) keeps
    its workload, and dense or mixed stacks keep every one."""
    from kiln.ops.moe import kernels as moe_kernels
    from kiln.tune.tuner import Workload

    work = [Workload(moe_kernels.OP, moe_kernels.MoeShape(m, 8, 2, 128, 64, "silu")) for m in (1, 4, 5, 512)]
    stacks = {"gu": quantize(torch.randn(8, 128, 128), 4, 64), "down": quantize(torch.randn(8, 128, 64), 4, 64),
              "conv1d": torch.zeros(96, 1, 4)}       # Qwen3.5's GDN conv weights: 3-D, dense, no expert stack
    assert quant_cuda.dense_decode_workloads(stacks, work) == work[2:]
    assert quant_cuda.dense_decode_workloads({**stacks, "dense": torch.zeros(8, 128, 64)}, work) == work
    assert quant_cuda.dense_decode_workloads({"w": quantized(64, 128, 4, 64)}, work) == work


PROLOGUES = [{"act": "silu"}, {"act": "sigmoid"}, {"style": "llama"}, {"style": "offset", "add": True},
             {"style": "plain", "add": True}]


def prologue_case(pro: dict, dtype, n: int = 37, k: int = 256, bits: int = 4, group: int = 64):
    """The op's own inputs for a prologue shape (what the tuner's gate runs), with fresh outputs."""
    s = kernels.QGemvShape(1, n, k, bits, group, **pro)
    inputs = kernels.OP.inputs(s, dtype, DEVICE, torch.Generator(device=DEVICE).manual_seed(7))
    inputs["w"] = quantized(n, k, bits, group, dtype=dtype)
    return s, inputs, kernels.OP.outputs(s, inputs)


@pytest.mark.parametrize("pro", PROLOGUES, ids=lambda p: "_".join(map(str, p.values())))
def test_prologue_forms_equal_their_composition(pro):
    """act(g) * u, rmsnorm(x) and rmsnorm(x + r) computed as the FMA form loads x: in f32 the same
    sums as the composition (act_mul or rmsnorm, then dequantise-then-linear) up to their order, s
    written; the unfused form (the prologue's own kernel, then the GEMV) the same."""
    s, inputs, _ = prologue_case(pro, torch.float32)
    want = kernels.OP.outputs(s, inputs)
    kernels.OP.run(kernels.TRUSTED, inputs, want)
    for v in [kernels.UNFUSED] + [f for f in kernels.OP.catalogue(s, device_info(DEVICE)) if f.p.get("fma")]:
        got = kernels.OP.outputs(s, inputs)
        kernels.OP.run(v, inputs, got)
        err = (got["y"] - want["y"]).abs().max().item()
        assert err <= 1e-5 * want["y"].abs().max().item(), (v.name, err)
        if pro.get("add"):
            assert torch.equal(got["s"], want["s"]), v.name


@pytest.mark.parametrize("pro", PROLOGUES[::2], ids=lambda p: "_".join(map(str, p.values())))
def test_prologue_rounds_where_the_reference_does(pro):
    """bf16: the prologue's values are the reference's bf16 values exactly (rounded in the same places),
    so the output is within a few ulps of the f32 sum over those values and the f32 weights."""
    s, inputs, out = prologue_case(pro, torch.bfloat16, n=64, k=512)
    norm = None if "norm_w" not in inputs else {"w": inputs["norm_w"], "eps": inputs["eps"], "style": inputs["style"],
                                                "r": inputs.get("r"), "s": out.get("s")}
    h = kernels.prologue_reference(inputs["x"], inputs.get("act"), norm)
    w = inputs["w"]
    exact = F.linear(h.float(), w.scales.float().repeat_interleave(64, -1) * _values(w) +
                     w.biases.float().repeat_interleave(64, -1))
    v = kernels.fma_variant(16, 64 * 4 // 32, 4, 1)
    kernels.OP.run(v, inputs, out)
    ulp = exact.abs().clamp_min(1e-2) * torch.finfo(torch.bfloat16).eps
    assert ((out["y"].float() - exact).abs() <= 2 * ulp).all()


def test_gate_passes_every_prologue_candidate_and_rejects_a_wrong_one():
    """Every candidate of an act and an add + norm shape through the gate; a form that skips the norm's
    weight (norms with 1.0: plausible when the weight pointer is lost) is rejected."""
    op, dev = kernels.OP, device_info(DEVICE)

    def no_norm_weight(inputs, outputs, plan):
        kernels.OP.launch(kernels.fma_variant(8, 8, 4, 1), {**inputs, "norm_w": torch.ones_like(inputs["norm_w"])},
                          outputs)

    for pro in ({"act": "silu"}, {"style": "llama", "add": True}):
        s = kernels.QGemvShape(1, 40, 256, 4, 64, **pro)
        cases = gate.trusted_cases(op, s, op.trusted(s, dev), torch.bfloat16, DEVICE,
                                   torch.Generator(device=DEVICE).manual_seed(5))
        for v in op.candidates(s, dev):
            assert gate.check(op, v, cases).ok, (pro, v.name)
    with extra_variant("qgemv", variant("no_norm_weight", run=no_norm_weight)) as bad:
        assert not gate.check(op, bad, cases).ok


def test_gate_passes_the_act_epilogue_candidates_and_rejects_a_swapped_gate():
    """The act epilogue's shape ([gate; up] rows, outputs act(gate) * up; ragged: 40 outputs) through the
    gate: its candidates pass; act(up) * gate (the halves swapped) is rejected."""
    op, dev = kernels.OP, device_info(DEVICE)
    s = kernels.QGemvShape(1, 80, 256, 4, 64, out_act="silu")
    assert op.shape_str(s) == "1x80x256_q4g64_out_silu" and op.default(s, dev) is kernels.UNFUSED

    def swapped(inputs, outputs, plan):
        h = kernels.qgemv(inputs["x"], inputs["w"], kernels.TRUSTED)
        g, u = h.split(40, dim=-1)
        outputs["y"].copy_(kernels.epilogue_reference(torch.cat([u, g], -1), "silu"))

    cases = gate.trusted_cases(op, s, op.trusted(s, dev), torch.bfloat16, DEVICE,
                               torch.Generator(device=DEVICE).manual_seed(6))
    assert [c.expected["y"].shape[-1] for c in cases] == [40, 40]
    for v in op.candidates(s, dev):
        assert gate.check(op, v, cases).ok, v.name
    with extra_variant("qgemv", variant("swapped", run=swapped)) as bad:
        assert not gate.check(op, bad, cases).ok


@pytest.mark.parametrize("fused", (False, True))
def test_cuda_ops_route_decode_norms_and_activations_to_the_prologue(monkeypatch, fused):
    """One row through the model-facing methods on quantised weights: the add + norm projections, the
    gated MLP with its norm, the final norm's LM head and a plain gated MLP each run prologue shapes of
    qgemv (untuned: the unfused default; or an FMA form) and equal the reference backend's composition."""
    from kiln.backends.reference import ReferenceOps

    ops, ref = CudaOps(DEVICE), ReferenceOps()
    if fused:
        default = kernels.OP.default
        monkeypatch.setattr(kernels.OP, "default", lambda s, dev: kernels.fma_variant(8, 16, 4, 1) if s.prologue
                            else default(s, dev))
    k, ffn = 128, 256
    wqkv, gate_up = quantized(96, k, 4, 32), quantized(2 * ffn, k, 8, 64, seed=2)
    down = quantized(k, ffn, 4, 64, seed=3)
    x, r, nw = rand(1, k, seed=4), rand(1, k, seed=5), 1.0 + 0.1 * rand(k, seed=6)
    seen = []
    real = kernels.OP.run
    monkeypatch.setattr(kernels.OP, "run", lambda v, i, o, plan=None: seen.append(i["w"].shape) or real(v, i, o, plan))

    def close(a, b):
        return (a - b).abs().max() <= 1e-5 * b.abs().max()

    s, parts = ops.add_rmsnorm_linear_split(x, r, nw, 1e-6, "offset", wqkv, [32, 64])
    s0, parts0 = ref.add_rmsnorm_linear_split(x, r, nw, 1e-6, "offset", wqkv, [32, 64])
    assert torch.equal(s, s0) and all(close(a, b) for a, b in zip(parts, parts0))
    s, y = ops.add_rmsnorm_gated_mlp(x, r, nw, 1e-6, "llama", gate_up, down, "silu")
    s0, y0 = ref.add_rmsnorm_gated_mlp(x, r, nw, 1e-6, "llama", gate_up, down, "silu")
    assert torch.equal(s, s0) and close(y, y0)
    assert close(ops.rmsnorm_linear(x, nw, 1e-6, "plain", wqkv), ref.rmsnorm_linear(x, nw, 1e-6, "plain", wqkv))
    assert close(ops.gated_mlp(x, gate_up, down, "silu"), ref.gated_mlp(x, gate_up, down, "silu"))
    assert seen == [wqkv.shape, gate_up.shape, down.shape, wqkv.shape, down.shape]


def test_prologue_workloads_come_from_the_models_norm_and_act_gemvs():
    from kiln.ops.gemm import gemm_act, norm_gemm
    from kiln.tune.tuner import Workload

    w4, w3 = quantized(64, 128, 4, 64), quantized(128, 256, 3, 64)
    base = [Workload(norm_gemm.OP, norm_gemm.NormGemmShape(1, 64, 128, "offset", add=True)),
            Workload(norm_gemm.OP, norm_gemm.NormGemmShape(512, 64, 128, "offset")),          # prefill: not a GEMV
            Workload(gemm_act.ACT_OP, gemm_act.ActGemmShape(1, 128, 256, "silu")),            # 3-bit: no FMA form
            Workload(gemm_act.ACT_OP, gemm_act.ActGemmShape(1, 64, 128, "gelu_pytorch_tanh")),  # a torch activation
            Workload(gemm_act.ACT_OP, gemm_act.ActGemmShape(1, 64, 128, "silu"))]
    got = [s for _, s in quant_cuda.quant_workloads({"a": w4, "b": w3}, base)]
    assert got == [kernels.QGemvShape(1, 64, 128, 4, 64), kernels.QGemvShape(1, 64, 128, 4, 64, act="silu"),
                   kernels.QGemvShape(1, 64, 128, 4, 64, style="offset", add=True),
                   kernels.QGemvShape(1, 128, 256, 3, 64)]


def test_gpu_catalogue_splits_k_into_whole_steps_and_keeps_only_fma_where_it_fits():
    from types import SimpleNamespace

    h200 = SimpleNamespace(capability=(9, 0), sms=132)
    down = kernels.QGemvShape(1, 1024, 3584, 4, 64)           # 448 words: 7 steps of 64, 3.5 of 128
    assert kernels.split_for(down, 64) == 7 and kernels.split_for(down, 128) == 0
    assert kernels.split_for(kernels.QGemvShape(1, 64, 12288, 4, 64), 128) == 4
    names = [v.name for v in kernels.OP.catalogue(down, h200)]
    assert "fma_bn16_bw64_w4_sk7" in names and not any(n.startswith(("acc", "gather")) for n in names)
    for v in kernels.OP.catalogue(down, h200)[1:]:
        assert kernels.fits(down, v.p), v.name
    three = [v.name for v in kernels.OP.catalogue(kernels.QGemvShape(1, 64, 512, 3, 64), h200)]
    assert three[0] == "dequant_linear" and three[1:] and all(n.startswith("gather") for n in three[1:])


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



@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", (torch.bfloat16, torch.float16))
def test_every_tensor_core_candidate_passes_the_gate(dtype):
    """The PTX unpacking (the interpreter runs Triton's integer ops instead) on real shapes: 2 and 4
    bits (8 in f16), split and whole, a ragged last block of rows, K of 56 groups (3.5 chunks)."""
    op, dev = kernels.OP, device_info(DEVICE)
    for n, k, bits in ((4096, 12288, 4), (1000, 4096, 4), (24576, 4096, 2), (1024, 3584, 4), (512, 1024, 8)):
        s = kernels.QGemvShape(1, n, k, bits, 64)
        forms = kernels.mma_forms(s, kernels.GPU_MMA) if bits != 8 else [kernels.mma_variant(64, 4, 4, 1, 2)]
        if bits in kernels.MMA_BITS[dtype]:
            assert forms, s
        else:
            continue
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        cases = gate.trusted_cases(op, s, op.trusted(s, dev), dtype, DEVICE, gen)
        for v in forms:
            assert gate.check(op, v, cases).ok, (s, v.name)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_launch_finds_the_kernel_the_tuner_compiled():
    """A launch whose arguments specialise apart from the compile's (a pointer of another dtype, an
    integer equal to 1) compiles again, serially, in the tuning process: 150 s of a 0.8b tune once."""
    knobs = pytest.importorskip("triton.knobs")
    if not hasattr(knobs.runtime, "jit_cache_hook"):
        pytest.skip("this Triton has no jit_cache_hook")
    op, dev = kernels.OP, device_info(DEVICE)
    plain = kernels.QGemvShape(1, 256, 1024, 4, 64)
    shapes = [plain, kernels.QGemvShape(1, 256, 1024, 4, 64, act="silu"),
              kernels.QGemvShape(1, 256, 1024, 4, 64, style="offset", add=True)]
    misses = []
    for s in shapes:
        gen = torch.Generator(device=DEVICE).manual_seed(0)
        inputs = op.inputs(s, torch.bfloat16, DEVICE, gen)
        forms = [v for v in op.candidates(s, dev) if v.run is None and not v.p.get("trusted")]
        forms = [v for v in forms if v.p.get("fma") and v.p["bn"] == 16] + [v for v in forms if not v.p.get("fma")][:2]
        for v in forms:
            op.compile(v, s, torch.bfloat16, DEVICE)
            knobs.runtime.jit_cache_hook = lambda *a, v=v, s=s, **k: misses.append((op.shape_str(s), v.name))
            try:
                op.run(v, inputs, op.outputs(s, inputs), None)
                torch.cuda.synchronize()
            finally:
                knobs.runtime.jit_cache_hook = None
    assert not misses, misses
# -- the embedding lookup ---------------------------------------------------------------------------

@pytest.mark.parametrize("bits", BITS)
@pytest.mark.parametrize("group", (32, 128))
def test_quantised_embedding_equals_the_reference_bit_for_bit(bits, group):
    """Rows gathered and dequantised in one launch equal dequantize(table.rows(ids)) exactly: bf16 scales
    (mlx-community), f32 scales with a bf16 weight (GGUF kept quantised), repeated and ragged ids; the
    whole table (50 rows: a ragged last tile) equals dequantize(table); CudaOps.embed (with Gemma's
    scale) equals the reference backend's."""
    from kiln.backends.reference import ReferenceOps
    from kiln.ops.quant import embed

    k = 384                                     # one block of 512: its tail masked
    bf = quantized(50, k, bits, group, dtype=torch.bfloat16)
    wide = type(bf)(bf.packed, bf.scales.float() * 1.001, bf.biases.float(), bits, group, out_dtype=torch.bfloat16)
    ids = torch.tensor([[3, 49, 0], [3, 7, 21]], device=DEVICE)
    for table in (bf, wide):
        want = dequantize(table.rows(ids))
        got = embed.qembed(ids, table)
        assert got.dtype == want.dtype and torch.equal(got, want), table.scales.dtype
        assert torch.equal(embed.qembed(None, table), dequantize(table))      # the whole table (prefill's GEMM)
    ops = CudaOps(DEVICE)
    assert torch.equal(ops.embed(ids, bf, scale=30.0), ReferenceOps().embed(ids, bf, scale=30.0))


# -- routed experts ---------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,act", ((torch.float32, "silu"), (torch.bfloat16, "silu"),
                                       (torch.bfloat16, "gelu_pytorch_tanh")))
@pytest.mark.parametrize("tokens", (1, 3))
def test_quantised_moe_equals_the_reference(dtype, act, tokens):
    """Every (token, slot) pair's gate|up GEMV on its expert's packed stack, the down GEMV with act(g) * u
    in its prologue and the routing weight in its epilogue, then the combine (with and without Qwen's
    gated shared expert): MoeReference on the dequantised experts, the same roundings, so f32 agrees to
    its summation order and bf16 to an ulp or two where a rounding lands the other way. Gemma 4's GELU
    (tanh form) too: the kernel's g sigmoid(2u) against torch's tanh, equal after bf16 rounding."""
    check_quant_moe(4, 2, 128, 64, tokens, dtype, down_bits=8, down_group=32, act=act)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("tokens", (1, 4))
def test_quantised_moe_on_qwen35_35b_shapes(tokens):
    check_quant_moe(256, 8, 2048, 512, tokens, torch.bfloat16)


@pytest.mark.parametrize("quantised_gate", (False, True))
def test_a_prefill_chunks_quantised_experts_run_the_grouped_kernel_on_dequantised_stacks(quantised_gate):
    """Past the routed GEMVs' few rows, both stacks are dequantised whole (one launch each, bit-exact)
    and the MoE family's grouped kernel runs: the reference's result on the dequantised experts."""
    from kiln.backends.reference import ReferenceOps
    from kiln.ops.moe import kernels as moe_kernels

    e, k, h, i, tokens, dtype = 4, 2, 128, 64, 9, torch.bfloat16
    gate_up = quantize(rand(e, 2 * i, h, dtype=dtype, seed=1, scale=h ** -0.5), 4, 64)
    down = quantize(rand(e, h, i, dtype=dtype, seed=2, scale=i ** -0.5), 3, 32)
    x = rand(tokens, h, dtype=dtype, seed=3)
    idx = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(t))[:k]
                       for t in range(tokens)]).to(DEVICE)
    weights = torch.rand(tokens, k, generator=torch.Generator().manual_seed(9)).to(dtype).to(DEVICE)
    gate_w, shared = rand(1, h, dtype=dtype, seed=4), rand(tokens, h, dtype=dtype, seed=5)
    if quantised_gate:
        gate_w = quantize(gate_w, 8, 64)
    calls = []
    real = moe_kernels.moe_experts
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(moe_kernels, "moe_experts", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        got = CudaOps(DEVICE).moe_experts_gated(x, idx, weights, gate_up, down, "silu", gate_w, shared)
    assert len(calls) == 1
    want = ReferenceOps().moe_experts_gated(x, idx, weights, gate_up, down, "silu", gate_w, shared)
    assert (got.float() - want.float()).abs().max() <= 4 * torch.finfo(dtype).eps * want.float().abs().max()


def check_quant_moe(e, k, h, i, tokens, dtype, down_bits=4, down_group=64, act="silu"):
    from kiln.backends.reference import ReferenceOps

    gate_up = quantize(rand(e, 2 * i, h, dtype=dtype, seed=1, scale=h ** -0.5), 4, 64)
    down = quantize(rand(e, h, i, dtype=dtype, seed=2, scale=i ** -0.5), down_bits, down_group)
    x = rand(tokens, h, dtype=dtype, seed=3)
    idx = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(t))[:k] for t in range(tokens)])
    weights = torch.rand(tokens, k, generator=torch.Generator().manual_seed(9)).to(dtype).to(DEVICE)
    gate_w, shared = rand(1, h, dtype=dtype, seed=4), rand(tokens, h, dtype=dtype, seed=5)
    ops, ref = CudaOps(DEVICE), ReferenceOps()
    tol = 1e-5 if dtype == torch.float32 else 4 * torch.finfo(dtype).eps
    calls = []
    real = kernels.qgemv_pairs
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kernels, "qgemv_pairs", lambda *a, **kw: calls.append(1) or real(*a, **kw))
        got = ops.moe_experts(x, idx.to(DEVICE), weights, gate_up, down, act)
        gated = ops.moe_experts_gated(x, idx.to(DEVICE), weights, gate_up, down, act, gate_w, shared)
    assert len(calls) == 4          # two launches a call: the kernels ran, not the reference
    want = ref.moe_experts(x, idx.to(DEVICE), weights, gate_up, down, act)
    want_gated = ref.moe_experts_gated(x, idx.to(DEVICE), weights, gate_up, down, act, gate_w, shared)
    for a, b in ((got, want), (gated, want_gated)):
        assert a.dtype == b.dtype and (a.float() - b.float()).abs().max() <= tol * b.float().abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_quantised_moe_reads_the_routers_ids_in_a_cuda_graph():
    """The experts' GEMV starts early under programmatic dependent launch: it must read the expert ids
    only after the router kernel that writes them has finished (read before, a replay took stale or
    garbage ids: the 35B's decode graph faulted)."""
    e, k, h, i = 256, 8, 2048, 512
    gate_up = quantize(rand(e, 2 * i, h, dtype=torch.bfloat16, seed=1, scale=h ** -0.5), 4, 64)
    down = quantize(rand(e, h, i, dtype=torch.bfloat16, seed=2, scale=i ** -0.5), 4, 64)
    x, logits = rand(1, h, dtype=torch.bfloat16, seed=3), rand(1, e, dtype=torch.bfloat16, seed=4)
    ops = CudaOps(DEVICE)

    def step():
        weights, idx = ops.router_topk(logits, k, True)
        return ops.moe_experts(x, idx, weights, gate_up, down, "silu")

    graph, out = captured(step)
    for seed in range(8):
        logits.copy_(rand(1, e, dtype=torch.bfloat16, seed=10 + seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step()), seed
