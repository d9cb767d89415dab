"""The batched decode kernels (one launch for B requests whose states are slots of a pool) give each
row exactly what the one-request kernel gives it alone: the GDN step (y, conv and recurrent states)
and split-KV attention (with and without the output gate), rows in any slot order, at ragged
positions. Under Triton's interpreter on CPU."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from kiln.ops.attention import kernels as attention_kernels  # noqa: E402
from kiln.ops.gdn import kernels as gdn_kernels  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
SLOTS = [3, 0, 2]           # rows take slots out of order; slot 1 is idle and must stay untouched


def gdn_rows_case(dtype, hk=2, hv=4, dk=16, dv=32, seed=0):
    s = gdn_kernels.GdnShape(len(SLOTS), hk, hv, dk, dv, 4)
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    inp = gdn_kernels.gdn_inputs(s, dtype, DEVICE, gen)
    conv = torch.randn(4, 4, s.conv_dim, generator=gen, device=DEVICE).to(dtype)
    ssm = torch.randn(4, hv, dk, dv, generator=gen, device=DEVICE) * 0.1
    return inp, conv, ssm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("form", [gdn_kernels.fused_variant(32, 4), gdn_kernels.fused_variant(16, 4),
                                  gdn_kernels.fused_variant(16, 4, last=True)], ids=lambda v: v.name)
def test_gdn_decode_rows_equal_each_row_alone(dtype, form):
    inp, conv, ssm = gdn_rows_case(dtype)
    weights = [inp[n] for n in gdn_kernels.ARGS[4:]]
    want_conv, want_ssm = conv.clone(), ssm.clone()
    want = [gdn_kernels.gdn_decode(*(inp[n][r:r + 1] for n in ("qkv", "z", "b", "a")), *weights, want_conv[s],
                                   want_ssm[s], inp["dims"], form) for r, s in enumerate(SLOTS)]
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=DEVICE)
    got = gdn_kernels.gdn_decode_rows(inp["qkv"], inp["z"], inp["b"], inp["a"], *weights, conv, ssm, slots,
                                      inp["dims"], form)
    assert torch.equal(got, torch.cat(want))
    assert torch.equal(conv, want_conv) and torch.equal(ssm, want_ssm)   # slot 1 included: untouched by both


def attention_rows_case(dtype, h=4, kv=2, d=32, cap=96, seed=1):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)  # noqa: E731
    qg = r(len(SLOTS), h, 2 * d)
    return qg, r(4, cap, kv, d), r(4, cap, kv, d)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 24])
def test_decode_attention_rows_equal_each_row_alone(dtype, window):
    qg, k_pool, v_pool = attention_rows_case(dtype)
    q, gate = qg.chunk(2, dim=-1)        # strided views, as the model splits Qwen3.5's q | gate
    positions = [70, 0, 95]
    pos = torch.tensor(positions, dtype=torch.int64, device=DEVICE)
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=DEVICE)
    d = q.shape[-1]
    for form in [attention_kernels.decode_trusted_variant(16), attention_kernels.decode_variant(32, 16, 4)]:
        for g in (None, gate):
            want = torch.cat([attention_kernels.decode_attention(
                q[r:r + 1], k_pool[s], v_pool[s], pos[r:r + 1], d ** -0.5, window, None, form,
                gate=None if g is None else g[r:r + 1]) for r, s in enumerate(SLOTS)])
            got = attention_kernels.decode_attention_rows(q, k_pool, v_pool, pos, slots, d ** -0.5, window, None,
                                                          form, gate=g)
            assert torch.equal(got, want), (form.name, g is None)


@pytest.mark.parametrize("window", [None, 24])
def test_decode_attention_rows_over_a_key_span_equal_the_whole_capacity(window):
    """A batched step reads only the first `keys` rows of each slot (StateBatch.keys: every position
    below it) through views of the pools: the same values as over the slots' whole capacity, whose
    extra split holds no key and adds a neutral partial (3 splits of 32 against 4: the same lanes of
    the combine's power-of-two block, the fourth neutral instead of masked)."""
    qg, k_pool, v_pool = attention_rows_case(torch.bfloat16, cap=128)
    q = qg[..., :32]
    pos = torch.tensor([70, 0, 63], dtype=torch.int64, device=DEVICE)
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=DEVICE)
    form = attention_kernels.decode_variant(32, 16, 4)
    whole = attention_kernels.decode_attention_rows(q, k_pool, v_pool, pos, slots, 32 ** -0.5, window, None, form)
    span = attention_kernels.decode_attention_rows(q, k_pool[:, :96], v_pool[:, :96], pos, slots, 32 ** -0.5,
                                                   window, None, form)
    assert torch.equal(span, whole)


def test_key_span_is_a_power_of_two_above_every_position():
    from kiln.cache import KEY_SPAN_MIN, key_span

    assert key_span(0) == key_span(KEY_SPAN_MIN - 1) == KEY_SPAN_MIN
    assert key_span(KEY_SPAN_MIN) == 2 * KEY_SPAN_MIN and key_span(5000) == 8192


