"""Gated DeltaNet (kiln.ops.gdn). The reference ops: the recurrent step and the chunked (WY/UT) form
agree with each other and with the textbook recurrence, on ragged lengths and a non-zero starting
state. The kernels against the reference mixer (ReferenceOps.gated_deltanet on a GDNState): output y
and the in-place conv / ssm state, on ragged lengths, from a non-zero and from a zero state; decode
steps after a prefill equal one long prefill. Under Triton's interpreter on CPU (small shapes); the
`gpu` tests run the real Qwen3.5 shapes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.backends.reference import ReferenceOps  # noqa: E402
from kiln.cache import GDNState  # noqa: E402
from kiln.ops.gdn import kernels as gdn_kernels  # noqa: E402
from kiln.tune import gate  # noqa: E402
from kiln.tune.device import device_info  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REF = ReferenceOps(DEVICE)
SMALL = dict(hk=2, hv=4, dk=16, dv=32, k=4)


def case(t: int, dtype, zero: bool = False, seed: int = 0, hk=2, hv=4, dk=16, dv=32, k=4):
    """Random inputs and a reference state holding the same prior conv window and ssm (or zeros)."""
    s = gdn_kernels.GdnShape(t, hk, hv, dk, dv, k)
    inp = gdn_kernels.gdn_inputs(s, dtype, DEVICE, torch.Generator(device=DEVICE).manual_seed(seed))
    st = GDNState(s.conv_dim, k, hv, dk, dv, dtype, DEVICE)
    if not zero:
        st.conv, st.ssm, st.length = inp["conv_state"].clone(), inp["ssm"].clone(), 3
    return inp, st


def reference(inp, st, lo=0, hi=None):
    """The reference mixer on tokens [lo, hi); updates st."""
    p = {"conv1d.weight": inp["conv_w"], "A_log": inp["A_log"], "dt_bias": inp["dt_bias"], "norm.weight": inp["norm_w"]}
    part = [inp[n][lo:hi] for n in ("qkv", "z", "b", "a")]
    return REF.gated_deltanet(*part, p, st, inp["dims"])


def kiln(fn, inp, conv, ssm, v, lo=0, hi=None):
    args = [inp[n][lo:hi] for n in ("qkv", "z", "b", "a")] + [inp[n] for n in gdn_kernels.ARGS[4:]]
    return fn(*args, conv, ssm, inp["dims"], v)


def assert_close(got, want, what: str):
    """f32: the same math in another order, within 1e-4 of the largest value. bf16 (y, conv): the
    kernels round where the reference rounds; f32 sums in another order may flip a rounding, so at
    most 2 bf16 ulps of the largest value (1/128 of it) and mostly bit-equal. ssm stays f32 always."""
    assert got.dtype == want.dtype and got.shape == want.shape, what
    assert not torch.isnan(got).any(), what
    err = (got.float() - want.float()).abs().max().item()
    scale = want.float().abs().max().item()
    if want.dtype == torch.float32:
        assert err <= 1e-4 * scale + 1e-6, f"{what}: {err:.2e} of {scale:.2e}"
    else:
        assert err <= scale / 128, f"{what}: {err:.2e} of {scale:.2e}"
        assert (got == want).float().mean().item() >= 0.95, what


def check(fn, v, t, dtype, zero=False, seed=0, **dims):
    inp, st = case(t, dtype, zero, seed, **dims)
    conv, ssm = st.conv.clone(), st.ssm.clone()
    y = kiln(fn, inp, conv, ssm, v)
    want = reference(inp, st)
    assert_close(y, want, f"{v.name} y")
    assert_close(ssm, st.ssm, f"{v.name} ssm")
    assert torch.equal(conv, st.conv), f"{v.name} conv"


CHUNK_FORMS = [gdn_kernels.chunk_variant(32, 4, "ieee"),    # norm fused
               gdn_kernels.chunk_variant(16, 4, "ieee")]    # norm in a second pass


@pytest.mark.parametrize("t", [1, 7, 64, 70, 130])
def test_chunked_prefill_equals_reference(t):
    check(gdn_kernels.gdn_prefill, CHUNK_FORMS[0], t, torch.float32, seed=t)


@pytest.mark.parametrize("v", CHUNK_FORMS[1:] + [gdn_kernels.RECURRENT, gdn_kernels.TORCH], ids=lambda v: v.name)
def test_other_prefill_forms_equal_reference(v):
    t = 70 if v.p["form"] != "recurrent" else 24       # the interpreter's cost is per token here
    check(gdn_kernels.gdn_prefill, v, t, torch.float32, seed=1)
    check(gdn_kernels.gdn_prefill, v, 9, torch.float32, zero=True, seed=2)


BF16_DOTS = gdn_kernels.chunk_variant(32, 4, "bf16")


def test_bf16_dot_form_is_ieee_with_f32_activations():
    """Precision "bf16" rounds dot operands only to a 16-bit activation dtype: in f32 it is exact."""
    check(gdn_kernels.gdn_prefill, BF16_DOTS, 70, torch.float32, seed=1)
    check(gdn_kernels.gdn_prefill, gdn_kernels.chunk_variant(16, 4, "bf16"), 9, torch.float32, zero=True, seed=2)


@pytest.mark.parametrize("zero", [False, True], ids=["state", "zero"])
def test_bf16_dot_form_within_the_gate(zero):
    """bf16 activations: every dot operand (the state's copy included) is rounded to bf16 (2^-9
    relative each) and accumulated in f32, so each dot carries ~2^-8 of its operands' scale and the
    state carries that error from chunk to chunk; the reference rounds nowhere there. Bound: the
    tuner's gate, max|reference| / 64, for y and the f32 state (measured ~1/144 and ~1/240 here). The
    conv state is exact, and the state must differ from the ieee form's (the 16-bit path ran)."""
    inp, st = case(130, torch.bfloat16, zero, seed=12)
    conv, ssm = st.conv.clone(), st.ssm.clone()
    y = kiln(gdn_kernels.gdn_prefill, inp, conv, ssm, BF16_DOTS)
    ieee_ssm = st.ssm.clone()
    kiln(gdn_kernels.gdn_prefill, inp, st.conv.clone(), ieee_ssm, gdn_kernels.chunk_variant(32, 4, "ieee"))
    want = reference(inp, st)
    for got, ref, what in ((y, want, "y"), (ssm, st.ssm, "ssm")):
        assert got.dtype == ref.dtype and not torch.isnan(got).any(), what
        err, scale = (got.float() - ref.float()).abs().max().item(), ref.float().abs().max().item()
        assert err <= scale * gate.TOLERANCE, f"{what}: {err:.2e} of {scale:.2e}"
    assert torch.equal(conv, st.conv)
    assert not torch.equal(ssm, ieee_ssm)


