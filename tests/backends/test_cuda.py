"""The cuda backend's whole model against the reference backend on CPU, under Triton's interpreter:
a tiny hybrid MoE model whose head dims let every kernel family run (attention, GDN, MoE, GEMM,
RMSNorm). f32, so the two backends agree to rounding; a chunked prefill then decode steps. Sliding
windows on plain KV buffers; a whole model's greedy tokens equal the reference backend's."""

from __future__ import annotations

import os

import pytest
import torch

pytest.importorskip("triton")

from kiln.backends.cuda import CudaOps  # noqa: E402
from kiln.ops.dispatch import families_off  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
# KILN_KERNELS_OFF=family,... runs a family's reference ops instead of its kernels
SWITCHED_OFF = bool({"attention", "gdn", "moe"} & families_off())


def _logits(backend: str, ids: list[int], steps: list[int], dtype: str = "f32"):
    import kiln

    llm = kiln.load("synth:tiny-qwen3.5-moe-p2", device="cpu", dtype=dtype, backend=backend)
    eng = llm.engine
    eng.prefill_chunk = 16                    # several chunks: later ones attend to the cached prefix
    state = eng.new_state(len(ids) + len(steps))
    out = [eng.prefill(ids, state)]
    for k, tok in enumerate(steps):
        out.append(eng.decode_step(tok, len(ids) + k, state))
    return llm, torch.stack(out).float()


@pytest.mark.skipif(SWITCHED_OFF, reason="a kernel family is switched off")
def test_cuda_backend_logits_equal_reference_through_prefill_and_decode(monkeypatch):
    monkeypatch.setenv("KILN_TUNE_BUDGET_S", "0")     # each op's default variant: tuning is tested elsewhere
    ids = [(7 * i + 3) % 397 for i in range(37)]
    steps = [5, 300, 42, 17]
    _, ref = _logits("reference", ids, steps)
    llm, got = _logits("cuda", ids, steps)
    assert isinstance(llm.model.ops, CudaOps)
    err = (got - ref).abs().max() / ref.abs().max()
    assert err < 1e-4, err
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.skipif(SWITCHED_OFF, reason="a kernel family is switched off")
@pytest.mark.skipif(DEVICE.type == "cpu" and not os.environ.get("KILN_TEST_ALL_FAMILIES"),
                    reason="two minutes under the interpreter: on a GPU, or KILN_TEST_ALL_FAMILIES=1 (CI's time)")
def test_cuda_backend_in_f16_is_as_close_to_the_reference_as_f16_allows(monkeypatch):
    """--dtype f16 runs the same kernels: the cuda backend's f16 logits are no farther from the
    reference backend's f16 than those are from f32 (the rounding points are the same; only the
    accumulation order differs), and every argmax agrees."""
    monkeypatch.setenv("KILN_TUNE_BUDGET_S", "0")
    ids = [(7 * i + 3) % 397 for i in range(21)]      # two prefill chunks, two decode steps: the f32
    steps = [5, 300]                                   # test above walks the longer path
    _, exact = _logits("reference", ids, steps)
    _, ref = _logits("reference", ids, steps, "f16")
    _, got = _logits("cuda", ids, steps, "f16")
    f16_noise = (ref - exact).abs().max() / exact.abs().max()
    assert (got - ref).abs().max() / ref.abs().max() <= f16_noise
    assert torch.equal(got.argmax(-1), ref.argmax(-1))


def test_gemma3_on_the_cuda_backend_keeps_plain_caches_and_the_reference_tokens(monkeypatch):
    """Sliding-window layers on the cuda backend keep a plain KV buffer (the window is masked in
    attention), so the decode step can be a CUDA graph; tokens equal the reference's ring caches."""
    import kiln
    from kiln.cache import KVCache, RingKVCache

    monkeypatch.setenv("KILN_TUNE_BUDGET_S", "0")
    prompt = [(5 * i + 2) % 317 for i in range(11)]       # longer than the window of 7
    ref = kiln.load("synth:tiny-gemma3", device="cpu", dtype="f32")
    assert any(isinstance(s, RingKVCache) for s in ref.model.make_state(torch.float32, "cpu"))
    llm = kiln.load("synth:tiny-gemma3", device="cpu", dtype="f32", backend="cuda")
    assert all(isinstance(s, KVCache) for s in llm.model.make_state(torch.float32, "cpu"))
    want = ref.generate(prompt, max_new_tokens=6, temperature=0).token_ids
    assert llm.generate(prompt, max_new_tokens=6, temperature=0).token_ids == want


