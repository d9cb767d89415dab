"""The MoE kernels (kiln/ops/moe/kernels.py) equal ReferenceOps.moe_experts: under Triton's
interpreter on small shapes (ragged ones, one token, experts with no tokens, f32 routing weights),
and on the GPU at the real Qwen3.5-35B-A3B and Gemma 4 26B-A4B shapes, graph-captured too."""

from __future__ import annotations

import weakref

import pytest
import torch

pytest.importorskip("triton")

from kiln.backends.reference import ReferenceOps  # noqa: E402
from kiln.ops.moe import kernels as moe_kernels  # noqa: E402
from kiln.ops.moe import router as moe_router  # noqa: E402
from kiln.tune import gate  # noqa: E402
from kiln.tune.device import device_info  # noqa: E402
from kiln.tune.registry import get_op  # noqa: E402

from .support import captured  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REF = ReferenceOps(DEVICE)
# (T, k, H, I, act): one token, a few, ragged H/I (not multiples of the tiles), more rows than a tile.
CASES = [(1, 2, 64, 32, "silu"), (3, 3, 48, 40, "gelu_pytorch_tanh"), (17, 3, 64, 32, "gelu_pytorch_tanh"),
         (40, 2, 48, 40, "silu")]
FORMS = [moe_kernels.TRUSTED, moe_kernels.grouped_variant(64, 64, 32, 4, 1),
         moe_kernels.grouped_variant(32, 32, 64, 4, 1, 64, 16),     # down on tiles of its own
         moe_kernels.gemv_variant(64, 64, 4),
         moe_kernels.gemv_variant(16, 32, 4, 1, True, 32, 16),     # accumulating, down on its own tiles
         moe_kernels.gemv_variant(16, 32, 4, 1, True, 32, 16, True)]   # ... and combining in its last arrival
GEMV_FORMS = 3     # the last ones: for few tokens (and slow interpreted)