SPLIT_FORMS = [gdn_kernels.split_variant(32, 4, 32, 4, "ieee"),     # norm fused
               gdn_kernels.split_variant(16, 4, 16, 4, "ieee"),     # norm in a pass of its own
               gdn_kernels.split_variant(32, 4, 32, 4, "ieee", solve="dots"),
               gdn_kernels.split_variant(16, 4, 32, 4, "ieee", prep2=True),
               gdn_kernels.split_variant(16, 4, 16, 4, "tf32x3", prep2=True)]


@pytest.mark.parametrize("t", [1, 70, 130])
@pytest.mark.parametrize("v", SPLIT_FORMS, ids=lambda v: v.name)
def test_split_prefill_equals_reference(v, t):
    check(gdn_kernels.gdn_prefill, v, t, torch.float32, seed=t)


def fixed_order_sums(monkeypatch) -> list:
    """Under the interpreter, every tl.dot and tl.sum summed in one fixed order: term by term, k = 0,
    1, ..., one f32 product and one f32 add at a time (numpy's elementwise ops: each result rounded,
    nothing fused), whatever the tile's shape. (The interpreter's own tl.dot is the CPU's BLAS, whose
    order depends on the shapes and on the CPU; its tl.sum, numpy's pairwise sum.) tl.cumsum is
    numpy's, already term by term. Returns the count of dots run."""
    import numpy as np
    from triton.runtime import interpreter as interp

    dots, ref_sum = [0], interp.ReduceOps.sum

    def create_dot(self, a, b, d, input_precision, max_num_imprecise_acc):
        assert a.data.dtype == b.data.dtype == d.data.dtype == np.float32, (a.data.dtype, b.data.dtype)
        acc = d.data
        for k in range(a.data.shape[-1]):
            acc = acc + a.data[..., :, k:k + 1] * b.data[..., k:k + 1, :]
        dots[0] += 1
        return interp.TensorHandle(acc, d.dtype.scalar)

    def reduce_sum(self, input):
        x = input.handle.data
        if x.dtype != np.float32:
            return ref_sum(self, input)
        terms = x.reshape(-1) if self.axis is None else np.moveaxis(x, self.axis, 0)
        acc = terms[0]
        for t in terms[1:]:
            acc = acc + t
        if self.keep_dims:
            acc = np.expand_dims(acc, tuple(range(x.ndim)) if self.axis is None else self.axis)
        return self.to_tensor(acc, input.dtype)

    monkeypatch.setattr(interp.InterpreterBuilder, "create_dot", create_dot)
    monkeypatch.setattr(interp.ReduceOps, "sum", reduce_sum)
    return dots


