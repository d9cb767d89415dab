"""The routed experts' 16-bit pair GEMVs in CUDA C (kiln/ops/moe/hpairs.py). Each pair's row is the
one-row hgemv of the same form on its expert's weight (the same kernel body, sums in the same order), so
on a GPU it must equal hgemv's output bit for bit, with act(g) * u in the prologue and the routing
weight (the output rounded, times the weight, rounded) too; the moe op's pair forms must pass its gate
against the trusted form. Without a GPU every form must still compile (NVRTC)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.ops import nvrtc  # noqa: E402
from kiln.ops.gemm import hgemv  # noqa: E402
from kiln.ops.moe import hpairs  # noqa: E402
from kiln.ops.moe import kernels as moe  # noqa: E402
from kiln.tune.device import device_info  # noqa: E402

GPU = torch.cuda.is_available()
SHAPE = moe.MoeShape(1, 16, 4, 512, 160, "silu")        # 16 experts, k 4, hidden 512, FFN 160 (ragged rows)


def gpu_forms(s: moe.MoeShape) -> list:
    gs = [(bn, hpairs.warps_for(s.h, w), r) for bn, w, r in moe.GPU_PAIRS_GATE_UP]
    ds = [(bn, hpairs.warps_for(s.i, w), r) for bn, w, r in moe.GPU_PAIRS_DOWN]
    return [g for g in gs if hpairs.fits(2 * s.i, s.h, g)], [d for d in ds if hpairs.fits(s.h, s.i, d)]


def test_pair_forms_fit_the_35b_and_compile():
    """Every gate_up and down form at the 35B-A3B's experts (and the test's ragged shape), with and without
    the prologue and the routing weight, bf16 and f16, int64 and int32 ids, compiles for sm_90."""
    if not nvrtc.compiler_available():
        pytest.skip("no libnvrtc here")
    for s in (moe.MoeShape(1, 256, 8, 2048, 512, "silu"), SHAPE):
        gs, ds = gpu_forms(s)
        assert len(gs) >= 3 and len(ds) >= 2
        for (n, k), forms, act, xdiv, rw in (((2 * s.i, s.h), gs, -1, s.k, 0), ((s.h, s.i), ds, 0, 1, 2),
                                             ((s.h, s.i), ds[:1], 0, 1, 1)):
            for bn, w, r in forms:
                for f16, idx32 in ((False, False), (True, True)):
                    d = hgemv.defines(n, k, bn, w, r, 1, f16, act) | {"XDIV": xdiv, "RW": rw, "IDX32": int(idx32)}
                    assert nvrtc.compile_cubin(hpairs.SOURCE, hpairs.NAME, d, (9, 0))[:4] == b"\x7fELF"


def test_pair_forms_are_offered_only_where_cuda_c_runs_for_silu_and_switched_on(monkeypatch):
    dev = device_info("cpu")
    monkeypatch.setenv("KILN_MOE_PAIRS", "1")
    assert moe.pairs_forms(SHAPE, dev) == []          # the interpreter: no CUDA C
    monkeypatch.setattr(nvrtc, "kernels_run", lambda dev: True)
    forms = moe.pairs_forms(SHAPE, dev)
    assert forms and all(v.p["pairs"] for v in forms)
    assert moe.pairs_forms(moe.MoeShape(1, 16, 4, 512, 160, "gelu_pytorch_tanh"), dev) == []
    monkeypatch.setenv("KILN_MOE_PAIRS", "0")
    assert moe.pairs_forms(SHAPE, dev) == []


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rw_dtype", ["x", torch.float32])
def test_gpu_each_pair_is_its_experts_hgemv(dtype, rw_dtype):
    if not nvrtc.available(torch.device("cuda")):
        pytest.skip("needs NVRTC")
    g = torch.Generator(device="cuda").manual_seed(7)
    s = SHAPE
    t = 3
    inputs = moe.moe_inputs(moe.MoeShape(t, s.e, s.k, s.h, s.i, s.act), dtype, torch.device("cuda"), g,
                            route_dtype=dtype if rw_dtype == "x" else rw_dtype)
    x, idx, rw = inputs["x"], inputs["idx"].contiguous(), inputs["weights"].contiguous()
    gate_up, down = inputs["gate_up"], inputs["down"]
    gs, ds = gpu_forms(s)
    for gf, df in zip(gs, ds * len(gs)):
        h = torch.full((t * s.k, 2 * s.i), float("nan"), dtype=dtype, device="cuda")
        hpairs.run_pairs(x, gate_up, idx, h, gf, s.k)
        y = torch.full((t * s.k, s.h), float("nan"), dtype=dtype, device="cuda")
        hpairs.run_pairs(h, down, idx, y, df, 1, hpairs.ACTS["silu"], rw)
        for pair, e in enumerate(idx.flatten().tolist()):
            want_h = hgemv.run(x[pair // s.k:pair // s.k + 1], gate_up[e], torch.empty_like(h[:1]), *gf, 1)
            assert torch.equal(h[pair:pair + 1], want_h), f"gate_up {gf} pair {pair}"
            plain = hgemv.run(h[pair:pair + 1], down[e], torch.empty_like(y[:1]), *df, 1, act=hpairs.ACTS["silu"])
            want = (plain.float() * rw.flatten()[pair].float()).to(dtype)
            assert torch.equal(y[pair:pair + 1], want), f"down {df} pair {pair}"


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
def test_gpu_the_moe_ops_pair_forms_pass_its_gate(monkeypatch):
    """At the 35B-A3B's expert shapes, one and four tokens: every pair form within the gate of the trusted form."""
    from kiln.tune import gate

    monkeypatch.setenv("KILN_MOE_PAIRS", "1")

    if not nvrtc.available(torch.device("cuda")):
        pytest.skip("needs NVRTC")
    dev, cuda = device_info(torch.device("cuda")), torch.device("cuda")
    gen = torch.Generator(device=cuda).manual_seed(5)
    for rows in (1, 4):
        s = moe.MoeShape(rows, 256, 8, 2048, 512, "silu")
        forms = moe.pairs_forms(s, dev)
        assert forms and set(forms) <= set(moe.OP.candidates(s, dev))
        cases = gate.trusted_cases(moe.OP, s, moe.OP.trusted(s, dev), torch.bfloat16, cuda, gen)
        for v in forms:
            verdict = gate.check(moe.OP, v, cases)
            assert verdict.ok, (v.name, verdict)


