"""The fused q/k norm + rotary + KV-cache write (kiln.ops.rope) against the reference
composition (ReferenceOps.rmsnorm, then ReferenceOps.apply_rope, then the buffer write): partial and
full rotary, with and without the norm, q a strided view of a q|gate projection, scattered cache
slots. Under Triton's interpreter on CPU (small shapes); the `gpu` test runs Qwen3.5-0.8b's shape."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.backends.reference import ReferenceOps  # noqa: E402
from kiln.models.rope import inv_freq  # noqa: E402
from kiln.ops.rope import kernels as rope_kernels  # noqa: E402
from kiln.tune import gate  # noqa: E402
from kiln.tune.device import device_info  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REF = ReferenceOps(DEVICE)
START = 13     # first cache slot written: the rows before and after must stay as they were


def case(t, dtype, style, h=4, kv=2, d=32, r=8, seed=0, start=START):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *shape, scale=1.0: (torch.randn(*shape, generator=g) * scale).to(dtype=dtype, device=DEVICE)  # noqa: E731
    scale = (torch.rand(t, 1, 1, generator=g) * 4 + 0.25).to(DEVICE)
    qg = (torch.randn(t, h, 2 * d, generator=g).to(DEVICE) * scale).to(dtype)          # q | gate per head
    shift = 0.0 if style == "offset" else 1.0
    positions = torch.arange(start, start + t, device=DEVICE)
    cos, sin = REF.rope_tables(positions + 1000, inv_freq(r, 10000.0).to(DEVICE), dtype)          # angles far from 0
    cap = start + t + 7
    return {"q": qg[..., :d], "k": rnd(t, kv, d, scale=2.0), "v": rnd(t, kv, d),
            "q_norm_w": None if style is None else (rnd(d, scale=0.2) + shift).to(dtype),
            "k_norm_w": None if style is None else (rnd(d, scale=0.2) + shift).to(dtype),
            "eps": 1e-6, "style": style or "llama", "cos": cos, "sin": sin,
            "k_buf": rnd(cap, kv, d), "v_buf": rnd(cap, kv, d), "positions": positions}


def reference(c, v_norm=False):
    """The reference composition: norm (if any), rope, then the cache rows at positions."""
    q, k, v = c["q"], c["k"], c["v"]
    v = REF.rmsnorm_noscale(v, c["eps"]) if v_norm else v
    if c["q_norm_w"] is not None:
        q = REF.rmsnorm(q, c["q_norm_w"], c["eps"], c["style"])
        k = REF.rmsnorm(k, c["k_norm_w"], c["eps"], c["style"])
    kb, vb = c["k_buf"].clone(), c["v_buf"].clone()
    kb[c["positions"]] = REF.apply_rope(k, c["cos"], c["sin"])
    vb[c["positions"]] = v
    return REF.apply_rope(q, c["cos"], c["sin"]), kb, vb


def kiln(c, var=None, v_norm=False):
    kb, vb = c["k_buf"].clone(), c["v_buf"].clone()
    q = rope_kernels.qk_rope(*(c[n] for n in rope_kernels.ARGS), kb, vb, c["positions"], var, v_norm=v_norm)
    return q, kb, vb


def assert_match(got, want, exact: bool = True):
    """16-bit: bit-equal (each step rounds where the reference's torch op rounds; the one f32 sum,
    sum(x^2) for rstd, differs in order, which may move rstd by an f32 ulp but has not flipped a
    16-bit result on these inputs). f32: the same, within 1e-6 of the largest value. On the GPU
    (exact=False) rstd's reduction tree and approximate rsqrt differ from torch's, so a normed value
    may be one ulp off, and the rope sum carries that: within 1/128 of the largest value (two bf16
    ulps of it) and 99% bit-equal. (Before qk_rope launched with FP fusion off, 7% were off on the
    H200: its rounded products were contracted into 16-bit FMAs; docs/compiler.md.)"""
    for g, w, name in zip(got, want, ("q", "k_buf", "v_buf")):
        assert g.dtype == w.dtype and g.shape == w.shape, name
        err = (g.float() - w.float()).abs().max().item()
        scale = w.float().abs().max().item()
        if w.dtype == torch.float32:
            assert err <= 1e-6 * scale, f"{name}: {err:.2e}"
        elif exact:
            assert torch.equal(g, w), f"{name}: {(g != w).sum().item()} of {w.numel()} differ"
        else:
            same = (g == w).float().mean().item()
            assert err <= scale / 128 and same >= 0.99, f"{name}: {err:.2e} of {scale:.2e}, {same:.4f} bit-equal"


@pytest.mark.parametrize("style", ["offset", "llama", None])
@pytest.mark.parametrize("t", [1, 5, 37])
@pytest.mark.parametrize("r", [8, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_qk_rope_equals_reference(style, t, r, dtype):
    c = case(t, dtype, style, r=r, seed=t + r)
    assert not c["q"].is_contiguous()
    got, want = kiln(c), reference(c)
    assert_match(got, want)
    # rows outside the written slots are the buffers' own
    assert torch.equal(got[1][:START], c["k_buf"][:START]) and torch.equal(got[2][START + t:], c["v_buf"][START + t:])


@pytest.mark.parametrize("var", [rope_kernels.rope_variant(1, 4), rope_kernels.rope_variant(4, 2)])
def test_variants_plain_style_and_f16(var):
    for dtype in (torch.float16, torch.bfloat16):
        c = case(7, dtype, "plain", r=16, seed=3)
        assert_match(kiln(c, var), reference(c))


@pytest.mark.parametrize("keys_are_values", [False, True])
@pytest.mark.parametrize("t", [1, 6])
def test_v_norm_gemma4(keys_are_values, t):
    """Gemma 4: v RMS-normed without a weight before the append; on its full layers v is the keys'
    own projection (un-normed, un-rotated), the same tensor as k."""
    c = case(t, torch.bfloat16, "plain", r=32, seed=5 + t)
    if keys_are_values:
        c["v"] = c["k"]
    got, want = kiln(c, rope_kernels.rope_variant(2, 2), v_norm=True), reference(c, v_norm=True)
    assert_match(got, want, exact=False)    # v's sum of squares in another order: an ulp may move
    assert not torch.equal(want[2], reference(c)[2])    # the norm changed what is stored


def test_supports():
    c = case(3, torch.bfloat16, "offset")
    assert rope_kernels.supports(c["q"], c["k"], c["v"], c["k_buf"], c["cos"])
    assert not rope_kernels.supports(c["q"], c["k"], c["v"], c["k_buf"].float(), c["cos"])
    narrow = [c[n][..., :24] for n in ("q", "k", "v", "k_buf")]
    assert not rope_kernels.supports(*narrow, c["cos"])


def test_op_gate_passes_every_candidate_and_keeps_inputs():
    """The registry op: outputs are q_out and copies of the buffers; every candidate passes the gate;
    the inputs' buffers are untouched, so every variant sees the same."""
    op, dev = rope_kernels.OP, device_info(DEVICE)
    s = rope_kernels.RopeShape(5, 4, 2, 32, 16, "offset")
    gen = torch.Generator(device=DEVICE).manual_seed(11)
    cases = gate.trusted_cases(op, s, op.trusted(s, dev), torch.bfloat16, DEVICE, gen)
    before = cases[0].inputs["k_buf"].clone()
    for v in op.candidates(s, dev):
        verdict = gate.check(op, v, cases)
        assert verdict.ok and verdict.err == 0.0, (v.name, verdict)
    assert torch.equal(cases[0].inputs["k_buf"], before)
    assert not torch.equal(cases[0].expected["k_buf"], before)


