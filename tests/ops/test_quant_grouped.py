"""The grouped MoE kernels on packed stacks (kiln/ops/quant/grouped.py) equal the same kernels on the
stacks' dequantised copies (embed.qembed, bit-exact to mx.dequantize), bit for bit under the
interpreter (both kernels hand the same tiles to the same numpy product; on the GPU see the last
test): every bits value
whose values sit inside a word, group sizes, tile forms with K in one step and ragged against the tile,
experts with no tokens, f32 scales behind a bf16 model (GGUF's); and CudaOps takes them for every
prefill chunk (the copies only when asked for, where they fit)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.backends.cuda import CudaOps  # noqa: E402
from kiln.ops.moe import kernels as mk  # noqa: E402
from kiln.ops.quant import embed  # noqa: E402
from kiln.ops.quant import grouped as qgrouped  # noqa: E402
from kiln.weights.quantized import QuantizedWeight, quantize  # noqa: E402

from .support import DEVICE, REF, rand  # noqa: E402

FORMS = [mk.TRUSTED, mk.grouped_variant(16, 32, 128, 4, 1),      # K in one step, past H and I (masked)
         mk.grouped_variant(32, 16, 32, 4, 1, 32, 64)]           # down on tiles of its own


def stacks(e, h, i, bits, group, dtype, wide=False, seed=1):
    gate_up = quantize(rand(e, 2 * i, h, seed=seed, scale=h ** -0.5), bits, group)
    down = quantize(rand(e, h, i, seed=seed + 1, scale=i ** -0.5), bits, group)
    out = []
    for w in (gate_up, down):
        if wide:     # f32 scales, computed in bf16 (a GGUF's kept-quantised tensors)
            w = QuantizedWeight(w.packed, w.scales.float(), w.biases.float(), bits, group, out_dtype=dtype)
        else:
            w = w.to(dtype=dtype)
        out.append(w.to(DEVICE))
    return out


def routed(t, k, e, dtype, seed=3):
    """Each token's k distinct experts among the first e - 2 (the last two get no rows)."""
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(e - 2, generator=g)[:k] for _ in range(t)]).to(DEVICE)
    weights = (torch.rand(t, k, generator=g) + 0.1).to(device=DEVICE, dtype=dtype)
    return idx, weights


def copies(w: QuantizedWeight) -> torch.Tensor:
    flat = w._with(*(a.reshape(-1, a.shape[-1]) for a in (w.packed, w.scales, w.biases)))
    return embed.qembed(None, flat).view(w.shape)


def both(x, idx, weights, gate_up, down, act, v):
    """(packed, copies): each pair's weighted expert output by the two paths, one tile form."""
    y = [torch.full((idx.numel(), x.shape[1]), float("nan"), dtype=x.dtype, device=DEVICE) for _ in range(2)]
    rw = weights.reshape(-1).contiguous()
    qgrouped.run(x, idx, rw, gate_up, down, act, v.p, y[0])
    mk.run_grouped(x, idx, rw, copies(gate_up), copies(down), act, v.p, y[1])
    return y