@pytest.mark.parametrize("prec,dtype", [("ieee", torch.float32), ("bf16", torch.bfloat16)])
def test_split_form_is_the_scan_forms_arithmetic(prec, dtype, monkeypatch):
    """The split form stores what the scan keeps in registers (16-bit only what feeds nothing but a
    dot, which the dot would round to anyway): it is the scan's arithmetic, the same roundings of the
    same operations, and so the scan's numbers bit for bit once every sum is taken in the same order.
    The interpreter's tl.dot is the CPU's BLAS, whose order depends on the tile's shape and on the CPU
    (the scan's 16-wide dv blocks and the output kernel's 32-wide ones: y an ulp apart on OpenBLAS's
    Haswell kernels), so here every dot and sum runs in one fixed order (fixed_order_sums). A step
    the split form rounds or computes otherwise, even q's decay applied after its dot, shows."""
    if DEVICE.type != "cpu":
        pytest.skip("the order of every sum is fixed here in Triton's interpreter")
    dots = fixed_order_sums(monkeypatch)
    inp, st = case(150, dtype, seed=21)
    want_c, want_s = st.conv.clone(), st.ssm.clone()
    want = kiln(gdn_kernels.gdn_prefill, inp, want_c, want_s, gdn_kernels.chunk_variant(16, 4, prec))
    for v in (gdn_kernels.split_variant(16, 4, 32, 4, prec), gdn_kernels.split_variant(16, 4, 32, 4, prec, prep2=True)):
        got_c, got_s = st.conv.clone(), st.ssm.clone()
        got = kiln(gdn_kernels.gdn_prefill, inp, got_c, got_s, v)
        assert torch.equal(got, want) and torch.equal(got_s, want_s) and torch.equal(got_c, want_c), v.name
    assert dots[0] > 0                          # the fixed order was the one in force


def test_prefill_from_zero_state_and_bf16():
    check(gdn_kernels.gdn_prefill, CHUNK_FORMS[0], 130, torch.float32, zero=True, seed=3)
    check(gdn_kernels.gdn_prefill, CHUNK_FORMS[0], 130, torch.bfloat16, seed=4)
    check(gdn_kernels.gdn_prefill, gdn_kernels.RECURRENT, 20, torch.bfloat16, seed=5)


def test_prefill_group_of_one_key_head_per_value_head():
    check(gdn_kernels.gdn_prefill, gdn_kernels.chunk_variant(16, 4, "ieee"), 66, torch.float32, seed=6,
          hk=4, hv=4, dk=32, dv=16)


DECODE_FORMS = [gdn_kernels.UNFUSED, gdn_kernels.fused_variant(32, 4), gdn_kernels.fused_variant(16, 4),
                gdn_kernels.fused_variant(16, 4, last=True)]