@pytest.mark.parametrize("name", ["tiny-gemma4", "tiny-gemma4-moe-p2"])   # the unfused and fused paths
def test_gemma4_on_the_cuda_backend_keeps_plain_caches_and_the_reference_tokens(monkeypatch, name):
    """As Gemma 3: plain KV buffers for the sliding layers (so Gemma 4's decode step can be a graph),
    the reference's tokens past the window. With power-of-two head dims (p2) every attention layer runs
    the fused q/k/v norm, RoPE and append (keys as values on full layers), and every residual step the
    fused sandwich norms."""
    import kiln
    from kiln.cache import KVCache, RingKVCache
    from kiln.ops.norm import sandwich
    from kiln.ops.rope import kernels as rope_kernels

    fused = {"rope": 0, "norms": 0}
    for module, fn, key in ((rope_kernels, "qk_rope", "rope"), (sandwich, "residual_norms", "norms")):
        real = getattr(module, fn)
        monkeypatch.setattr(module, fn, lambda *a, _real=real, _key=key, **k: fused.__setitem__(_key, fused[_key] + 1)
                            or _real(*a, **k))

    monkeypatch.setenv("KILN_TUNE_BUDGET_S", "0")
    prompt = [(5 * i + 2) % 300 for i in range(13)]       # longer than the windows (7, 9)
    ref = kiln.load(f"synth:{name}", device="cpu", dtype="f32")
    assert any(isinstance(s, RingKVCache) for s in ref.model.make_state(torch.float32, "cpu"))
    llm = kiln.load(f"synth:{name}", device="cpu", dtype="f32", backend="cuda")
    assert all(isinstance(s, KVCache) for s in llm.model.make_state(torch.float32, "cpu"))
    want = ref.generate(prompt, max_new_tokens=6, temperature=0).token_ids
    assert llm.generate(prompt, max_new_tokens=6, temperature=0).token_ids == want
    layers = llm.model.cfg.num_hidden_layers
    assert fused["norms"] >= 2 * layers    # two residual steps a layer, in every forward
    assert (fused["rope"] >= layers) == name.endswith("-p2")


@pytest.mark.parametrize("name", ["tiny-gemma3", "tiny-gemma4", "tiny-gemma4-moe-p2"])
def test_sliding_layers_wrap_a_ring_of_the_window_and_keep_the_reference_tokens(monkeypatch, name):
    """With a prefill chunk of 8 the sliding layers keep rings of 32 rows (window - 1 + 8, in key blocks
    of 32; kiln.cache.WindowKVCache): a 40-token prompt and 12 new tokens wrap them, and the prompt fed
    in calls of 64 rows, past a ring's room, is cut into pieces. Tokens equal the reference's (its
    RingKVCache). tiny-gemma4's head dims take the reference attention on the ring (update), p2's the
    fused append and the kernels."""
    import kiln
    from kiln.cache import WindowKVCache

    monkeypatch.setenv("KILN_TUNE_BUDGET_S", "0")
    prompt = [(7 * i + 3) % 300 for i in range(40)]
    ref = kiln.load(f"synth:{name}", device="cpu", dtype="f32")
    want = ref.generate(prompt, max_new_tokens=12, temperature=0).token_ids
    llm = kiln.load(f"synth:{name}", device="cpu", dtype="f32", backend="cuda")
    llm.model.ops.prefill_chunk = 8
    rings = [s for s in llm.model.make_state(torch.float32, "cpu") if isinstance(s, WindowKVCache)]
    assert rings and all(r.target == 32 for r in rings)
    llm.engine.prefill_chunk = 64
    assert llm.generate(prompt, max_new_tokens=12, temperature=0).token_ids == want