@pytest.mark.parametrize("bits,group", [(4, 32), (2, 64), (8, 32)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_tiles_give_the_copies_outputs_bit_for_bit(bits, group, dtype):
    e, k, h, i, t = 6, 2, 3 * group, 2 * group, 11      # h ragged against the 128-wide tile
    gate_up, down = stacks(e, h, i, bits, group, dtype)
    x = rand(t, h, dtype=dtype, seed=5)
    idx, weights = routed(t, k, e, dtype)
    for v in FORMS:
        packed, want = both(x, idx, weights, gate_up, down, "silu", v)
        assert not want.isnan().any()
        assert torch.equal(packed, want), v.name


def test_f32_scales_and_gelu_give_the_copies_outputs():
    e, k, h, i, t = 5, 3, 64, 32, 7
    gate_up, down = stacks(e, h, i, 4, 32, torch.bfloat16, wide=True)
    x = rand(t, h, dtype=torch.bfloat16, seed=6)
    idx, weights = routed(t, k, e, torch.float32)
    packed, want = both(x, idx, weights, gate_up, down, "gelu_pytorch_tanh", FORMS[1])
    assert torch.equal(packed, want)


def test_bits_that_cross_words_are_not_taken():
    gate_up, down = stacks(4, 64, 32, 3, 32, torch.bfloat16)
    x = rand(8, 64, dtype=torch.bfloat16)
    assert not qgrouped.supports(x, gate_up, down, "silu")
    assert qgrouped.supports(x, *stacks(4, 64, 32, 4, 32, torch.bfloat16), "silu")


@pytest.mark.parametrize("gated", [False, True])
def test_a_chunk_with_few_rows_an_expert_runs_packed_and_equals_the_reference(monkeypatch, gated):
    """9 tokens, 2 of 8 experts each (18 pairs <= 16 a expert): the packed kernels run, no copy is
    made, and the result is the reference's on the dequantised experts within its rounding; with the
    rows many (the copies' path) the same values, bit for bit (the same tile form)."""
    e, k, h, i, t, dt = 8, 2, 64, 32, 9, torch.bfloat16
    gate_up, down = stacks(e, h, i, 4, 32, dt)
    x = rand(t, h, dtype=dt, seed=7)
    idx, weights = routed(t, k, e, dt)
    shared = rand(t, h, dtype=dt, seed=8) if gated else None
    gate_w = x[:1].clone() if gated else None
    ops = CudaOps(DEVICE)

    def experts():
        if gated:
            return ops.moe_experts_gated(x, idx, weights, gate_up, down, "silu", gate_w, shared)
        return ops.moe_experts(x, idx, weights, gate_up, down, "silu")

    made, runs = [], []
    real_copies, real_run = embed.qembed, qgrouped.run
    monkeypatch.setattr(embed, "qembed", lambda *a, **kw: made.append(1) or real_copies(*a, **kw))
    monkeypatch.setattr(qgrouped, "run", lambda *a, **kw: runs.append(1) or real_run(*a, **kw))
    got = experts()
    assert runs == [1] and made == []
    want = (REF.moe_experts_gated(x, idx, weights, gate_up, down, "silu", gate_w, shared) if gated
            else REF.moe_experts(x, idx, weights, gate_up, down, "silu"))
    assert (got.float() - want.float()).abs().max() <= 2.0 ** -7 * want.float().abs().max()
    monkeypatch.setattr("kiln.ops.moe.cuda.COPIES_FROM", 0)       # every chunk "many rows": the copies
    copied = experts()
    assert runs == [1] and made and torch.equal(copied, got)


def test_stacks_whose_copies_do_not_fit_run_packed_at_any_rows(monkeypatch):
    """Many rows an expert, but no room for the copies (the 397B): packed, no batches of copies."""
    e, k, h, i, t, dt = 4, 2, 64, 32, 40, torch.bfloat16
    gate_up, down = stacks(e, h, i, 4, 32, dt)
    x = rand(t, h, dtype=dt, seed=9)
    idx, weights = routed(t, k, e, dt)
    ops = CudaOps(DEVICE)
    monkeypatch.setattr("kiln.ops.moe.cuda.COPIES_FROM", 0)       # the copies wherever they fit
    roomy = ops.moe_experts(x, idx, weights, gate_up, down, "silu")
    runs, real_run = [], qgrouped.run
    monkeypatch.setattr(qgrouped, "run", lambda *a, **kw: runs.append(1) or real_run(*a, **kw))
    for mod in ("kiln.ops.quant.cuda", "kiln.ops.moe.cuda"):
        monkeypatch.setattr(f"{mod}.stack_room", lambda x: 1)
    tight = ops.moe_experts(x, idx, weights, gate_up, down, "silu")
    assert runs == [1] and torch.equal(tight, roomy)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("bits", [4, 2])
def test_packed_tiles_on_qwen35_35b_shapes_and_forms(bits):
    """Compiled, at the 35B's expert shapes, in the default grouped forms of both row regimes: the
    copies' outputs, mostly bit for bit. Not all: the two kernels are compiled apart (the packed one's
    weight tile comes from registers, the copy's from memory), so the compiler may take another
    tensor-core instruction and summation order; a pair's output then moves by the rounding of its
    two GEMMs (h, then the down product times the routing weight): 2 ulp of its row's largest value."""
    e, k, h, i = 256, 8, 2048, 512
    gate_up, down = stacks(e, h, i, bits, 64, torch.bfloat16)
    for t in (64, 1000):
        x = rand(t, h, dtype=torch.bfloat16, seed=t)
        idx, weights = routed(t, k, e, torch.bfloat16, seed=t)
        v = mk.OP.default(mk.MoeShape(t, e, k, h, i, "silu"), CudaOps(DEVICE).dev)
        packed, want = both(x, idx, weights, gate_up, down, "silu", v)
        assert not want.isnan().any() and not packed.isnan().any()
        row = want.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-6)
        ulp = 2.0 ** (torch.floor(torch.log2(row)) + 1) * torch.finfo(torch.bfloat16).eps / 2
        assert ((packed.float() - want.float()).abs() <= 2 * ulp).all(), (t, v.name)
        assert (packed == want).float().mean() >= 0.9, (t, v.name)