# -- on the GPU: Qwen3.5-0.8b's attention shape ------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("t", [1, 300])
def test_gpu_qwen35_shape_every_candidate(t):
    """H=8, KV=2, D=256, R=64 (partial rotary), offset norm, bf16, every candidate (the GPU's casts
    round to nearest even like torch's; only rstd's sum differs: see assert_match)."""
    s = rope_kernels.RopeShape(t, 8, 2, 256, 64, "offset")
    for v in rope_kernels.OP.candidates(s, device_info(DEVICE)):
        c = case(t, torch.bfloat16, "offset", h=8, kv=2, d=256, r=64, seed=t)
        assert_match(kiln(c, v), reference(c), exact=False)


@pytest.mark.gpu
@gpu
def test_gpu_decode_captures_in_a_cuda_graph():
    c = case(1, torch.bfloat16, "offset", h=8, kv=2, d=256, r=64, seed=5)
    kb, vb = c["k_buf"].clone(), c["v_buf"].clone()
    args = [c[n] for n in rope_kernels.ARGS]
    rope_kernels.qk_rope(*args, kb.clone(), vb.clone(), c["positions"])          # compile
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = rope_kernels.qk_rope(*args, kb, vb, c["positions"])
    c["positions"].fill_(START + 2)                                    # read on the device at replay
    graph.replay()
    torch.cuda.synchronize()
    assert_match((q, kb, vb), reference(c), exact=False)


def test_a_ring_buffer_takes_each_row_at_its_position_modulo_the_ring():
    """kiln.cache.WindowKVCache: position p's k and v land at row p % ring, q as with a plain buffer."""
    c = case(6, torch.bfloat16, "llama", start=29)      # positions 29..34 in a ring of 16: rows 13..15, 0..2
    ring = 16
    want_q, want_k, want_v = kiln(c)
    kb, vb = c["k_buf"][:ring].clone(), c["v_buf"][:ring].clone()
    q = rope_kernels.qk_rope(*(c[n] for n in rope_kernels.ARGS), kb, vb, c["positions"], ring=ring)
    rows = c["positions"] % ring
    assert torch.equal(q, want_q)
    assert torch.equal(kb[rows], want_k[c["positions"]]) and torch.equal(vb[rows], want_v[c["positions"]])
    untouched = torch.ones(ring, dtype=torch.bool)
    untouched[rows.cpu()] = False
    assert torch.equal(kb[untouched.to(DEVICE)], c["k_buf"][:ring][untouched.to(DEVICE)])