def test_a_pair_form_on_tensors_it_does_not_take_runs_the_gemv_form(monkeypatch):
    """x at an odd element offset (not 16-byte aligned): the default GEMV form runs instead, same result."""
    calls = []
    monkeypatch.setattr(hpairs, "routed", lambda *a: calls.append(a))
    g = torch.Generator().manual_seed(3)
    s = moe.MoeShape(2, 8, 2, 64, 32, "silu")
    i = moe.moe_inputs(s, torch.bfloat16, torch.device("cpu"), g)
    wide = torch.randn(2 * 64 + 1, generator=g).to(torch.bfloat16)
    x = wide[1:].view(2, 64)          # contiguous, 2 bytes past an aligned start
    assert x.data_ptr() % 16 and not hpairs.takes(x, i["gate_up"], i["down"], "silu")
    assert hpairs.takes(x.clone(), i["gate_up"], i["down"], "silu")
    v = moe.pairs_variant((8, 1, 4), (8, 1, 4))
    got = moe.moe_experts(x, i["idx"], i["weights"], i["gate_up"], i["down"], "silu", v=v)
    want = moe.moe_experts(x.clone(), i["idx"], i["weights"], i["gate_up"], i["down"], "silu",
                           v=moe.gemv_variant(16, 256, 4))
    assert not calls and torch.equal(got, want)


def test_pair_forms_are_candidates_up_to_8_tokens(monkeypatch):
    from types import SimpleNamespace

    monkeypatch.setenv("KILN_MOE_PAIRS", "1")
    monkeypatch.setattr(nvrtc, "kernels_run", lambda dev: True)
    dev = SimpleNamespace(capability=(9, 0), sms=132, device=torch.device("cpu"))
    for rows, want in ((1, True), (8, True), (16, False)):
        s = moe.MoeShape(rows, 256, 8, 2048, 512, "silu")
        assert any(v.p.get("pairs") for v in moe.OP.candidates(s, dev)) == want, rows
