"""The cpu backend: quantised projections kept quantised (torch's int4 kernel, a 16-bit copy), each
form gated against the reference at load; the model's output within bf16 rounding of the reference's."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

import kiln
from kiln.backends.cpu import CpuOps
from kiln.ops.quant import cgemv
from kiln.ops.quant import cpu as qcpu
from kiln.weights.quantized import dequantize, quantize

pytestmark = pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"),
                                reason="this torch has no CPU int4 kernel")


@pytest.mark.parametrize("n,k,group", [(48, 96, 32), (32, 256, 64), (80, 256, 128), (16, 512, 128)])
@pytest.mark.parametrize("rows", [1, 3, 37])
def test_int4_form_within_bf16_rounding_of_the_dequantised_product(n, k, group, rows):
    g = torch.Generator().manual_seed(n * k + rows)
    w = quantize(torch.randn(n, k, generator=g) * 0.1, 4, group)
    x = torch.randn(rows, k, generator=g)
    want = x @ dequantize(w).float().t()
    got = qcpu.int4_linear(x, qcpu.to_int4(w))
    assert got.dtype == x.dtype and got.shape == want.shape
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 2e-2, err         # bf16 rounding of x, the scales and zeros; a wrong nibble order lands near 1


def test_int4_form_takes_whole_blocks_of_16_rows_only():
    assert qcpu.int4_fits(quantize(torch.randn(32, 64), 4, 32))
    assert not qcpu.int4_fits(quantize(torch.randn(40, 64), 4, 32))
    assert not qcpu.int4_fits(quantize(torch.randn(32, 64), 8, 32))


def test_dense16_form_is_the_dequantised_weight_in_f16():
    w = quantize(torch.randn(32, 64, generator=torch.Generator().manual_seed(1)), 8, 32)
    x = torch.randn(1, 64)
    assert torch.equal(qcpu.dense16(w), dequantize(w).to(torch.float16))
    assert torch.allclose(qcpu.dense16_linear(x, qcpu.dense16(w)), x @ dequantize(w).t(), rtol=1e-2, atol=1e-2)


@pytest.fixture(autouse=True)
def _own_choices(tmp_path, monkeypatch):
    """Each test measures its forms: no choice cached by an earlier one (a patched form must meet the gate)."""
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))


def _load(backend, dtype="f32"):
    return kiln.load("synth:tiny-qwen3.5:bits=4:group=32", device="cpu", backend=backend, dtype=dtype)


def test_cpu_backend_keeps_quantised_forms_and_matches_the_reference():
    cpu, ref = _load("cpu"), _load("reference")
    assert isinstance(cpu.model.ops, CpuOps) and cpu.model.ops.choice
    assert set(cpu.model.ops.choice.values()) <= {"reference", "int4", "dense16", "bf16", "cgemv"}
    assert any(form == "int4" for (_, form) in cpu.model.ops.copies) or "int4" not in cpu.model.ops.choice.values()
    ids = torch.randint(0, 509, (23,), generator=torch.Generator().manual_seed(0))
    pos = torch.arange(len(ids))
    a = cpu.model.forward(ids, pos, cpu.model.make_state(torch.float32, "cpu"), last_only=False)
    b = ref.model.forward(ids, pos, ref.model.make_state(torch.float32, "cpu"), last_only=False)
    r16 = _load("reference", "bf16").model
    c = r16.forward(ids, pos, r16.make_state(torch.bfloat16, "cpu"), last_only=False).float()
    # DESIGN's rule for random weights: no farther from the f32 reference than its own bf16 run is
    # (the forms chosen, int4, bf16 or f16 copies, vary with the timings; each rounds some products)
    err = lambda y: ((y - b).abs().max() / b.abs().max()).item()      # noqa: E731
    assert err(a) <= err(c)


def test_a_wrong_form_fails_the_gate_and_the_reference_runs(monkeypatch):
    monkeypatch.setattr(qcpu, "int4_linear", lambda x, w: torch.zeros(*x.shape[:-1], w.shape[0], dtype=x.dtype) + 1)
    monkeypatch.setattr(qcpu, "dense16_linear", lambda x, w: torch.ones(*x.shape[:-1], w.shape[0], dtype=x.dtype))
    monkeypatch.setattr(qcpu, "bf16_linear", lambda x, w: -torch.ones(*x.shape[:-1], w.shape[0], dtype=x.dtype))
    monkeypatch.setattr(cgemv, "c_linear", lambda x, w: x[..., :1] * 0 + torch.zeros(w.shape[0]))
    llm = _load("cpu")
    assert set(llm.model.ops.choice.values()) == {"reference"}
    assert not llm.model.ops.copies and not llm.model.ops.plan


def test_cpu_backend_refuses_a_gpu_device():
    from kiln.backends import get_ops
    from kiln.errors import KilnError
    with pytest.raises(KilnError, match="runs on the CPU"):
        get_ops("cpu", torch.device("cuda"))


def test_cpu_backend_measures_its_forms_in_bf16_too():
    llm = _load("cpu", "bf16")      # the gate's f32 product must not mix the weight's bf16 with x's f32
    assert llm.model.ops.choice and llm.generate([1, 2, 3], max_new_tokens=2).text is not None


@pytest.mark.parametrize("prefix,t,window,softcap", [(0, 7, None, None), (9, 1, None, None), (12, 3, 5, None),
                                                     (4, 1, None, 30.0), (20, 1, 8, None), (0, 1, None, None)])
def test_cpu_attention_equals_the_reference(prefix, t, window, softcap):
    from kiln.cache import KVCache
    from kiln.ops.attention.cpu import AttentionCpu
    from kiln.ops.attention.reference import AttentionReference
    g = torch.Generator().manual_seed(prefix * 10 + t)
    h, kv, d = 6, 2, 16
    caches = [KVCache(kv, d, torch.float32, "cpu"), KVCache(kv, d, torch.float32, "cpu", capacity=8, head_major=True)]
    if prefix:
        k0, v0 = torch.randn(prefix, kv, d, generator=g), torch.randn(prefix, kv, d, generator=g)
        for c in caches:
            c.update(k0, v0, torch.arange(prefix))
    q, k, v = (torch.randn(t, n, d, generator=g) for n in (h, kv, kv))
    pos = torch.arange(prefix, prefix + t)
    want = AttentionReference().attention(q, k, v, caches[0], pos, 0.25, window, softcap)
    got = AttentionCpu().attention(q, k, v, caches[1], pos, 0.25, window, softcap)
    assert torch.allclose(got, want, rtol=1e-5, atol=1e-6)


def test_a_head_major_cache_reads_as_the_position_major_one_across_growth():
    from kiln.cache import KVCache
    g = torch.Generator().manual_seed(3)
    a, b = KVCache(3, 4, torch.float32, "cpu", capacity=2), KVCache(3, 4, torch.float32, "cpu", capacity=2,
                                                                     head_major=True)
    for n in (1, 3, 1, 7):      # appends past the capacity: the buffer doubles, keeping what it held
        k, v = torch.randn(n, 3, 4, generator=g), torch.randn(n, 3, 4, generator=g)
        pos = torch.arange(a.length, a.length + n)
        (ka, va, _), (kb, vb, _) = a.update(k, v, pos), b.update(k, v, pos)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert b.k.transpose(0, 1).is_contiguous() and b.length == 12


def test_plain_f32_projections_get_16_bit_forms_inside_the_copy_budget(monkeypatch):
    import kiln.backends.cpu as cpu_backend
    llm = kiln.load("synth:tiny-qwen3.5", device="cpu", backend="cpu", dtype="f32")
    ops = llm.model.ops
    # which form wins is the timings' business; that the plain f32 projections' 16-bit forms were
    # measured (past the gate), and that a chosen one runs its copy, is the backend's
    plain = [line for line in ops.report if " float32 rows " in line]
    assert any("dense16 " in line for line in plain if " rows 1:" in line)
    assert any("bf16 " in line.split(":", 1)[1] for line in plain if " rows 64:" in line)
    assert {form for form, *_ in ops.plan.values()} <= {"dense16", "bf16"}
    for (_, bucket), (form, copy, _) in ops.plan.items():
        assert copy.dtype == (torch.float16 if form == "dense16" else torch.bfloat16)
        assert (form == "dense16") == (bucket == "decode")
    ref = kiln.load("synth:tiny-qwen3.5", device="cpu", backend="reference", dtype="f32")
    ids = torch.randint(0, 509, (9,), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(len(ids))
    a = llm.model.forward(ids, pos, llm.model.make_state(torch.float32, "cpu"), last_only=False)
    b = ref.model.forward(ids, pos, ref.model.make_state(torch.float32, "cpu"), last_only=False)
    r16 = kiln.load("synth:tiny-qwen3.5", device="cpu", backend="reference", dtype="bf16").model
    c = r16.forward(ids, pos, r16.make_state(torch.bfloat16, "cpu"), last_only=False).float()
    err = lambda y: ((y - b).abs().max() / b.abs().max()).item()      # noqa: E731
    assert err(a) <= err(c)     # 16-bit products (if any won) no farther than the bf16 run
    monkeypatch.setattr(cpu_backend, "COPY_BUDGET", 0)
    none = kiln.load("synth:tiny-qwen3.5", device="cpu", backend="cpu", dtype="f32").model.ops
    assert none.choice and not none.copies and not none.plan


def test_cpu_choices_are_cached_and_read_back_without_measuring(monkeypatch):
    first = _load("cpu").model.ops
    files = list((Path(os.environ["KILN_CACHE_DIR"]) / "tune").glob("cpu_*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())
    monkeypatch.setattr(CpuOps, "_measure", lambda *a: pytest.fail("measured a cached choice"))
    second = _load("cpu").model.ops
    assert second.choice == first.choice and {k[1]: v[0] for k, v in second.plan.items()} \
        == {k[1]: v[0] for k, v in first.plan.items()}


@pytest.mark.skipif(not cgemv.available(), reason="no C compiler builds the kernel here")
def test_the_compiled_gemv_is_measured_for_a_decode_row_and_runs_when_chosen():
    llm = _load("cpu")
    ops = llm.model.ops
    decode = [line for line in ops.report if " rows 1:" in line and line.split()[1].startswith("q")]   # quantised
    assert decode and all("cgemv " in line.split(":", 1)[1] for line in decode)    # past the gate, timed
    for (_, bucket), (form, copy, run) in ops.plan.items():
        if form == "cgemv":
            assert bucket == "decode" and isinstance(copy, cgemv.CWeight) and run is cgemv.c_linear
    assert ops.compute_dtype in (None, "bf16", "f16")


def test_a_kernel_that_fails_to_build_leaves_its_form_out(monkeypatch, capsys):
    def broken(w):
        raise OSError("cc failed: no such instruction")
    monkeypatch.setattr(cgemv, "fits", lambda w: True)
    import kiln.backends.cpu as cpu_backend
    monkeypatch.setitem(cpu_backend._MAKE, "cgemv", broken)
    llm = _load("cpu")
    assert "cgemv" not in {form for form, *_ in llm.model.ops.plan.values()}
    assert "cpu form cgemv unavailable: cc failed" in capsys.readouterr().err
    assert llm.generate([1, 2, 3], max_new_tokens=2).text is not None


@pytest.mark.parametrize("shape", [(1, 640), (3, 4, 256), (7, 1, 96), (65, 576)])
@pytest.mark.parametrize("style", ["llama", "offset", "plain"])
def test_cpu_rmsnorm_equals_the_reference_in_f32(shape, style):
    from kiln.ops.norm.cpu import NormCpu
    from kiln.ops.norm.reference import NormReference
    g = torch.Generator().manual_seed(shape[-1])
    x, w = torch.randn(*shape, generator=g) * 3, torch.randn(shape[-1], generator=g) * 0.1
    want = NormReference().rmsnorm(x, w, 1e-6, style)
    got = NormCpu().rmsnorm(x, w, 1e-6, style)
    assert torch.allclose(got, want, rtol=2e-7, atol=0)     # f32 rounding of one sum at most
    assert torch.allclose(NormCpu().rmsnorm_noscale(x, 1e-6), NormReference().rmsnorm_noscale(x, 1e-6),
                          rtol=2e-7, atol=0)
    xb = x.bfloat16()       # other dtypes keep the reference's path, rounding where HF rounds
    assert torch.equal(NormCpu().rmsnorm(xb, w.bfloat16(), 1e-6, style),
                       NormReference().rmsnorm(xb, w.bfloat16(), 1e-6, style))
