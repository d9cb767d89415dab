"""The batch slot pool's page accounting (kiln.cache.SlotPool): under any sequence of requests taking
pages, growing, sharing prefixes, adopting them and leaving, every page is either free or held, each page's
count is the number of its holders, the block table lists each slot's pages, and a ring's table row
repeats its own pages only. No model: a template of plain states."""

from __future__ import annotations

import random

import pytest
import torch

from kiln.cache import PAGE, GDNState, KVCache, PagedKV, SlotPool, pages_for


def template(window: int | None = None) -> list:
    full = KVCache(2, 8, torch.float32, "cpu")
    windowed = KVCache(2, 8, torch.float32, "cpu")
    windowed.window = window
    return [GDNState(4, 4, 2, 8, 8, torch.float32, "cpu"), full, windowed]


def check(pool: SlotPool, prefixes: list) -> None:
    holders = [0] * len(pool.refs)
    for pages in pool._held.values():
        for p in pages:
            holders[p] += 1
    for prefix in prefixes:
        for p in prefix.pages:
            holders[p] += 1
    assert holders == pool.refs         # exactly (the pool's own check sees no prefix: at least)
    assert len(pool.free_pages) + sum(r > 0 for r in pool.refs) == pool.pages   # no page lost; the scratch's never lent
    pool.check()                # the rest: range, double frees, free pages counted, table rows


def test_the_pools_own_check_catches_a_page_freed_while_held():
    pool = SlotPool(template(), slots=2, capacity=4 * PAGE, pages=6)
    state = pool.take(2 * PAGE)
    pool.check()
    page = pool._held[state[0].slot][0]
    pool.free_pages.append(page)
    with pytest.raises(AssertionError, match="a held page listed free"):
        pool.check(table=False)


@pytest.mark.parametrize("seed", range(4))
def test_pages_are_free_or_held_and_counted_under_any_sequence(seed):
    rnd = random.Random(seed)
    pool = SlotPool(template(window=100), slots=4, capacity=8 * PAGE, pages=20)
    live, prefixes = [], []
    for _ in range(200):
        action = rnd.random()
        if action < 0.4:
            state = pool.take(rnd.randint(1, 6 * PAGE))
            if state is not None:
                if prefixes and rnd.random() < 0.5:
                    prefix = rnd.choice(prefixes)
                    if pages_for(prefix.n + 1) <= pool.held(state[0].slot):
                        pool.adopt(state, prefix)
                live.append(state)
        elif action < 0.6 and live:
            state = rnd.choice(live)
            held, tokens, free = pool.held(state[0].slot), rnd.randint(1, pool.capacity), len(pool.free_pages)
            grown = pool.grow(state, tokens)
            assert grown == (pages_for(tokens) - held <= free)
            assert pool.held(state[0].slot) == (max(held, pages_for(tokens)) if grown else held)
        elif action < 0.7 and live:
            pool.give(live.pop(rnd.randrange(len(live))))
        elif action < 0.85 and live:
            state = rnd.choice(live)
            n = rnd.randint(1, pool.held(state[0].slot) * PAGE)
            for layer in state:
                layer.length = n
            prefixes.append(pool.share(state, n))
        elif prefixes:
            prefixes.pop(rnd.randrange(len(prefixes))).release()
        check(pool, prefixes)
    for state in live:
        pool.give(state)
    for prefix in prefixes:
        prefix.release()
    check(pool, [])
    assert len(pool.free_pages) == pool.pages and len(pool.free) == pool.count


def test_a_windowed_layer_keeps_a_ring_of_its_own_pages():
    """window 100 -> a ring of 2 pages a slot, its table row repeating them; the full layer's row lists
    the slot's pages; the scratch's rows run over the capacity in order for both."""
    pool = SlotPool(template(window=100), slots=3, capacity=8 * PAGE)
    ring = pool.ring_tables[2]
    for s in range(3):
        base = pool.ring_base(2, s)
        assert ring[s].tolist() == [base + j % 2 for j in range(8)]
    assert ring[3].tolist() == list(range(8)) == pool.table[3].tolist()
    state = pool.take(5 * PAGE)
    full, windowed = (layer for layer in state if isinstance(layer, PagedKV))
    assert windowed.ring == 2 and full.ring == 0 and windowed.kept == 2 * PAGE
    assert not windowed.contiguous and full.contiguous       # 5 pages wrap a ring of 2; a run for the full layer
    assert windowed.pool_k.shape[0] == (8 + 3 * 2) * PAGE
    k = torch.randn(5 * PAGE, 2, 8)
    windowed.write(k, k, 0)                                  # only the last 2 pages' positions kept
    got, _ = windowed.read(5 * PAGE, 3 * PAGE)
    assert torch.equal(got, k[3 * PAGE:])
    assert SlotPool.bytes_per_slot(template(100), 8 * PAGE) < SlotPool.bytes_per_slot(template(None), 8 * PAGE)


def test_a_slot_grows_into_the_page_after_its_own_and_only_into_free_pages():
    """grow adds the pages a slot lacks: the next of its run where that one is free (its K/V stay one
    buffer), else other free pages; with too few free it takes none and says so."""
    pool = SlotPool(template(), slots=3, capacity=8 * PAGE, pages=6)      # lent pages 8 .. 13

    def full(state):
        return next(layer for layer in state if isinstance(layer, PagedKV))

    a = pool.take(PAGE)
    assert pool._held[a[0].slot] == [8] and pool.grow(a, PAGE) and pool.held(a[0].slot) == 1
    assert pool.grow(a, 2 * PAGE) and pool._held[a[0].slot] == [8, 9] and full(a).contiguous
    b = pool.take(PAGE)
    assert pool._held[b[0].slot] == [10]
    assert pool.grow(a, 2 * PAGE + 1) and pool._held[a[0].slot] == [8, 9, 11] and not full(a).contiguous
    assert pool.table[a[0].slot, :3].tolist() == [8, 9, 11]
    assert not pool.grow(b, 4 * PAGE) and pool._held[b[0].slot] == [10]    # 3 more asked, 2 free
    assert sorted(pool.free_pages) == [12, 13]
    check(pool, [])


def test_a_slot_counts_its_own_bytes_not_the_pools():
    """/metrics' state bytes of a pooled request: its pages, its ring and its GDN states, not the stores."""
    from kiln.server.metrics import state_bytes
    pool = SlotPool(template(window=100), slots=3, capacity=8 * PAGE, pages=12)
    state = pool.take(3 * PAGE)
    gdn, full, ring = state
    row = 2 * 8 * 4                                          # KV heads x head dim x f32
    assert state_bytes(state) == gdn.conv.nbytes + gdn.ssm.nbytes + 2 * (3 + 2) * PAGE * row
    assert pool.grow(state, 4 * PAGE) and state_bytes(state) == gdn.conv.nbytes + gdn.ssm.nbytes + 2 * 6 * PAGE * row