def test_tiny_qwen35_greedy_tokens_equal_reference_backend():
    """The whole model through the cuda backend's kernels gives the reference backend's tokens."""
    import kiln

    dtype = "bf16" if DEVICE.type == "cuda" else "f32"
    prompt = [3, 17, 101, 7, 250]
    ref = kiln.load("synth:tiny-qwen3.5", device=str(DEVICE), dtype=dtype).generate(prompt, max_new_tokens=3,
                                                                                     temperature=0)
    llm = kiln.load("synth:tiny-qwen3.5", device=str(DEVICE), dtype=dtype, backend="cuda")
    assert isinstance(llm.model.ops, CudaOps)
    assert llm.generate(prompt, max_new_tokens=3, temperature=0).token_ids == ref.token_ids


@pytest.fixture(scope="module")
def moe_p2():
    import kiln

    # Each op's default variant, and the GDN decode pinned to a fused form: the pooled step runs that for
    # every row (gated_deltanet_rows). Tuning is tested elsewhere; here it took 6.5 minutes under the
    # interpreter with an empty tune cache, and its fused and unfused GDN decode tie (70.0 ms each). A
    # zero budget alone is not enough: the tuner still borrows choices that other tests' models of the
    # same shapes measured (CI picked the unfused one that way).
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("KILN_TUNE_BUDGET_S", "0")
        return kiln.load("synth:tiny-qwen3.5-moe-p2", device=str(DEVICE), dtype="f32", backend="cuda",
                         tune={"gdn_decode": "fused_bv32_w4"})


@pytest.mark.skipif(SWITCHED_OFF, reason="a kernel family is switched off")
def test_pooled_batched_decode_step_equals_the_per_request_loop(moe_p2, monkeypatch):
    """Requests whose state are slots of one pool: a batched decode step runs each layer's GDN step and
    attention for all rows in one kernel, and gives the logits and states of the row loop bit for bit."""
    from kiln.cache import SlotPool
    from kiln.ops.attention import paged
    from kiln.ops.gdn import kernels as gdn_kernels

    eng = moe_p2.engine
    pool = eng.slot_pool(4)
    states = [pool.take() for _ in range(3)][::-1]         # slots out of order
    prompts = [[5, 9, 33, 2, 71], [8, 1], [40, 41, 42]]
    for ids, st in zip(prompts, states):
        eng.prefill(ids, st)
    tokens, positions = [3, 77, 12], [len(p) for p in prompts]
    tensors = [t for layer in states[0] for t in ((layer.pool_conv, layer.pool_ssm) if hasattr(layer, "pool_ssm")
                                                  else (layer.pool_k, layer.pool_v))]
    before = [t.clone() for t in tensors]
    calls = []
    for mod, name in ((gdn_kernels, "gdn_decode_rows"), (paged, "decode_attention_paged")):
        monkeypatch.setattr(mod, name, lambda *a, _f=getattr(mod, name), _n=name, **k: calls.append(_n) or _f(*a, **k))
    batched = eng.decode_batch(tokens, positions, states)
    after = [t.clone() for t in tensors]
    assert set(calls) == {"gdn_decode_rows", "decode_attention_paged"}
    for t, b in zip(tensors, before):
        t.copy_(b)
    for st in states:
        for layer in st:
            layer.length -= 1
    monkeypatch.setattr(SlotPool, "slots_of", staticmethod(lambda states: None))
    looped = eng.decode_batch(tokens, positions, states)
    assert torch.equal(batched, looped)
    assert [i for i, (t, a) in enumerate(zip(tensors, after)) if not torch.equal(t, a)] == []
    for st in states:
        pool.give(st)


