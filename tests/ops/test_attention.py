"""The attention kernels (prefill flash attention, split-KV decode) equal ReferenceOps.attention on
small shapes under Triton's interpreter on CPU (ragged chunks, cached prefixes, sliding windows,
softcap, GQA groups of 2 and 3), every variant passes the tuner's gate, and on a GPU every variant
of the catalogue equals the reference at the real models' shapes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.backends.reference import ReferenceOps  # noqa: E402
from kiln.cache import KVCache  # noqa: E402
from kiln.ops.attention import kernels as attention_kernels  # noqa: E402
from kiln.tune import cache as tune_cache  # noqa: E402
from kiln.tune.device import device_info  # noqa: E402
from kiln.tune.registry import extra_variant, variant  # noqa: E402
from kiln.tune.tuner import Tuner, Workload  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
REF = ReferenceOps(DEVICE)
DTYPES = [torch.float32, torch.bfloat16]


def filled_cache(t, q_start, h, kv, d, dtype, seed=0, q_scale=1.0):
    """q [t, h, d] (a strided view, as Qwen3.5's q/gate split), the chunk's k/v, and a KVCache
    holding a random prefix of q_start positions (its capacity grows by doubling: spare rows)."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(t, h, 2 * d, generator=g) * q_scale).to(dtype=dtype, device=DEVICE)[..., :d]
    k, v, kp, vp = (torch.randn(n, kv, d, generator=g).to(dtype=dtype, device=DEVICE) for n in (t, t, q_start, q_start))
    cache = KVCache(kv, d, dtype, DEVICE, capacity=8)
    if q_start:
        cache.update(kp, vp, torch.arange(q_start, device=DEVICE))
    return q, k, v, cache


def reference(q, k, v, cache, q_start, window, softcap):
    """ReferenceOps.attention appends the chunk to the cache: afterwards cache.k/v are the buffers."""
    positions = q_start + torch.arange(q.shape[0], device=DEVICE)
    return REF.attention(q, k, v, cache, positions, q.shape[-1] ** -0.5, window, softcap)


def assert_attention_close(got: torch.Tensor, want: torch.Tensor):
    """f32: summation order only. bf16: the online softmax rounds exp(s - m_running) instead of
    HF's normalised probabilities (module docstring), a relative error of 2^-9 per probability,
    so an output differs by about one bf16 ulp of its row's largest value; 2 ulps (2 eps x row max)
    bound every element, and the mean error stays under 3/4 ulp of the mean value (measured: about
    1/4 to 1/3; unrounded scores, a contract breach, give about 4x more)."""
    assert got.dtype == want.dtype and got.shape == want.shape and got.is_contiguous()
    assert not torch.isnan(got).any()
    err = (got.float() - want.float()).abs()
    if want.dtype == torch.float32:
        assert err.max().item() <= 1e-5 * want.abs().max().item() + 1e-6, err.max().item()
        return
    eps = torch.finfo(want.dtype).eps
    row_max = want.float().abs().amax(dim=-1, keepdim=True)
    assert (err <= 2 * eps * row_max + 1e-6).all(), f"{(err / (eps * row_max)).max().item():.2f} eps x row max"
    assert err.mean().item() <= 0.75 * eps * want.float().abs().mean().item()


# (T, q_start, H, KV, D, window, softcap): one token, ragged chunks, chunks past a cached prefix,
# windows narrower than a key block and wide enough for unmasked blocks inside them, softcap,
# GQA group 3 (SmolLM2) and no GQA.
PREFILL_CASES = [(1, 0, 4, 2, 32, None, None), (5, 13, 4, 2, 64, 8, 30.0), (37, 13, 4, 2, 32, None, None),
                 (64, 64, 4, 2, 16, 8, None), (70, 0, 4, 2, 32, None, 30.0), (70, 64, 4, 2, 64, None, None),
                 (37, 13, 6, 2, 32, 8, None), (20, 5, 2, 2, 16, None, None), (70, 64, 4, 2, 16, 40, None)]
PREFILL_FORMS = [attention_kernels.scalar_variant(16, 16), attention_kernels.tile_variant(64, 32, 4, 1),
                 attention_kernels.tile_variant(32, 16, 4, 1, pack=True)]


def case_id(c):
    return "x".join(str(x) for x in c)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", PREFILL_CASES, ids=case_id)
def test_prefill_attention_equals_reference(case, dtype):
    t, q_start, h, kv, d, window, softcap = case
    # softcap: scores of tens, where tanh bends them
    q, k, v, cache = filled_cache(t, q_start, h, kv, d, dtype, q_scale=10.0 if softcap else 1.0)
    want = reference(q, k, v, cache, q_start, window, softcap)
    for form in PREFILL_FORMS:
        got = attention_kernels.prefill_attention(q, cache.k, cache.v, q_start, q_start + t, d ** -0.5, window, softcap,
                                                  form)
        assert_attention_close(got, want)


# (pos, H, KV, D, window, softcap): the first position, splits past pos (capacity doubled),
# windows inside and across splits, softcap, GQA group 3 and 4.
DECODE_CASES = [(0, 4, 2, 32, None, None), (100, 4, 2, 32, None, None), (77, 8, 2, 16, 8, None),
                (200, 4, 1, 64, 40, 30.0), (150, 6, 2, 32, None, None)]
DECODE_FORMS = [attention_kernels.decode_trusted_variant(16), attention_kernels.decode_variant(32, 16, 4),
                attention_kernels.decode_variant(64, 32, 4)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", DECODE_CASES, ids=case_id)
def test_decode_attention_equals_reference(case, dtype):
    pos, h, kv, d, window, softcap = case
    q, k, v, cache = filled_cache(1, pos, h, kv, d, dtype, seed=1, q_scale=10.0 if softcap else 1.0)
    want = reference(q, k, v, cache, pos, window, softcap)
    assert cache.k.shape[0] > pos + 1 or pos == 0
    p = torch.tensor([pos], dtype=torch.int64, device=DEVICE)
    for form in DECODE_FORMS:
        got = attention_kernels.decode_attention(q, cache.k, cache.v, p, d ** -0.5, window, softcap, form)
        assert_attention_close(got, want)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_decode_attention_with_a_gate_equals_act_mul_after_it(dtype):
    """Qwen3.5's output gate in the combine kernel: sigmoid(gate) * o rounded exactly as act_mul on
    the kernel's own o (the gate a strided view beside q, as the model splits them)."""
    from kiln.ops.gemm import activation

    pos, h, kv, d = 100, 4, 2, 32
    q, _, _, cache = filled_cache(1, pos + 1, h, kv, d, dtype, seed=3)
    qg = (torch.randn(1, h, 2 * d, generator=torch.Generator().manual_seed(4)) * 3).to(dtype=dtype, device=DEVICE)
    q, gate = qg.chunk(2, dim=-1)
    assert attention_kernels.gate_ok(q, gate) and not gate.is_contiguous()
    p = torch.tensor([pos], dtype=torch.int64, device=DEVICE)
    for form in DECODE_FORMS:
        plain = attention_kernels.decode_attention(q, cache.k, cache.v, p, d ** -0.5, None, None, form)
        gated = attention_kernels.decode_attention(q, cache.k, cache.v, p, d ** -0.5, None, None, form, gate=gate)
        assert torch.equal(gated, activation.act_mul(gate, plain, "sigmoid")), form.name


def test_default_variants_and_supports():
    q, k, v, cache = filled_cache(9, 7, 4, 2, 16, torch.float32)
    want = reference(q, k, v, cache, 7, None, None)
    assert_attention_close(attention_kernels.prefill_attention(q, cache.k, cache.v, 7, 16, 0.25, None, None), want)
    q1 = q[-1:]
    want1 = reference(q1, k[-1:], v[-1:], cache, 16, None, None)
    p = torch.tensor([16], dtype=torch.int64, device=DEVICE)
    assert_attention_close(attention_kernels.decode_attention(q1, cache.k, cache.v, p, 0.25, None, None), want1)
    assert attention_kernels.supports(q, cache.k) and attention_kernels.supports(q1, cache.k, cache.v)
    assert attention_kernels.PREFILL_OP.supports(q, cache.k, cache.v)
    assert attention_kernels.DECODE_OP.supports(q1, cache.k, cache.v)
    assert not attention_kernels.DECODE_OP.supports(q, cache.k, cache.v)                    # decode takes one query
    assert not attention_kernels.PREFILL_OP.supports(q[..., :12], cache.k[..., :12], cache.v[..., :12])   # head_dim 12


def test_cuda_ops_attention_runs_the_kernels():
    """CudaOps.attention: a prefill chunk, then decode steps at device-side positions."""
    from kiln.backends.cuda import CudaOps

    ops, dtype = CudaOps(DEVICE), torch.bfloat16
    q, k, v, _ = filled_cache(12, 0, 4, 2, 16, dtype, seed=4)
    ref_cache, cuda_cache = KVCache(2, 16, dtype, DEVICE, capacity=8), KVCache(2, 16, dtype, DEVICE, capacity=8)
    for lo, hi in ((0, 10), (10, 11), (11, 12)):
        pos = torch.arange(lo, hi, device=DEVICE)
        want = REF.attention(q[lo:hi], k[lo:hi], v[lo:hi], ref_cache, pos, 0.25, 8, None)
        assert_attention_close(ops.attention(q[lo:hi], k[lo:hi], v[lo:hi], cuda_cache, pos, 0.25, 8, None), want)


def wrong_window(inputs, outputs, plan):
    """Attends to the whole prefix: right without a window, wrong with one."""
    i = inputs
    form = attention_kernels.tile_variant(*attention_kernels.CPU_TILES[0])
    attention_kernels.run_prefill(i["q"], i["k_buf"], i["v_buf"], i["q_start"], i["kv_len"], i["scale"], None,
                                  i["softcap"], form, outputs["o"])


def test_tuner_gates_and_picks_every_attention_candidate(tmp_path):
    """Every candidate of both ops passes the gate against the trusted scalar forms; a planted
    wrong one does not."""
    lines: list[str] = []
    works = [Workload(attention_kernels.PREFILL_OP,
                      attention_kernels.PrefillShape(40, 4, 2, 16, window=8, kv_prefix=16)),
             Workload(attention_kernels.DECODE_OP, attention_kernels.DecodeShape(100, 4, 2, 32, softcap=30.0))]
    tuner = Tuner(DEVICE, torch.float32 if DEVICE.type == "cpu" else torch.bfloat16, log=lines.append, reps=1,
                  cache=tune_cache.TuneCache(tmp_path / "tune", warn=lines.append))
    bad = variant("wrong_window", run=wrong_window)
    with extra_variant("attention", bad):
        plan, report = tuner.tune(works)
    never = [line for line in lines if "never picked" in line]
    assert len(never) == 1 and "wrong_window" in never[0], lines
    for w in works:
        assert plan.choose(w.op, w.shape).name != "wrong_window"
        timed = next(line for line in lines if line.startswith(f"[autotune] {w.label}:") and " -> " in line)
        names = {v.name for v in w.op.candidates(w.shape, tuner.dev)} | {w.op.trusted(w.shape, tuner.dev).name}
        assert all(f"{n} " in timed or f"{n}* " in timed for n in names), timed


# -- on the GPU: every variant of the catalogue at the real models' shapes --------------------------------

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# (name, H, KV, D, window)
# the 122B's and 397B's group of 16 query heads a KV head: the trusted decode form with 1-4 keys a
# step computed wrong values there on the H200 (bench/NOTES.md, 2026-12-02)
MODELS = [("qwen3.5-0.8b", 8, 2, 256, None), ("qwen3.5-9b", 16, 4, 256, None), ("gemma4-full", 16, 2, 512, None),
          ("gemma4-sliding", 16, 8, 256, 1024), ("smollm2", 9, 3, 64, None), ("qwen3.5-122b-a10b", 32, 2, 256, None)]


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("q_start", [0, 1024])
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m[0])
def test_gpu_prefill_variants_equal_reference(model, q_start):
    _, h, kv, d, window = model
    q, k, v, cache = filled_cache(512, q_start, h, kv, d, torch.bfloat16)
    want = reference(q, k, v, cache, q_start, window, None)
    dev = device_info(DEVICE)
    shape = attention_kernels.PrefillShape(512, h, kv, d, window)
    for form in attention_kernels.PREFILL_OP.catalogue(shape, dev) + [attention_kernels.PREFILL_OP.trusted(shape, dev)]:
        got = attention_kernels.prefill_attention(q, cache.k, cache.v, q_start, q_start + 512, d ** -0.5, window, None,
                                                  form)
        assert_attention_close(got, want)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("pos", [100, 5000])
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m[0])
def test_gpu_decode_variants_equal_reference(model, pos):
    _, h, kv, d, window = model
    q, k, v, cache = filled_cache(1, pos, h, kv, d, torch.bfloat16, seed=2)
    want = reference(q, k, v, cache, pos, window, None)
    dev = device_info(DEVICE)
    shape = attention_kernels.DecodeShape(pos + 1, h, kv, d, window)
    p = torch.tensor([pos], dtype=torch.int64, device=DEVICE)
    for form in attention_kernels.DECODE_OP.catalogue(shape, dev) + [attention_kernels.DECODE_OP.trusted(shape, dev)]:
        got = attention_kernels.decode_attention(q, cache.k, cache.v, p, d ** -0.5, window, None, form)
        assert_attention_close(got, want)