@pytest.mark.parametrize("v", DECODE_FORMS, ids=lambda v: v.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_decode_equals_reference(v, dtype):
    check(gdn_kernels.gdn_decode, v, 1, dtype, seed=7)
    check(gdn_kernels.gdn_decode, v, 1, dtype, zero=True, seed=8)


def test_decode_one_reader_per_key_head():
    """Hv == Hk and BV == dv: no arrival counter (each program alone reads its q/k channels)."""
    check(gdn_kernels.gdn_decode, gdn_kernels.fused_variant(16, 4), 1, torch.float32, seed=9, hk=4, hv=4, dk=16, dv=16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_prefill_then_decode_steps_equal_one_long_prefill(dtype):
    """Prefill 70 tokens, then 5 fused decode steps (the state carried in place) == 75 at once."""
    inp, st = case(75, dtype, seed=10)
    conv, ssm = st.conv.clone(), st.ssm.clone()
    parts = [kiln(gdn_kernels.gdn_prefill, inp, conv, ssm, CHUNK_FORMS[0], 0, 70)]
    # steps alternate the separate norm pass and the last-arrival norm (its counters reset each step)
    parts += [kiln(gdn_kernels.gdn_decode, inp, conv, ssm, gdn_kernels.fused_variant(16, 4, last=i % 2 == 1), i, i + 1)
              for i in range(70, 75)]
    whole_conv, whole_ssm = st.conv.clone(), st.ssm.clone()
    whole = kiln(gdn_kernels.gdn_prefill, inp, whole_conv, whole_ssm, CHUNK_FORMS[0])
    assert_close(torch.cat(parts), whole, "y")
    assert_close(ssm, whole_ssm, "ssm")
    assert torch.equal(conv, whole_conv)
    assert_close(torch.cat(parts), reference(inp, st), "y vs reference")


def test_decode_op_gate_passes_every_candidate_and_keeps_inputs():
    """The registry op: outputs are y and copies of the state; the gate accepts every candidate; the
    inputs' state is untouched, so every variant sees the same."""
    op, dev = gdn_kernels.DECODE, device_info(DEVICE)
    s = gdn_kernels.GdnShape(1, **SMALL)
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    cases = gate.trusted_cases(op, s, op.trusted(s, dev), torch.float32, DEVICE, gen)
    before = cases[0].inputs["ssm"].clone()
    for v in op.candidates(s, dev):
        verdict = gate.check(op, v, cases)
        assert verdict.ok, (v.name, verdict)
    assert torch.equal(cases[0].inputs["ssm"], before)
    assert not torch.equal(cases[0].expected["ssm"], before)


# -- on the GPU: the real Qwen3.5 shapes ----------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
REAL = {"qwen3.5-0.8b": dict(hk=16, hv=16, dk=128, dv=128, k=4), "qwen3.5-9b": dict(hk=16, hv=32, dk=128, dv=128, k=4)}


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("model", list(REAL))
@pytest.mark.parametrize("t", [512, 1000])
def test_gpu_prefill_variants_equal_reference(model, t):
    dims = REAL[model]
    s = gdn_kernels.GdnShape(t, **dims)
    forms = gdn_kernels.PREFILL.candidates(s, device_info(DEVICE))
    for v in forms:
        if v.p.get("prec") != "bf16":
            check(gdn_kernels.gdn_prefill, v, t, torch.bfloat16, seed=t, **dims)
            continue
        # 16-bit dot operands: within the tuner's gate (see test_bf16_dot_form_within_the_gate)
        inp, st = case(t, torch.bfloat16, seed=t, **dims)
        conv, ssm = st.conv.clone(), st.ssm.clone()
        y = kiln(gdn_kernels.gdn_prefill, inp, conv, ssm, v)
        want = reference(inp, st)
        for got, ref, what in ((y, want, "y"), (ssm, st.ssm, "ssm")):
            err, scale = (got.float() - ref.float()).abs().max().item(), ref.float().abs().max().item()
            assert not torch.isnan(got).any() and err <= scale * gate.TOLERANCE, \
                f"{v.name} {what}: {err:.2e} of {scale:.2e}"
        assert torch.equal(conv, st.conv), v.name


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("model", list(REAL))
def test_gpu_decode_variants_equal_reference(model):
    dims = REAL[model]
    for v in gdn_kernels.DECODE.catalogue(gdn_kernels.GdnShape(1, **dims), device_info(DEVICE)):
        check(gdn_kernels.gdn_decode, v, 1, torch.bfloat16, seed=1, **dims)
        check(gdn_kernels.gdn_decode, v, 1, torch.bfloat16, zero=True, seed=2, **dims)


@pytest.mark.gpu
@gpu
def test_gpu_decode_step_captures_in_a_cuda_graph():
    dims = REAL["qwen3.5-9b"]
    inp, st = case(1, torch.bfloat16, seed=3, **dims)
    conv, ssm = st.conv.clone(), st.ssm.clone()
    v = gdn_kernels.DECODE.default(gdn_kernels.GdnShape(1, **dims), device_info(DEVICE))
    kiln(gdn_kernels.gdn_decode, inp, conv.clone(), ssm.clone(), v)          # compile, counters allocated
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = kiln(gdn_kernels.gdn_decode, inp, conv, ssm, v)
    graph.replay()
    torch.cuda.synchronize()
    assert_close(y, reference(inp, st), "y")
    assert_close(ssm, st.ssm, "ssm")
    assert torch.equal(conv, st.conv)


def test_decode_with_a_conv_kernel_other_than_4_runs_unfused():
    """The fused decode holds the conv state as three rows; another kernel size takes the unfused form."""
    s, dev = gdn_kernels.GdnShape(1, 2, 2, 16, 16, 3), device_info("cpu")
    assert gdn_kernels.DECODE.candidates(s, dev) == [gdn_kernels.UNFUSED]
    assert gdn_kernels.DECODE.default(s, dev) == gdn_kernels.UNFUSED
    check(gdn_kernels.gdn_decode, gdn_kernels.DECODE.default(s, dev), 1, torch.float32, seed=11,
          hk=2, hv=2, dk=16, dv=16, k=3)


def test_prefill_with_a_conv_kernel_other_than_4_keeps_its_forms():
    """Only the fused decode needs a conv kernel of 4: the prefill forms are the same for any size."""
    dev = device_info("cpu")
    three, four = gdn_kernels.GdnShape(70, 2, 4, 16, 32, 3), gdn_kernels.GdnShape(70, 2, 4, 16, 32, 4)
    assert gdn_kernels.PREFILL.candidates(three, dev) == gdn_kernels.PREFILL.candidates(four, dev)
    assert gdn_kernels.UNFUSED not in gdn_kernels.PREFILL.candidates(three, dev)
    check(gdn_kernels.gdn_prefill, gdn_kernels.PREFILL.default(three, dev), 9, torch.float32, seed=12, k=3)


# -- the reference ops: the recurrent and chunked rules against the textbook recurrence ---------------

OPS = ReferenceOps("cpu")


def _inputs(t, hk=2, hv=6, dk=16, dv=24, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (r(t, hk, dk), r(t, hk, dk), r(t, hv, dv), -torch.rand(t, hv, generator=g) * 2,
            torch.rand(t, hv, generator=g))


def _state(hv=6, dk=16, dv=24, seed=1):
    s = GDNState(8, 4, hv, dk, dv, torch.float32, "cpu")
    s.ssm = torch.randn(hv, dk, dv, generator=torch.Generator().manual_seed(seed)) * 0.1
    return s


def _textbook(q, k, v, g, beta, s0):
    """S_t = exp(g) S_{t-1} + k beta (v - exp(g) S_{t-1}^T k)^T ; o_t = S_t^T q / sqrt(dk), l2-normalised q, k."""
    rep = v.shape[1] // q.shape[1]
    q, k = (torch.nn.functional.normalize(x.repeat_interleave(rep, 1).double(), dim=-1, eps=0) for x in (q, k))
    s, out = s0.double().clone(), []
    for t in range(q.shape[0]):
        s = s * g[t].double().exp()[:, None, None]
        pred = torch.einsum("hkv,hk->hv", s, k[t])
        s = s + torch.einsum("hk,hv->hkv", k[t], (v[t].double() - pred) * beta[t].double()[:, None])
        out.append(torch.einsum("hkv,hk->hv", s, q[t]) / q.shape[-1] ** 0.5)
    return torch.stack(out), s


@pytest.mark.parametrize("t", [1, 5, 63, 64, 65, 130])
def test_chunked_and_recurrent_match_the_textbook_rule(t):
    q, k, v, g, beta = _inputs(t, seed=t)
    want, want_s = _textbook(q, k, v, g, beta, _state().ssm)
    for rule in (OPS.gdn_recurrent, OPS.gdn_chunked):
        st = _state()
        got = rule(q, k, v, g, beta, st)
        assert torch.allclose(got.double(), want, atol=1e-4, rtol=1e-4), rule.__name__
        assert torch.allclose(st.ssm.double(), want_s, atol=1e-4, rtol=1e-4), rule.__name__


def test_chunked_prefill_then_steps_equals_one_pass():
    q, k, v, g, beta = _inputs(100, seed=7)
    whole = _state()
    ref = OPS.gdn_chunked(q, k, v, g, beta, whole)
    parts, st = [], _state()
    parts.append(OPS.gdn_chunked(q[:70], k[:70], v[:70], g[:70], beta[:70], st))
    for i in range(70, 100):
        parts.append(OPS.gdn_recurrent(q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], st))
    assert torch.allclose(torch.cat(parts), ref, atol=1e-5, rtol=1e-4)
    assert torch.allclose(st.ssm, whole.ssm, atol=1e-5, rtol=1e-4)


def test_conv_state_carries_across_calls():
    torch.manual_seed(0)
    x, w = torch.randn(11, 8), torch.randn(8, 1, 4)
    whole = OPS.causal_conv1d(x, w, _state())
    st = _state()
    split = torch.cat([OPS.causal_conv1d(x[:6], w, st)] + [OPS.causal_conv1d(x[i:i + 1], w, st) for i in range(6, 11)])
    assert torch.allclose(whole, split, atol=1e-6)
    # against the definition: y_t = silu(sum_j w[c, j] * x[t - 3 + j, c]) with zeros before the start
    padded = torch.cat([torch.zeros(3, 8), x])
    direct = torch.stack([(padded[t:t + 4].T * w[:, 0]).sum(-1) for t in range(11)])
    assert torch.allclose(whole, torch.nn.functional.silu(direct), atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("t,widths", [(1, (8, 4, 2, 2)), (17, (40, 24, 4, 4)), (5, (1100, 16, 8, 8))])
def test_unpack_equals_the_copies_it_replaces(t, widths, dtype):
    """The packed projection's four column views copied out in one launch: each part contiguous and
    equal to its view (bit-equal: copies), with and without the padded rows' b and a; anything but
    such views (separate tensors, a column slice of a wider buffer) is left to torch."""
    from kiln.ops.gdn.unpack import unpack, unpack_reference

    whole = torch.randn(t, sum(widths), device=DEVICE).to(dtype)
    parts = torch.split(whole, list(widths), dim=1)
    for n in (None, torch.tensor([max(t - 2, 0)], device=DEVICE)):
        got, want = unpack(*parts, n, -1.0e4), unpack_reference(*parts, n, -1.0e4)
        for g, w in zip(got, want):
            assert g.is_contiguous() and g.dtype == dtype and torch.equal(g, w)
    assert unpack(*(torch.randn(t, w, device=DEVICE).to(dtype) for w in widths)) is None
    wider = torch.randn(t, sum(widths) + 3, device=DEVICE).to(dtype)
    assert unpack(*torch.split(wider, list(widths) + [3], dim=1)[:4]) is None


@pytest.mark.parametrize("n,t,form,packed", [(1, 16, 0, False), (2, 16, 1, False), (21, 32, 0, False),
                                             (64, 80, 1, False), (70, 80, 0, False), (21, 32, 1, True)])
def test_padded_prefill_leaves_the_state_of_the_prompt_alone(n, t, form, packed):
    """A prefill of t rows of which only the first n are the prompt (GDNState.valid = n, as a
    prefill graph's bucket runs it) gives the prompt's rows, conv window and recurrent state of a
    prefill of the n rows alone: the spare rows' gates make them leave the state as it was, and the
    conv window is re-taken from the prompt's last rows (n < K - 1 reaches into the prior window).
    Ragged n, both chunk forms, spare rows of random (finite) inputs."""
    from kiln.backends.cuda import CudaOps

    ops = CudaOps(DEVICE)
    ops.choose = lambda op, shape: CHUNK_FORMS[form]
    inp, st = case(t, torch.float32, seed=n)
    p = {"conv1d.weight": inp["conv_w"], "A_log": inp["A_log"], "dt_bias": inp["dt_bias"], "norm.weight": inp["norm_w"]}
    rows = [inp[k] for k in ("qkv", "z", "b", "a")]
    if packed:      # column views of one buffer, as the model's packed projection gives (one unpack launch)
        rows = list(torch.split(torch.cat(rows, dim=1), [r.shape[1] for r in rows], dim=1))
    alone = GDNState(inp["qkv"].shape[1], 4, 4, 16, 32, torch.float32, DEVICE)
    alone.conv, alone.ssm, alone.length = st.conv.clone(), st.ssm.clone(), 3
    want = ops.gated_deltanet(*(r[:n] for r in rows), p, alone, inp["dims"])
    padded = GDNState(inp["qkv"].shape[1], 4, 4, 16, 32, torch.float32, DEVICE)
    padded.conv, padded.ssm, padded.length = st.conv.clone(), st.ssm.clone(), 3
    padded.valid = torch.tensor([n], device=DEVICE)
    got = ops.gated_deltanet(*rows, p, padded, inp["dims"])
    assert padded.valid is not None and got.shape[0] == t
    assert torch.equal(padded.conv, alone.conv)
    assert_close(padded.ssm, alone.ssm, "ssm")
    assert_close(got[:n], want, "y")