def inputs(t, k, h, i, act, dtype, e=8, route_dtype=None, seed=0):
    """moe_inputs, rescaled so that gate/up/down outputs are O(1): the activations see their whole range."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    d = moe_kernels.moe_inputs(moe_kernels.MoeShape(t, e, k, h, i, act), torch.float32, DEVICE, gen,
                               route_dtype=torch.float32)
    d["gate_up"] *= 1.5 * h ** -0.5 / 0.02
    d["down"] *= i ** -0.5 / 0.02
    for name in ("x", "gate_up", "down"):
        d[name] = d[name].to(dtype)
    d["weights"] = d["weights"].to(route_dtype or dtype)
    return d


def run(d, v):
    return moe_kernels.moe_experts(d["x"], d["idx"], d["weights"], d["gate_up"], d["down"], d["act"], v)


def reference(d):
    return REF.moe_experts(d["x"], d["idx"], d["weights"], d["gate_up"], d["down"], d["act"])


def assert_close(got: torch.Tensor, want: torch.Tensor, k: int, exact_fraction: float) -> float:
    """f32: the same sums in another order, 1e-5 of the largest value. 16-bit: each of a token's k
    contributions may be one ulp (of itself, at most about the row's largest value) off where a
    GEMM's rounding flips with the summation order, and the combine's rounding after each add can
    move that by one ulp more: (k + 1) ulp of the row's largest |value|; and mostly bit-equal.
    Returns the fraction of bit-equal elements."""
    assert got.dtype == want.dtype and got.shape == want.shape
    assert not torch.isnan(got).any()
    err = (got.float() - want.float()).abs()
    if want.dtype == torch.float32:
        assert err.max().item() <= 1e-5 * want.abs().max().item() + 1e-7, err.max().item()
        return float((got == want).float().mean())
    row = want.float().abs().amax(dim=1, keepdim=True).clamp_min(1e-6)
    ulp = 2.0 ** (torch.floor(torch.log2(row)) + 1) * torch.finfo(want.dtype).eps / 2   # spacing at row's max
    assert (err <= (k + 1) * ulp).all(), f"{(err / ulp).max().item():.2f} ulp of the row max"
    same = float((got == want).float().mean())
    assert same >= exact_fraction, f"only {same:.4f} of the elements bit-equal"
    return same


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("t,k,h,i,act", CASES)
def test_moe_equals_reference(t, k, h, i, act, dtype):
    d = inputs(t, k, h, i, act, dtype, seed=t)
    want = reference(d)
    for v in FORMS if t <= 17 else FORMS[:-GEMV_FORMS]:
        assert_close(run(d, v), want, k, exact_fraction=0.99)


@pytest.mark.parametrize("form", [moe_kernels.grouped_variant(32, 32, 64, 4, 1), moe_kernels.gemv_variant(64, 64, 4),
                                  FORMS[-1]], ids=lambda v: v.name)
def test_moe_f32_routing_weights(form):
    """Gemma 4: routing weights in f32, the down output times the weight in f32, rounded once."""
    d = inputs(17, 3, 48, 40, "gelu_pytorch_tanh", torch.bfloat16, route_dtype=torch.float32, seed=3)
    assert_close(run(d, form), reference(d), 3, exact_fraction=0.99)


def test_moe_crowded_experts_and_exact_blocks():
    """Every token on the same two experts (one expert's rows fill whole BM blocks, the others
    none), and tokens whose experts are listed in descending id (the combine sorts them)."""
    d = inputs(16, 2, 64, 32, "silu", torch.bfloat16, seed=7)
    d["idx"] = torch.tensor([[5, 2]] * 16, device=DEVICE)
    want = reference(d)
    for v in (moe_kernels.TRUSTED, moe_kernels.grouped_variant(32, 32, 64, 4, 1), moe_kernels.gemv_variant(64, 64, 4),
              FORMS[-1]):
        assert_close(run(d, v), want, 2, exact_fraction=0.99)


def test_moe_op_registered_inputs_and_gate():
    """The registry op: its inputs are what the brief asks for, and every CPU candidate passes the
    tuner's gate (outputs poisoned with NaN first) against the trusted variant."""
    op = get_op("moe")
    assert op is moe_kernels.OP
    shape = moe_kernels.MoeShape(9, 8, 3, 48, 40, "silu")
    assert shape.key == (8, 3, 48, 40, "silu")
    dev = device_info(DEVICE)
    d = op.inputs(shape, torch.float32, DEVICE, torch.Generator(device=DEVICE).manual_seed(1))
    idx = d["idx"]
    assert idx.shape == (9, 3) and all(len(set(r.tolist())) == 3 for r in idx)       # distinct per token
    assert 3 < len(set(idx.flatten().tolist())) < 8                                   # spread, some experts idle
    assert (d["weights"] > 0).all() and torch.allclose(d["weights"].sum(1), torch.ones(9, device=DEVICE))
    names = [v.name for v in op.catalogue(shape, dev)]
    assert len(names) == len(set(names)) and op.trusted(shape, dev).name in names
    cases = []
    for rows in (9, 4):
        block = op.with_rows(shape, rows)
        ins = op.inputs(block, torch.bfloat16, DEVICE, torch.Generator(device=DEVICE).manual_seed(rows))
        out = gate.poisoned(op, block, ins)
        op.run(op.trusted(shape, dev), ins, out)
        cases.append(gate.Case(block, ins, out))
    for v in op.candidates(shape, dev):
        verdict = gate.check(op, v, cases)
        assert verdict.ok, (v.name, verdict)


def test_cuda_ops_route_moe_to_the_kernels():
    """CudaOps.moe_experts (the lead's routing) reaches these kernels and equals the reference."""
    from kiln.backends.cuda import CudaOps

    d = inputs(3, 2, 64, 32, "silu", torch.bfloat16, seed=11)
    x, idx, w, gu, dn = d["x"], d["idx"], d["weights"], d["gate_up"], d["down"]
    assert moe_kernels.supports(x, gu, dn) and not moe_kernels.supports(x, gu, dn, "gelu")
    assert not moe_kernels.supports(x, gu.float(), dn)
    assert moe_kernels.OP.supports(x, idx, w.float(), gu, dn, "silu")
    assert_close(CudaOps(DEVICE).moe_experts(x, idx, w, gu, dn, "silu"), reference(d), 2, exact_fraction=0.99)


def test_max_blocks_bounds_the_padded_layout():
    for pairs in (1, 7, 16, 17, 300):
        for e in (1, 8, 256):
            for bm in (16, 32, 64):
                counts = torch.bincount(torch.randint(0, e, (pairs,)), minlength=e)
                assert int(((counts + bm - 1) // bm).sum()) <= moe_kernels.max_blocks(pairs, e, bm)


@pytest.mark.parametrize("t,k,e", [(1, 1, 1), (1, 2, 8), (7, 3, 5), (45, 4, 60), (300, 8, 256)])
def test_sort_pairs_groups_every_pair_under_its_expert(t, k, e):
    """The counting sort against a stable sort: the same starts, and within each expert's rows the
    same pairs (in any order: the atomics' order is not fixed, nor need it be)."""
    idx = torch.stack([torch.randperm(e)[:k] if k <= e else torch.randint(0, e, (k,)) for _ in range(t)])
    idx = idx.to(DEVICE)
    order, starts = moe_kernels.sort_pairs(idx, e)
    flat = idx.reshape(-1)
    want = torch.searchsorted(torch.sort(flat).values, torch.arange(e + 1, device=DEVICE))
    assert order.dtype == starts.dtype == torch.int64
    assert starts.tolist() == want.tolist()
    assert sorted(order.tolist()) == list(range(t * k))
    for x in range(e):
        got = order[starts[x]:starts[x + 1]]
        assert (flat[got] == x).all() and got.unique().numel() == got.numel()


@pytest.mark.parametrize("t,k,e,bm,skew", [(1, 1, 1, 16, 0), (7, 3, 5, 16, 0), (45, 4, 60, 32, 0), (300, 8, 256, 64, 0),
                                           (16, 8, 256, 16, 0), (40, 8, 16, 16, 0), (100, 2, 64, 16, 1)])
def test_sort_pairs_block_table_lists_each_experts_blocks(t, k, e, bm, skew):
    """The table the grouped kernels read, against the counts: each expert's rows in whole blocks of
    bm, in expert order, then blocks marked with the expert e (skipped). skew: most tokens pick the
    same two experts (several blocks each)."""
    idx = torch.stack([torch.randperm(e)[:k] if k <= e else torch.randint(0, e, (k,)) for _ in range(t)])
    if skew:
        idx[: (3 * t) // 4] = torch.tensor([3, 40])
    order, starts, blocks = moe_kernels.sort_pairs(idx.to(DEVICE), e, bm)
    s = starts.tolist()
    want = [(x, r, s[x + 1]) for x in range(e) for r in range(s[x], s[x + 1], bm)]
    assert blocks.shape[0] == moe_kernels.grid_blocks(t * k, e, bm) >= len(want)
    got = [tuple(row[:3]) for row in blocks.tolist()]
    assert got[:len(want)] == want
    assert all(row[0] == e for row in got[len(want):])


# -- on the GPU: the real shapes ---------------------------------------------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
QWEN = (256, 8, 2048, 512, "silu", None)                                # qwen3.5-35b-a3b
GEMMA = (128, 8, 2816, 704, "gelu_pytorch_tanh", torch.float32)         # gemma4-26b-a4b, f32 routing weights


def real_inputs(t, e, k, h, i, act, route_dtype):
    gen = torch.Generator(device=DEVICE).manual_seed(t)
    return moe_kernels.moe_inputs(moe_kernels.MoeShape(t, e, k, h, i, act), torch.bfloat16, DEVICE, gen,
                                  route_dtype=route_dtype)


def gpu_forms(shape):
    dev = device_info(DEVICE)
    op = moe_kernels.OP
    return list(dict.fromkeys([op.trusted(shape, dev), op.default(shape, dev)] + op.candidates(shape, dev)))


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("model,t", [(QWEN, 1), (QWEN, 512), (QWEN, 2048), (GEMMA, 1), (GEMMA, 512)],
                         ids=["qwen-1", "qwen-512", "qwen-2048", "gemma-1", "gemma-512"])
def test_gpu_moe_real_shapes(model, t):
    e, k, h, i, act, route = model
    d = real_inputs(t, e, k, h, i, act, route)
    want = reference(d)
    shape = moe_kernels.MoeShape(t, e, k, h, i, act)
    for v in gpu_forms(shape):
        same = assert_close(run(d, v), want, k, exact_fraction=0.9)
        print(f"{moe_kernels.OP.shape_str(shape)} {v.name}: {same:.4f} of the elements bit-equal to the reference")


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("form", [moe_kernels.gemv_variant(16, 256, 4),
                                  moe_kernels.gemv_variant(8, 256, 4, 2, True, 16, 128),
                                  moe_kernels.gemv_variant(8, 256, 4, 3, True, 8, 128, True),
                                  moe_kernels.grouped_variant(16, 64, 128, 4, 3)], ids=lambda v: v.name)
def test_gpu_moe_captures_in_a_cuda_graph(form):
    """No host sync anywhere: the op replays from a graph, and new routing gives new outputs."""
    d = real_inputs(4, *QWEN[:5], None)
    out = torch.empty_like(d["x"])
    run_once = lambda: moe_kernels.moe_experts(d["x"], d["idx"], d["weights"], d["gate_up"], d["down"], "silu",  # noqa: E731
                                               form, out)
    graph, _ = captured(run_once)
    d["idx"].copy_(torch.flip(d["idx"], dims=[0]).roll(1, dims=1))
    d["x"].copy_(torch.randn_like(d["x"]))
    graph.replay()
    torch.cuda.synchronize()
    assert_close(out, reference(d), 8, exact_fraction=0.9)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,e,k,renorm", [(1, 256, 8, True), (3, 60, 4, True), (17, 8, 2, False), (2, 128, 1, True)])
def test_router_topk_kernel_equals_reference(t, e, k, renorm, dtype):
    """Softmax, top-k and renormalisation in one launch: the reference's experts in its order, weights
    within an ulp of the activation dtype. Distinct logits (a shuffled grid of k/16, exact in bf16):
    at a tie torch.topk keeps an order of its own (the test below fixes ours)."""
    g = torch.Generator().manual_seed(t * e + k)
    grid = torch.stack([torch.randperm(e, generator=g) for _ in range(t)]).float() - e / 2
    logits = (grid / 16).to(device=DEVICE, dtype=dtype)
    want_w, want_i = REF.router_topk(logits, k, renorm)
    got_w, got_i = moe_router.router_topk(logits, k, renorm)
    assert got_i.dtype == torch.long and got_w.dtype == dtype
    assert torch.equal(got_i, want_i)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-6
    assert (got_w.float() - want_w.float()).abs().max() <= ulp * want_w.float().abs().max()


@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (3, 60, 4)])
def test_scaled_topk_kernel_equals_reference(t, e, k):
    """Gemma 4's router after its projection: the reference's experts in its order, f32 weights times
    each chosen expert's scale, within f32 rounding (distinct logits as above)."""
    g = torch.Generator().manual_seed(t * e + k)
    grid = torch.stack([torch.randperm(e, generator=g) for _ in range(t)]).float() - e / 2
    logits = (grid / 16).to(device=DEVICE, dtype=torch.bfloat16)
    scale = (torch.rand(e, generator=g) + 0.5).to(device=DEVICE, dtype=torch.bfloat16)
    want_w, want_i = REF.scaled_topk(logits, scale, k)
    got_w, got_i = moe_router.scaled_topk(logits, scale, k)
    assert got_w.dtype == want_w.dtype == torch.float32 and torch.equal(got_i, want_i)
    assert (got_w - want_w).abs().max() <= 1e-6 * want_w.abs().max()


def shuffled_grid(e: int, h: int, g) -> torch.Tensor:
    """A router projection [E, H] whose every column is a shuffled grid of 1/16: distinct logits."""
    grid = torch.stack([torch.randperm(e, generator=g) for _ in range(h)], dim=1).float() - e / 2
    return (grid / 16).to(device=DEVICE, dtype=torch.bfloat16)


def one_hot_rows(t: int, h: int, g) -> torch.Tensor:
    """Rows of x with a single 1: each logit is one weight of the projection, exact in any order."""
    x = torch.zeros(t, h, dtype=torch.bfloat16)
    x[torch.arange(t), torch.randint(0, h, (t,), generator=g)] = 1.0
    return x.to(DEVICE)


@pytest.mark.parametrize("t,e,h,k", [(1, 128, 2816, 8), (2, 60, 200, 4), (1, 8, 48, 2)])
def test_router_scaled_topk_fused_equals_reference(t, e, h, k):
    """Gemma 4's router projection and top-k in one launch, the last program doing the top-k: each
    row of x one-hot, so every logit is one weight, exact whatever the summation order and distinct
    (a shuffled grid of 1/16). Run twice with other rows: the arrival counter resets itself."""
    g = torch.Generator().manual_seed(t * e + h)
    proj = shuffled_grid(e, h, g)
    scale = (torch.rand(e, generator=g) + 0.5).to(device=DEVICE, dtype=torch.bfloat16)
    for _ in range(2):
        x = one_hot_rows(t, h, g)
        want_w, want_i = REF.router_scaled_topk(x, proj, scale, k)
        assert moe_router.fused_supports(x, proj, scale, k)
        got_w, got_i = moe_router.router_scaled_topk(x, proj, scale, k)
        assert got_w.dtype == want_w.dtype == torch.float32 and torch.equal(got_i, want_i)
        assert (got_w - want_w).abs().max() <= 1e-6 * want_w.abs().max()


@pytest.mark.parametrize("t,e,h,k,renorm", [(1, 256, 2048, 8, True), (2, 60, 200, 4, False), (1, 8, 48, 2, True)])
def test_router_linear_topk_fused_equals_reference(t, e, h, k, renorm):
    """Qwen's router projection and top-k in one launch: the reference's experts in its order, weights
    in x's dtype within an ulp, as router_kernel's (its softmax sums in another order than torch's).
    One-hot rows: every logit is one weight, exact and distinct. Run twice with other rows: the
    arrival counter resets itself."""
    g = torch.Generator().manual_seed(t * e + h + k)
    proj = shuffled_grid(e, h, g)
    for _ in range(2):
        x = one_hot_rows(t, h, g)
        want_w, want_i = REF.router_linear_topk(x, proj, k, renorm)
        assert moe_router.fused_supports(x, proj, None, k)
        got_w, got_i = moe_router.router_linear_topk(x, proj, k, renorm)
        assert got_w.dtype == want_w.dtype == torch.bfloat16
        assert torch.equal(got_i, want_i)
        assert (got_w.float() - want_w.float()).abs().max() <= 2.0 ** -7 * want_w.float().abs().max()


@pytest.mark.gpu
@gpu
def test_gpu_router_scaled_topk_fused_in_a_cuda_graph():
    """Gemma 4 26B-A4B's router shape, captured once and replayed with new rows: the arrival counter
    resets itself inside the graph, and each replay gives the reference's experts for its rows."""
    e, h, k = 128, 2816, 8
    g = torch.Generator().manual_seed(5)
    proj = shuffled_grid(e, h, g)
    scale = (torch.rand(e, generator=g) + 0.5).to(device=DEVICE, dtype=torch.bfloat16)
    x = torch.zeros(1, h, dtype=torch.bfloat16, device=DEVICE)
    graph, (w, idx) = captured(lambda: moe_router.router_scaled_topk(x, proj, scale, k))
    for col in (7, 2000, 2815):
        x.zero_()
        x[0, col] = 1.0
        graph.replay()
        torch.cuda.synchronize()
        want_w, want_i = REF.router_scaled_topk(x, proj, scale, k)
        assert torch.equal(idx, want_i) and (w - want_w).abs().max() <= 1e-6 * want_w.abs().max()


def test_router_topk_ties_go_to_the_lower_expert():
    logits = torch.zeros(1, 16, device=DEVICE)
    logits[0, [3, 9, 12]] = 1.0
    w, idx = moe_router.router_topk(logits, 4)
    assert idx[0].tolist()[:3] == [3, 9, 12] and idx[0, 3] == 0
    assert torch.allclose(w.sum(), torch.tensor(1.0, device=DEVICE))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,h", [(1, 64), (3, 48), (5, 300)])
def test_shared_gate_add_equals_reference(t, h, dtype):
    """routed + sigmoid(x . g) * shared with the reference's roundings; the gate's dot is summed in
    another order than the reference's linear, so a bf16 logit may land one ulp away: tolerance of
    one ulp of the output."""
    g = torch.Generator().manual_seed(t * h)
    rnd = lambda *s: torch.randn(*s, generator=g).to(device=DEVICE, dtype=dtype)  # noqa: E731
    routed, x, shared, gate_w = rnd(t, h), rnd(t, h), rnd(t, h), rnd(1, h) * h ** -0.5
    want = REF.shared_gate_add(routed, x, gate_w, shared)
    got = moe_kernels.shared_gate_add(routed, x, gate_w, shared)
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
    assert got.dtype == dtype and (got.float() - want.float()).abs().max() <= ulp * want.float().abs().max()


def test_cuda_ops_route_router_and_shared_gate_to_the_kernels(monkeypatch):
    from kiln.backends.cuda import CudaOps

    ops, calls = CudaOps(DEVICE), []
    monkeypatch.setattr(moe_router, "router_topk", lambda *a: calls.append("router") or REF.router_topk(*a))
    monkeypatch.setattr(moe_kernels, "shared_gate_add", lambda *a: calls.append("gate") or REF.shared_gate_add(*a))
    x = torch.randn(2, 32, device=DEVICE, dtype=torch.bfloat16)
    ops.router_topk(torch.randn(2, 64, device=DEVICE, dtype=torch.bfloat16), 4)
    ops.shared_gate_add(x, x, x[:1], x)
    assert calls == ["router", "gate"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("t", [1, 512])
def test_gpu_router_and_shared_gate_at_qwen35_35b_shapes(t):
    """Qwen3.5-35B-A3B: 256 experts, top 8, hidden 2048; distinct router logits (see above)."""
    g = torch.Generator().manual_seed(t)
    grid = torch.stack([torch.randperm(256, generator=g) for _ in range(t)]).float() - 128
    logits = (grid / 16).to(device=DEVICE, dtype=torch.bfloat16)
    want_w, want_i = REF.router_topk(logits, 8)
    got_w, got_i = moe_router.router_topk(logits, 8)
    assert torch.equal(got_i, want_i)
    assert (got_w.float() - want_w.float()).abs().max() <= 2.0 ** -7 * want_w.float().abs().max()
    rnd = lambda *s: torch.randn(*s, generator=g).to(device=DEVICE, dtype=torch.bfloat16)  # noqa: E731
    routed, x, shared, gate_w = rnd(t, 2048), rnd(t, 2048), rnd(t, 2048), rnd(1, 2048) * 2048 ** -0.5
    want = REF.shared_gate_add(routed, x, gate_w, shared).float()
    got = moe_kernels.shared_gate_add(routed, x, gate_w, shared).float()
    assert (got - want).abs().max() <= 2.0 ** -7 * want.abs().max()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,k,h,i,act", CASES[:3])
def test_moe_experts_gated_equals_reference(t, k, h, i, act, dtype):
    """The combine with the shared expert's sigmoid gate added (one launch instead of two) against
    ReferenceOps.moe_experts_gated, for the gemv and a grouped form; the gate's dot is summed in another
    order than the reference's linear, so one ulp of the output is allowed, as for gate_add."""
    d = inputs(t, k, h, i, act, dtype)
    g = torch.Generator().manual_seed(t * h)
    shared = torch.randn(t, h, generator=g).to(device=DEVICE, dtype=dtype)
    gate_w = (torch.randn(1, h, generator=g) * h ** -0.5).to(device=DEVICE, dtype=dtype)
    args = (d["x"], d["idx"], d["weights"], d["gate_up"], d["down"], act)
    want = REF.moe_experts_gated(*args, gate_w, shared).float()
    for form in (moe_kernels.gemv_variant(64, 64, 4), moe_kernels.grouped_variant(32, 32, 64, 4, 1), FORMS[-1]):
        got = moe_kernels.moe_experts(*args, v=form, gate=(gate_w, shared)).float()
        ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 1e-5
        assert (got - want).abs().max() <= ulp * want.abs().max(), form.name


def test_cuda_ops_fuse_the_shared_gate_into_the_combine(monkeypatch):
    from kiln.backends.cuda import CudaOps

    ops, seen = CudaOps(DEVICE), []
    real = moe_kernels.moe_experts
    monkeypatch.setattr(moe_kernels, "moe_experts",
                        lambda *a, **kw: seen.append(kw.get("gate") is not None) or real(*a, **kw))
    d = inputs(2, 2, 64, 32, "silu", torch.bfloat16)
    x = d["x"]
    ops.moe_experts_gated(x, d["idx"], d["weights"], d["gate_up"], d["down"], "silu", x[:1], x)
    assert seen == [True]


def test_quantised_router_and_gate_run_dense_on_the_fused_kernels(monkeypatch):
    """mlx-lm keeps Qwen's router and shared-expert gate (and Gemma 4's router) at 8 bits: at decode
    the cuda backend runs them as their dequantised weights (made once, kept), so the router is one
    launch and the gate goes into the routed experts' combine, as a 16-bit model's do; the values are
    the reference's on the dequantised weights (the reference dequantises the same way)."""
    from kiln.backends.cuda import CudaOps
    from kiln.ops.quant import cuda as quant_cuda
    from kiln.ops.quant.reference import quantize
    from kiln.weights.quantized import dequantize

    ops, fused, gated = CudaOps(DEVICE), [], []
    real_router, real_quant_moe = moe_router.router_linear_topk, quant_cuda.quant_moe
    monkeypatch.setattr(moe_router, "router_linear_topk", lambda *a, **kw: fused.append(1) or real_router(*a, **kw))
    monkeypatch.setattr("kiln.ops.moe.cuda.quant_moe",
                        lambda *a, **kw: gated.append(len(a) > 7 and a[7] is not None) or real_quant_moe(*a, **kw))
    g = torch.Generator().manual_seed(11)
    h, e, i, k, dt = 64, 8, 32, 2, torch.bfloat16
    proj = quantize(shuffled_grid(e, h, g).cpu(), 8, 32).to(DEVICE)   # distinct logits (error << the 1/16 grid)
    gate_w = quantize((torch.randn(1, h, generator=g) * h ** -0.5).to(dt), 8, 32).to(DEVICE)
    gate_up = quantize((torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(dt), 4, 32).to(DEVICE)
    down = quantize((torch.randn(e, h, i, generator=g) * i ** -0.5).to(dt), 4, 32).to(DEVICE)
    x, shared = one_hot_rows(1, h, g), torch.randn(1, h, generator=g).to(device=DEVICE, dtype=dt)   # x: exact logits
    weights, idx = ops.router_linear_topk(x, proj, k)
    want_w, want_i = REF.router_linear_topk(x, dequantize(proj), k)
    assert fused == [1] and torch.equal(idx, want_i)        # weights within an ulp, as the fused router's test
    assert (weights.float() - want_w.float()).abs().max() <= 2.0 ** -7 * want_w.float().abs().max()
    assert ops._dense(proj) is ops._dense(proj)              # made once
    got = ops.moe_experts_gated(x, idx, weights, gate_up, down, "silu", gate_w, shared)
    assert gated == [True]                                   # the gate inside the quantised experts' combine
    want = REF.moe_experts_gated(x, idx, weights, gate_up, down, "silu", gate_w, shared)
    assert (got.float() - want.float()).abs().max() <= 2.0 ** -7 * want.float().abs().max()


@pytest.mark.parametrize("gated", [False, True])
def test_quantised_stacks_too_large_for_their_copies_run_in_batches_of_experts(monkeypatch, gated):
    """A prefill chunk on quantised stacks whose dequantised copies do not fit (the 397B's 12.9 GB a
    layer) and that the packed kernels do not take (3-bit down: its values cross words;
    tests/ops/test_quant_grouped.py has the packed path) takes the experts in batches that do (here 3
    of 8): each batch's pairs through the grouped kernels, then one combine (experts added in id order
    either way): the whole stacks' values, within the tile forms' rounding."""
    from kiln.backends.cuda import CudaOps
    from kiln.ops.quant import cuda as quant_cuda
    from kiln.ops.quant.reference import quantize

    ops = CudaOps(DEVICE)
    g = torch.Generator().manual_seed(5)
    h, e, i, k, t, dt = 64, 8, 32, 2, 9, torch.bfloat16
    gate_up = quantize((torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(dt), 4, 32).to(DEVICE)
    down = quantize((torch.randn(e, h, i, generator=g) * i ** -0.5).to(dt), 3, 32).to(DEVICE)
    x = torch.randn(t, h, generator=g).to(device=DEVICE, dtype=dt)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).to(DEVICE)
    weights = torch.rand(t, k, generator=g).to(device=DEVICE, dtype=dt)
    shared = torch.randn(t, h, generator=g).to(device=DEVICE, dtype=dt) if gated else None
    gate_w = x[:1].clone() if gated else None

    def experts():
        if gated:
            return ops.moe_experts_gated(x, idx, weights, gate_up, down, "silu", gate_w, shared)
        return ops.moe_experts(x, idx, weights, gate_up, down, "silu")

    whole = experts()                                        # off the GPU there is no limit: whole stacks
    cuts, alive, real = [], [], quant_cuda.dequantised_stacks
    room = 3 * quant_cuda.expert_bytes(gate_up, down)
    for mod in ("kiln.ops.quant.cuda", "kiln.ops.moe.cuda"):
        monkeypatch.setattr(f"{mod}.stack_room", lambda x: room)

    def dequantised(*a, **kw):
        alive.append(sum(r() is not None for r in refs))     # earlier batches' copies still held
        cuts.append((kw.get("first"), kw.get("last")))
        stacks = real(*a, **kw)
        refs.extend(weakref.ref(t) for t in stacks)
        return stacks

    refs = []
    monkeypatch.setattr("kiln.ops.moe.cuda.dequantised_stacks", dequantised)
    batched = experts()
    # room for 3 copies: batches of 2 (a power of two: the kernels' expert count is a constant), never the whole
    assert set(cuts) <= {(0, 2), (2, 4), (4, 6), (6, 8)} and len(cuts) >= 2, cuts
    assert alive == [0] * len(cuts)      # one batch's copies at a time: the room is not taken twice
    # a batch's few pairs may take another tile form than the chunk's (another order of the K sums)
    assert_close(batched, whole, k + gated, exact_fraction=0.9)
    want = (REF.moe_experts_gated(x, idx, weights, gate_up, down, "silu", gate_w, shared) if gated
            else REF.moe_experts(x, idx, weights, gate_up, down, "silu"))
    assert (batched.float() - want.float()).abs().max() <= 2.0 ** -7 * want.float().abs().max()


def test_the_reference_slot_pairs_and_combine_are_its_moe_experts():
    """The reference's slot_pairs (each pair's weighted output into a per-pair buffer, experts read
    from their slots) and moe_combine (added per token in expert id order): its moe_experts, bit for
    bit (the same products, added in the same order), plain and gated."""
    d = inputs(9, 2, 48, 40, "silu", torch.bfloat16, seed=4)
    x, idx, w = d["x"], d["idx"], d["weights"]
    order = torch.randperm(8, generator=torch.Generator().manual_seed(0)).tolist()   # slot s holds expert order[s]
    gu, dn = d["gate_up"][order], d["down"][order]
    where = {e: s for s, e in enumerate(order)}
    y = x.new_zeros((idx.numel(), x.shape[1]))
    for batch in ([e for e in range(8) if e % 2], [e for e in range(8) if not e % 2]):
        REF.slot_pairs(x, idx, w, {e: where[e] for e in batch}, gu, dn, "silu", y)
    assert not REF.pairs_apply(x, gu, dn, "silu")
    assert torch.equal(REF.moe_combine(y, idx, x), reference(d))
    gate = (x[:1].clone(), torch.randn_like(x))
    assert torch.equal(REF.moe_combine(y, idx, x, gate),
                       REF.moe_experts_gated(x, idx, w, d["gate_up"], d["down"], "silu", *gate))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_stack_room_counts_torchs_cached_blocks_as_free(monkeypatch):
    """A batch's copies freed into torch's cache leave the next batch the same room (else each batch
    asked for other sizes and the allocator went back to the driver), and KILN_STACK_ROOM_GB caps it."""
    from kiln.ops.quant.cuda import stack_room

    x = torch.empty(4, device="cuda")
    torch.cuda.empty_cache()
    before = stack_room(x)
    block = torch.empty(min(before, 4 << 30), dtype=torch.uint8, device="cuda")
    del block                                   # freed into torch's cache, not to the driver
    assert abs(stack_room(x) - before) < 64 << 20
    monkeypatch.setenv("KILN_STACK_ROOM_GB", "1.5")
    assert stack_room(x) == min(before, 1_500_000_000)


def test_the_stack_room_is_unlimited_off_the_gpu_unless_capped(monkeypatch):
    from kiln.ops.quant.cuda import stack_room

    x = torch.empty(4)
    assert stack_room(x) is None
    monkeypatch.setenv("KILN_STACK_ROOM_GB", "0.25")
    assert stack_room(x) == 250_000_000


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_batched_experts_refuse_a_graph_capture_with_a_reason(monkeypatch):
    """Experts dequantised in batches sync the host (which pairs each batch holds): inside a CUDA graph
    capture they raise a KilnError saying so, before any illegal call, so the prefill graphs fall back
    to eager with that reason (not a CUDA error)."""
    from kiln.backends.cuda import CudaOps
    from kiln.errors import KilnError
    from kiln.ops.quant import cuda as quant_cuda
    from kiln.ops.quant.reference import quantize

    ops = CudaOps(torch.device("cuda"))
    g = torch.Generator().manual_seed(1)
    h, e, i, k, t, dt = 64, 8, 32, 2, 9, torch.bfloat16
    gate_up = quantize((torch.randn(e, 2 * i, h, generator=g) * h ** -0.5).to(dt), 4, 32).to("cuda")
    down = quantize((torch.randn(e, h, i, generator=g) * i ** -0.5).to(dt), 4, 32).to("cuda")
    x = torch.randn(t, h, generator=g).to(device="cuda", dtype=dt)
    idx = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)]).cuda()
    weights = torch.rand(t, k, generator=g).to(device="cuda", dtype=dt)
    room = 3 * quant_cuda.expert_bytes(gate_up, down)
    for mod in ("kiln.ops.quant.cuda", "kiln.ops.moe.cuda"):
        monkeypatch.setattr(f"{mod}.stack_room", lambda x: room)
    ops.moe_experts(x, idx, weights, gate_up, down, "silu")       # eager: the batches run
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(KilnError, match="batches wait for the host"):
        with torch.cuda.graph(graph):
            ops.moe_experts(x, idx, weights, gate_up, down, "silu")
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_dense_router_copy_is_done_before_the_fused_router_reads_it(monkeypatch):
    """The fused router loads its weight before its PDL wait (weights are never written); the dense
    copy of a quantised router is written by the kernel just before, the first time: _dense waits for
    it once, not at every call."""
    from kiln.backends.cuda import CudaOps
    from kiln.ops.quant.reference import quantize

    ops, waits = CudaOps(DEVICE), []
    real = torch.cuda.Stream.synchronize
    monkeypatch.setattr(torch.cuda.Stream, "synchronize", lambda self: (waits.append(1), real(self))[1])
    proj = quantize(torch.randn(16, 64), 8, 32).to(DEVICE)
    assert ops._dense(proj) is ops._dense(proj)
    assert len(waits) == 1