def paged_case(dtype, keys, page, h=4, kv=2, d=32, seed=2, device=DEVICE):
    """Each slot's `keys` positions contiguous ([4, keys, KV, D]), and the same values scattered into
    pages of a store in a shuffled order, with the block table that finds them."""
    gen = torch.Generator(device=device).manual_seed(seed)
    r = lambda *shape: torch.randn(*shape, generator=gen, device=device).to(dtype)  # noqa: E731
    k, v = r(4, keys, kv, d), r(4, keys, kv, d)
    width = keys // page
    order = torch.randperm(4 * width + 3, generator=torch.Generator().manual_seed(seed))[: 4 * width]
    table = order.view(4, width).to(torch.int32).to(device)
    k_store = r((4 * width + 3) * page, kv, d)           # pages no slot holds: random, never read
    v_store = r((4 * width + 3) * page, kv, d)
    for s in range(4):
        for j in range(width):
            at, mine = int(table[s, j]) * page, slice(j * page, (j + 1) * page)
            k_store[at: at + page], v_store[at: at + page] = k[s, mine], v[s, mine]
    return r(len(SLOTS), h, 2 * d), k, v, k_store, v_store, table


def check_paged(dtype, keys, page, window, forms, positions, device=DEVICE, **dims):
    from kiln.ops.attention import paged

    qg, k, v, k_store, v_store, table = paged_case(dtype, keys, page, device=device, **dims)
    q, gate = qg.chunk(2, dim=-1)
    pos = torch.tensor(positions, dtype=torch.int64, device=device)
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=device)
    scale = q.shape[-1] ** -0.5
    for form in forms:
        for g in (None, gate):
            want = torch.cat([attention_kernels.decode_attention(
                q[r:r + 1], k[s], v[s], pos[r:r + 1], scale, window, None, form,
                gate=None if g is None else g[r:r + 1]) for r, s in enumerate(SLOTS)])
            got = paged.decode_attention_paged(q, k_store, v_store, pos, slots, table, page, keys, scale, window,
                                               None, form, gate=g)
            assert torch.equal(got, want), (form.name, g is None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("window", [None, 40])
def test_paged_decode_attention_equals_each_row_alone_over_its_keys_in_one_buffer(dtype, window):
    """Keys found through a block table (pages shuffled, several a row, a step never across two) give
    each row bit for bit what the one-request kernel gives over the same keys in one buffer, with the
    same variant: the trusted one-split form and a split form, with and without the output gate."""
    forms = [attention_kernels.decode_trusted_variant(16), attention_kernels.decode_variant(32, 16, 4),
             attention_kernels.decode_variant(64, 32, 4)]
    check_paged(dtype, keys=128, page=32, window=window, forms=forms, positions=[100, 0, 127])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("window", [None, 1024])
def test_gpu_paged_decode_attention_equals_each_row_alone(window):
    """The H200's split forms (up to 128 keys a step: a step fills a page) on the 35B's attention shape."""
    from kiln.cache import PAGE

    forms = [attention_kernels.decode_variant(c, bn, w) for c, bn, w in attention_kernels.GPU_DECODE]
    check_paged(torch.bfloat16, keys=4096, page=PAGE, window=window, forms=forms, positions=[3000, 0, 4095],
                device=torch.device("cuda"), h=16, kv=2, d=256)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_paged_decode_attention_over_a_windowed_layers_ring_equals_the_whole_buffer(dtype):
    """A sliding-window layer's ring (kiln.cache.SlotPool: a slot keeps `ring` pages, position p at page
    p // page mod ring, its table row repeating them): the window's keys are intact, the older rows the
    ring reused hold other positions' values; those are masked (a step aligned down still loads them),
    so each row equals the one-request kernel over every position in one buffer, bit for bit."""
    from kiln.ops.attention import paged

    page, ring, keys, window = 16, 3, 128, 24          # window + a step of 16 keys <= ring * page
    gen = torch.Generator(device=DEVICE).manual_seed(4)
    r = lambda *shape: torch.randn(*shape, generator=gen, device=DEVICE).to(dtype)  # noqa: E731
    k, v, qg = r(4, keys, 2, 32), r(4, keys, 2, 32), r(len(SLOTS), 4, 32)
    positions = [100, 5, 127]
    k_store, v_store = r(4 * ring * page, 2, 32), r(4 * ring * page, 2, 32)    # stale rows: random, finite
    j = torch.arange(keys // page)
    table = torch.stack([s * ring + j % ring for s in range(4)]).to(torch.int32).to(DEVICE)
    for row, s in enumerate(SLOTS):          # each slot's ring as its request left it: positions up to its own
        for p in range(positions[row] + 1):
            at = int(table[s, p // page]) * page + p % page
            k_store[at], v_store[at] = k[s, p], v[s, p]
    pos = torch.tensor(positions, dtype=torch.int64, device=DEVICE)
    slots = torch.tensor(SLOTS, dtype=torch.int32, device=DEVICE)
    for form in [attention_kernels.decode_variant(32, 16, 4), attention_kernels.decode_trusted_variant(16)]:
        want = torch.cat([attention_kernels.decode_attention(qg[i:i + 1], k[s], v[s], pos[i:i + 1], 32 ** -0.5, window,
                                                             None, form) for i, s in enumerate(SLOTS)])
        got = paged.decode_attention_paged(qg, k_store, v_store, pos, slots, table, page, keys, 32 ** -0.5, window,
                                           None, form)
        assert torch.equal(got, want), form.name