@pytest.mark.skipif(SWITCHED_OFF, reason="a kernel family is switched off")
def test_a_batch_with_fewer_slots_than_prompts_runs_them_all(moe_p2, monkeypatch):
    """Prompts past the pool's slots wait for one; every slot is back in the pool at the end; the tokens
    are the row loop's."""
    import kiln
    from kiln.engine import Batch

    prompts = [[5, 9, 33, 2, 71], [8, 1], [40, 41, 42]]

    def run():
        batch = Batch(moe_p2.engine, set(), slots=2)
        requests = [batch.add(p, kiln.SamplingParams(max_new_tokens=3)) for p in prompts]
        return [list(r.stream.ids) for r in requests], batch

    lent, pool = [], moe_p2.engine.slot_pool(2)
    take = pool.take
    monkeypatch.setattr(pool, "take", lambda tokens=None, spare=0: (st := take(tokens, spare)) is not None
                        and lent.append(pool.count - len(pool.free)) or st)
    pooled, batch = run()
    assert batch.pool is pool and len(pool.free) == pool.count and len(lent) == 3 and max(lent) <= 2
    assert len(pool.free_pages) == pool.pages        # every page back too
    assert batch.lent == 0
    monkeypatch.setattr(moe_p2.engine, "slot_pool", lambda slots: None)
    loop, batch = run()
    assert batch.pool is None
    assert pooled == loop and all(len(t) == 3 for t in pooled)


@pytest.mark.skipif(SWITCHED_OFF, reason="a kernel family is switched off")
def test_a_cached_prefix_is_shared_page_for_page_and_freed_with_its_last_holder(moe_p2):
    """Paged KV with a prefix cache: a request starting from a kept prefix holds the prefix's whole
    pages themselves (no copy), gets a copy of its partly filled last page, and the tokens it gets in a
    batch of its own; a request holds only the pages its prompt and first step need; the pages
    come back when the last holder (request or cache entry) lets go."""
    import kiln
    from kiln.cache import PAGE, PagedPrefix, pages_for
    from kiln.engine import Batch

    eng = moe_p2.engine
    shared = [(5 * j) % 300 + 1 for j in range(PAGE + 70)]          # kept at 192 tokens: 1.5 pages
    first, second = shared + [7, 8], shared + [11, 12, 13]
    params = kiln.SamplingParams(max_new_tokens=4)
    want = list(Batch(eng, set(), slots=2, prefix_cache=True).add(second, params).stream.ids)
    batch = Batch(eng, set(), slots=2, prefix_cache=True)
    pool = batch.pool
    list(batch.add(first, params).stream.ids)
    (kept,) = batch.prefixes.items.values()
    assert isinstance(kept, PagedPrefix) and kept.n == 192 and len(kept.pages) == 2
    assert len(pool.free_pages) == pool.pages - 2                     # the request's others are back
    r = batch.add(second, params)
    while r.state is None or r.pos < len(second):
        batch.step()
    mine = pool._held[r.state[0].slot]
    assert len(mine) == pages_for(len(second) + 1)
    assert mine[0] == kept.pages[0] and pool.refs[kept.pages[0]] == 2     # the whole page: shared
    assert mine[1] != kept.pages[1] and pool.refs[kept.pages[1]] == 1     # the partial one: copied
    assert [pool.table[r.state[0].slot, j].item() for j in range(len(mine))] == mine
    got = list(r.stream.ids)
    assert got == want and r.stream.times.cached_tokens == 192
    assert len(pool.free_pages) == pool.pages - 2
    batch.prefixes.drop_oldest()
    assert len(pool.free_pages) == pool.pages and set(pool.refs) == {0}


@pytest.mark.skipif(SWITCHED_OFF, reason="a kernel family is switched off")
def test_requests_whose_pages_do_not_run_in_order_get_the_tokens_of_ones_whose_pages_do(moe_p2, monkeypatch):
    """A slot's pages in any order (the pool prefers runs, which every op reads as one buffer): the
    prefill works on a contiguous copy and writes its positions back (kiln.cache.stage), the batched
    decode reads through the table; the tokens are those of slots whose pages run in order."""
    import kiln
    from kiln.cache import PagedKV, SlotPool
    from kiln.engine import Batch

    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 300, (n,), generator=g).tolist() for n in (150, 140, 20)]
    params = kiln.SamplingParams(max_new_tokens=4)

    def run():
        batch = Batch(moe_p2.engine, set(), slots=3)
        requests = [batch.add(p, params) for p in prompts]
        seen = []
        while any(not r.done for r in requests):
            batch.step()
            seen += [r.state[3].contiguous for r in requests if r.state is not None and isinstance(r.state[3], PagedKV)]
        return [list(r.out) for r in requests], seen

    want, seen = run()
    assert seen and all(seen)
    alloc = SlotPool._alloc
    monkeypatch.setattr(SlotPool, "_alloc", lambda self, need: alloc(self, need)[::-1])    # the same pages, reversed
    got, seen = run()
    assert got == want and not all(seen)