@pytest.mark.gpu
@gpu
def test_gpu_decode_replays_in_a_cuda_graph_at_new_positions():
    """Captured once, replayed after the position tensor changes: the kernels read pos themselves."""
    h, kv, d = 16, 4, 256
    q, k, v, cache = filled_cache(1, 3000, h, kv, d, torch.bfloat16, seed=3)
    reference(q, k, v, cache, 3000, None, None)          # fills cache.k/v with 3001 positions
    pos = torch.tensor([100], dtype=torch.int64, device=DEVICE)
    form = attention_kernels.decode_variant(256, 64, 4)
    attention_kernels.decode_attention(q, cache.k, cache.v, pos, d ** -0.5, None, None, form)   # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = attention_kernels.decode_attention(q, cache.k, cache.v, pos, d ** -0.5, None, None, form)
    for p in (100, 2999, 7):
        pos.fill_(p)
        graph.replay()
        keys = KVCache(kv, d, torch.bfloat16, DEVICE)
        keys.update(cache.k[:p], cache.v[:p], torch.arange(p, device=DEVICE))
        want = reference(q, cache.k[p:p + 1], cache.v[p:p + 1], keys, p, None, None)
        assert_attention_close(out, want)


def ring_of(buf: torch.Tensor, length: int, ring: int) -> torch.Tensor:
    """A ring of `ring` rows holding buf's positions 0..length-1 as a WindowKVCache does: position p at
    row p % ring, the later position where two share a row (rows never written: zeros)."""
    out = torch.zeros((ring, *buf.shape[1:]), dtype=buf.dtype, device=buf.device)
    for p in range(length):
        out[p % ring] = buf[p]
    return out


