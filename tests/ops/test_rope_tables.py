"""The RoPE tables in one launch (kiln/ops/rope/tables.py). Under the interpreter the kernel's cos and sin
are numpy's, so there it must equal the reference's arithmetic with numpy's cos and sin, bit for bit
(positions ragged against its blocks, widths ragged against its 32 columns, a scaling, every dtype). On a
GPU it must equal RopeReference.rope_tables itself, bit for bit, at the seed models' frequencies over
2^18 positions; and the cuda backend keeps the torch ops wherever its first-call check finds a difference."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from kiln.models.rope import inv_freq  # noqa: E402
from kiln.ops.rope import cuda as rope_cuda  # noqa: E402
from kiln.ops.rope import tables  # noqa: E402

GPU = torch.cuda.is_available()


def numpy_tables(positions, inv, dtype, scaling):
    """RopeReference.rope_tables' steps with numpy's f32 cos and sin (the interpreter's)."""
    f = positions.float()[:, None] * inv[None, :]
    c, s = (torch.from_numpy(fn(f.numpy())) for fn in (np.cos, np.sin))
    if scaling != 1.0:
        c, s = c * scaling, s * scaling
    return tuple(torch.cat([a, a], dim=-1).to(dtype) for a in (c, s))


@pytest.mark.skipif(GPU, reason="the interpreter's tables: numpy's cos and sin")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("t,half,scaling", [(1, 32, 1.0), (45, 40, 1.0), (70, 8, 0.5)])
def test_tables_equal_the_reference_steps_with_numpys_cos_and_sin(t, half, scaling, dtype):
    g = torch.Generator().manual_seed(t + half)
    positions = torch.randint(0, 300_000, (t,), generator=g)
    inv = inv_freq(2 * half, 1e6) * (1 + torch.rand(half, generator=g))
    got = tables.rope_tables(positions, inv, dtype, scaling)
    want = numpy_tables(positions, inv, dtype, scaling)
    for a, b in zip(got, want):
        assert a.shape == (t, 2 * half) and a.dtype == dtype
        assert torch.equal(a, b)


def test_tables_take_int64_positions_and_f32_frequencies():
    pos, inv = torch.arange(4), inv_freq(8, 1e4)
    assert tables.takes(pos, inv)
    assert not tables.takes(pos.int(), inv) and not tables.takes(pos, inv.double())
    assert not tables.takes(pos[::2], inv) and not tables.takes(pos.view(2, 2), inv)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dim,theta,scaling", [(64, 1e7, 1.0), (256, 1e4, 1.0), (128, 1e6, 1.0), (128, 5e5, 1.0),
                                               (64, 1e4, 0.7)])
def test_gpu_tables_equal_torchs_bit_for_bit(dim, theta, scaling, dtype):
    """Qwen3.5 (64 of 256 dims, 1e7), Gemma's sliding (256, 1e4) and full layers, Llama (128, 5e5), a scaling."""
    bad, total = tables.differing(inv_freq(dim, theta).cuda(), dtype, scaling)
    assert total == 2 * (1 << 18) * dim and bad == 0, f"{bad} of {total} values differ"


class Stub(rope_cuda.RopeCuda):
    off = frozenset()


def test_a_difference_keeps_the_torch_ops_and_is_reported_once(monkeypatch, capsys):
    calls = []
    monkeypatch.setattr(tables, "differing", lambda inv, dtype, scaling: calls.append(dtype) or (3, 100))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    ops, inv = Stub(), inv_freq(8, 1e4)
    assert not ops._tables_exact(inv, torch.bfloat16, 1.0)
    assert not ops._tables_exact(inv, torch.bfloat16, 1.0)
    assert calls == [torch.bfloat16]
    err = capsys.readouterr().err
    assert err.count("differs from torch's cos/sin at 3 of 100") == 1
    monkeypatch.setattr(tables, "differing", lambda inv, dtype, scaling: calls.append(dtype) or (0, 100))
    assert ops._tables_exact(inv, torch.float16, 1.0) and calls == [torch.bfloat16, torch.float16]


def test_no_check_inside_a_capture(monkeypatch):
    """The check reads back a count: inside a capture the torch ops run, and the check waits for an eager call."""
    monkeypatch.setattr(tables, "differing", lambda *a: pytest.fail("checked inside a capture"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not Stub()._tables_exact(inv_freq(8, 1e4), torch.bfloat16, 1.0)


def model_logits(name: str, monkeypatch, on: str, eager: bool):
    import kiln

    monkeypatch.setenv("KILN_ROPE_TABLES", on)
    llm = kiln.load(name, device="cuda", dtype="bf16", enforce_eager=eager)
    prompt = [(5 * i + 2) % 300 for i in range(24)]
    out = llm.generate(prompt, max_new_tokens=10, temperature=0).token_ids
    with torch.inference_mode():
        state = llm.engine.new_state(64)
        llm.engine.prefill(prompt, state)
        logits = [llm.engine.decode_step(t, len(prompt) + j, state).float().cpu() for j, t in enumerate(out[:4])]
    return out, torch.stack(logits), dict(getattr(llm.model.ops, "_rope_verdicts", {}))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["synth:tiny-qwen3.5", "synth:tiny-gemma4-moe"])
@pytest.mark.parametrize("eager", [True, False])
def test_gpu_models_with_the_table_kernel_give_the_torch_tables_logits(name, eager, monkeypatch):
    """The kernel on (its first-call check passed: every verdict True) gives the same tokens and logits, bit for
    bit, as the torch ops, in eager steps and in the decode graph."""
    want_tokens, want, off = model_logits(name, monkeypatch, "0", eager)
    got_tokens, got, verdicts = model_logits(name, monkeypatch, "1", eager)
    assert not off and verdicts and all(verdicts.values()), verdicts
    assert got_tokens == want_tokens
    assert torch.equal(got, want)