@pytest.mark.skipif(SWITCHED_OFF, reason="a kernel family is switched off")
def test_sliding_window_layers_keep_a_ring_of_pages_and_give_the_tokens_of_whole_caches(monkeypatch):
    """A windowed layer's pages in a pool are a fixed ring a slot (its window and a page), not a page
    for every position: requests longer than the ring (their positions wrap), one started from a kept
    prefix (its rings copied), give the tokens of a pool whose windowed layers keep every position."""
    import kiln
    from kiln import cache
    from kiln.cache import PAGE, PagedKV
    from kiln.engine import Batch

    monkeypatch.setenv("KILN_TUNE_BUDGET_S", "0")
    llm = kiln.load("synth:tiny-gemma3", device="cpu", dtype="f32", backend="cuda", max_context=1024)
    shared = [(5 * j) % 300 + 1 for j in range(2 * PAGE + 70)]      # past the 2-page ring of window 7
    prompts = [shared + [7, 8], [3] * 40, shared + [11, 12, 13]]
    params = kiln.SamplingParams(max_new_tokens=5)

    def run():
        llm.engine._pool = None
        batch = Batch(llm.engine, set(), slots=2, prefix_cache=True)
        first = [list(batch.add(p, params).stream.ids) for p in prompts[:2]]       # keeps shared[:320]
        last = batch.add(prompts[2], params)
        return first + [list(last.stream.ids)], last.stream.times.cached_tokens, batch.pool

    got, cached, pool = run()
    rings = [layer for layer in pool.states[0] if isinstance(layer, PagedKV) and layer.ring]
    assert len(rings) == 3 and all(layer.ring == 2 for layer in rings)
    assert rings[0].pool_k.shape[0] == (pool.width + 2 * 2) * PAGE      # the scratch's capacity, then 2 rings
    monkeypatch.setattr(cache, "ring_pages", lambda window, capacity: 0)     # every position kept
    want, cached_whole, whole = run()
    assert not any(isinstance(layer, PagedKV) and layer.ring for layer in whole.states[0])
    assert got == want and cached == cached_whole == 320


@pytest.mark.skipif(SWITCHED_OFF, reason="a kernel family is switched off")
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=[
    pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")])])
def test_requests_take_pages_as_they_grow_and_the_newest_is_preempted_when_none_are_free(device, monkeypatch):
    """A request holds the pages of its prompt and first step, and one more each PAGE positions it
    makes. Three requests whose prompts and first steps fit a pool of 5 pages but whose growth does
    not: at the page boundary the newest is preempted (its slot and pages freed), waits, and prefills
    its prompt and the tokens it made again when pages free up; every request, a seeded sampled one
    among them, gets the tokens of a pool with room for all; every page is back at the end."""
    import kiln
    from kiln.cache import PAGE, SlotPool
    from kiln.engine import Batch

    monkeypatch.setenv("KILN_TUNE_BUDGET_S", "0")
    eng = kiln.load("synth:tiny-qwen3.5", device=device, dtype="f32", backend="cuda", max_context=512).engine
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(1, 300, (PAGE - 4,), generator=g).tolist() for _ in range(3)]
    params = [kiln.SamplingParams(max_new_tokens=7), kiln.SamplingParams(max_new_tokens=7),
              kiln.SamplingParams(max_new_tokens=7, temperature=0.8, seed=5)]

    def run(pages):
        eng._pool = SlotPool(eng.model.make_state(eng.dtype, eng.device), 3, 512, pages)
        batch = Batch(eng, set(), slots=3)
        requests = [batch.add(p, s) for p, s in zip(prompts, params)]
        held = []
        while any(not r.done for r in requests):
            batch.step()
            held.append([batch.pool.held(r.state[0].slot) if r.state is not None else 0 for r in requests])
        return [list(r.out) for r in requests], batch, held

    want, roomy, held = run(12)
    first = [h[0] for h in held if h[0]]
    assert roomy.preempted == 0 and sorted(first) == first and set(first) == {1, 2}   # a second page past PAGE
    got, tight, held = run(5)
    assert tight.preempted == 1 and [1, 1, 1] in held and [2, 2, 0] in held
    assert got == want and all(len(t) == 7 for t in got)
    assert len(tight.pool.free_pages) == 5 and len(tight.pool.free) == 3 and tight.lent == 0
    if device == "cpu":
        careful_steps_inside_a_prefill(eng, prompts, params, want, monkeypatch)