# (T, q_start, window, ring rows): a chunk past a wrapped ring (ring = window - 1 + T, the fewest it
# may hold), a chunk whose keys straddle the wrap, one query far past it, a window narrower than a block.
RING_CASES = [(40, 150, 25, 64), (17, 50, 24, 64), (1, 211, 24, 64), (9, 300, 8, 32)]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", RING_CASES, ids=case_id)
def test_a_ring_of_the_window_gives_the_plain_buffers_bits(case, dtype):
    """The same keys in a ring (kiln.cache.WindowKVCache) give the plain buffer's outputs bit for bit:
    the kernels read the same values in the same order, their pointers shifted by each key block's
    wrap. The ring's rows of positions before the window hold later keys, which the mask must skip."""
    t, q_start, window, ring = case
    h, kv, d = 4, 2, 32
    q, k, v, cache = filled_cache(t, q_start, h, kv, d, dtype, seed=2)
    reference(q, k, v, cache, q_start, window, None)    # appends the chunk: cache.k/v hold 0..q_start+t-1
    n = q_start + t
    rk, rv = ring_of(cache.k, n, ring), ring_of(cache.v, n, ring)
    scale = d ** -0.5
    if t == 1:
        pos = torch.tensor([q_start], dtype=torch.int64, device=DEVICE)
        for form in DECODE_FORMS[1:]:
            want = attention_kernels.decode_attention(q, cache.k, cache.v, pos, scale, window, None, form)
            got = attention_kernels.decode_attention(q, rk, rv, pos, scale, window, None, form, ring=ring,
                                                     span=cache.k.shape[0])
            assert torch.equal(got, want), form.name
        return
    for form in PREFILL_FORMS:
        want = attention_kernels.prefill_attention(q, cache.k, cache.v, q_start, n, scale, window, None, form)
        got = attention_kernels.prefill_attention(q, rk, rv, q_start, n, scale, window, None, form, ring=ring)
        assert torch.equal(got, want), form.name
    # a decode step at the chunk's last position, too
    pos = torch.tensor([n - 1], dtype=torch.int64, device=DEVICE)
    for form in DECODE_FORMS[1:]:
        want = attention_kernels.decode_attention(q[-1:], cache.k, cache.v, pos, scale, window, None, form)
        got = attention_kernels.decode_attention(q[-1:], rk, rv, pos, scale, window, None, form, ring=ring,
                                                 span=cache.k.shape[0])
        assert torch.equal(got, want), form.name