def careful_steps_inside_a_prefill(eng, prompts, params, want, monkeypatch):
    """KILN_INSIDE=both: a step launched between a prefill's layers on a GPU (Batch._advance(inside=True),
    here with Batch.cuda forced) takes a page only where one is free, never preempts, and launches only
    a step that replays a captured graph; the step after the prefill does the rest, same tokens."""
    from kiln import engine
    from kiln.cache import SlotPool
    from kiln.engine import Batch

    monkeypatch.setattr(engine, "INSIDE", "both")

    eng._pool = SlotPool(eng.model.make_state(eng.dtype, eng.device), 3, 512, 5)
    batch = Batch(eng, set(), slots=3)
    requests = [batch.add(p, s) for p, s in zip(prompts, params)]
    flags, preempted_inside, declined = {"inside": False, "replays": False}, [], 0
    launch, preempt = batch._launch, batch._preempt

    def launch_here(live, inside=False):    # (its pinned copy and event need a GPU: launched as on a CPU)
        batch.cuda = False
        try:
            launch(live, inside)
        finally:
            batch.cuda = True

    def preempt_logged(r):
        preempted_inside.append(flags["inside"])
        preempt(r)

    batch.cuda, batch._launch, batch._preempt = True, launch_here, preempt_logged
    monkeypatch.setattr(eng, "replays", lambda positions, states: flags["replays"])
    batch.step()
    batch._advance(inside=True)     # no captured graph to replay: nothing launched
    assert batch.pending is None and batch.running
    flags["replays"] = True
    while any(not r.done for r in requests):
        flags["inside"] = True
        batch._advance(inside=True)
        flags["inside"] = False
        declined += batch.pending is None and bool(batch.running)
        batch.step()
    assert [list(r.out) for r in requests] == want
    assert batch.preempted == 1 and preempted_inside == [False] and declined >= 1


def _batch_tokens(eng, prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
    """Greedy tokens of one Batch of 64 slots running every prompt at once (max_new_tokens each)."""
    import kiln
    from kiln.engine import Batch

    batch = Batch(eng, set(), slots=64)
    requests = [batch.add(p, kiln.SamplingParams(max_new_tokens=n)) for p, n in zip(prompts, lengths)]
    while any(not r.done for r in requests):
        batch.step()
    return [list(r.out) for r in requests]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graphs_captured_before_the_counters_grew_replay_right(monkeypatch):
    """An earlier batch captures the batched steps of 2 and 1 rows; a batch of 48 then grows the GDN
    decode's arrival counters (9 a row on this model: past the first 256 from 29 rows) and shrinks back
    to one row, replaying those graphs: its tokens are a fresh engine's for the same batch. With
    KILN_KEEP_COUNTERS=0 (the old behaviour, docs/batching.md "Fixed") the replays count in freed
    memory, which breaks this where that memory went to a live tensor (tests/ops/test_counters.py
    shows the mechanism deterministically)."""
    import kiln

    monkeypatch.setenv("KILN_TUNE_BUDGET_S", "0")
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(1, 500, (5 + int(n),), generator=g).tolist() for n in torch.randint(0, 35, (48,),
                                                                                                   generator=g)]
    lengths = [4 + (7 * j) % 29 for j in range(48)]        # ending one after another: down to one row

    def engine():
        return kiln.load("synth:tiny-qwen3.5", device="cuda", dtype="bf16", backend="cuda", max_context=512).engine

    first = engine()
    _batch_tokens(first, prompts[:2], [40, 20])
    got = _batch_tokens(first, prompts, lengths)
    assert got == _batch_tokens(engine(), prompts, lengths)
    assert [len(t) for t in got] == lengths