def test_a_ring_the_key_blocks_straddle_is_refused():
    q, k, v, cache = filled_cache(4, 20, 4, 2, 32, torch.float32)
    with pytest.raises(AssertionError, match="does not take key blocks"):
        attention_kernels.prefill_attention(q, cache.k, cache.v, 20, 24, 1.0, 8, None,
                                            attention_kernels.tile_variant(64, 32, 4, 1), ring=48)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("q_start", [3000, 5000])
def test_gpu_a_ring_gives_the_plain_buffers_bits_for_every_variant(q_start):
    """Gemma 4's sliding layers at their ring (window 1,024 and a 512-token chunk: 1,536 rows, the
    --gpu-memory plan's): a 512-token chunk and a decode step past the wrap, every variant of both
    catalogues, bit for bit the plain buffer's (the same loads in the same order, shifted)."""
    h, kv, d, window, t = 16, 8, 256, 1024, 512
    align = attention_kernels.ring_align(device_info(DEVICE))
    ring = -(-(window - 1 + t) // align) * align
    q, k, v, cache = filled_cache(t, q_start, h, kv, d, torch.bfloat16, seed=4)
    reference(q, k, v, cache, q_start, window, None)
    n = q_start + t
    rows = torch.arange(n - ring, n, device=DEVICE)
    rk, rv = (torch.zeros((ring, kv, d), dtype=torch.bfloat16, device=DEVICE) for _ in range(2))
    rk[rows % ring], rv[rows % ring] = cache.k[rows], cache.v[rows]
    dev, scale = device_info(DEVICE), d ** -0.5
    shape = attention_kernels.PrefillShape(t, h, kv, d, window)
    for form in attention_kernels.PREFILL_OP.catalogue(shape, dev):
        want = attention_kernels.prefill_attention(q, cache.k, cache.v, q_start, n, scale, window, None, form)
        got = attention_kernels.prefill_attention(q, rk, rv, q_start, n, scale, window, None, form, ring=ring)
        assert torch.equal(got, want), form.name
    pos = torch.tensor([n - 1], dtype=torch.int64, device=DEVICE)
    dshape = attention_kernels.DecodeShape(n, h, kv, d, window)
    for form in attention_kernels.DECODE_OP.catalogue(dshape, dev):
        want = attention_kernels.decode_attention(q[-1:], cache.k, cache.v, pos, scale, window, None, form)
        got = attention_kernels.decode_attention(q[-1:], rk, rv, pos, scale, window, None, form, ring=ring,
                                                 span=cache.k.shape[0])
        assert torch.equal(got, want), form.name
