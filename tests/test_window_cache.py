"""kiln.cache.WindowKVCache, a sliding-window layer's ring on the cuda backend: it grows as a plain
buffer until it holds its window and a chunk, then wraps; what it hands back (ordered keys, the
reference path's update, snapshots) are the positions it holds, in order."""

from __future__ import annotations

import torch

from kiln.cache import KVCache, WindowKVCache, restore, snapshot


def ring(window=7, chunk=16, align=8, limit=None) -> WindowKVCache:
    cache = WindowKVCache(2, 4, window, chunk, align, torch.float32, "cpu")
    cache.limit = limit
    return cache


def values(start: int, n: int) -> torch.Tensor:
    """K (or V) rows that name their position: row p is p everywhere."""
    return torch.arange(start, start + n, dtype=torch.float32)[:, None, None].expand(n, 2, 4).clone()


def test_it_grows_as_a_plain_buffer_until_its_window_and_a_chunk_then_wraps():
    cache = ring(window=7, chunk=16, align=8)
    assert cache.target == 24 and cache.ring_rows == 24 and cache.capacity == 256   # min(256, target) rows
    big = ring(window=300, chunk=40, align=32)
    assert big.target == 352 and big.ring_rows == 256
    big.write(values(0, 200), values(0, 200), 0)
    big.length = 200
    big.reserve(300)       # span as a plain buffer's capacity (256 -> 512), rows up to the target
    assert big.capacity == 512 and big.ring_rows == 352
    assert torch.equal(big.k[:200], values(0, 200))      # copied over: positions below the rows, unwrapped
    address = big.k.data_ptr()
    big.reserve(5000)
    assert big.capacity == 5000 and big.ring_rows == 352 and big.k.data_ptr() == address


def test_positions_land_at_their_row_modulo_the_ring_and_read_back_in_order():
    cache = ring()
    for start in range(0, 100, 10):
        cache.write(values(start, 10), values(start, 10) + 0.5, start)
        cache.length = start + 10
    assert torch.equal(cache.rows_at(torch.tensor([0, 23, 24, 99])), torch.tensor([0, 23, 0, 3]))
    first, k, v = cache.ordered()
    assert first == 100 - 24
    assert torch.equal(k, values(76, 24)) and torch.equal(v, values(76, 24) + 0.5)
    assert torch.equal(cache.k[99 % 24], values(99, 1)[0])


def test_update_returns_the_window_before_the_chunk_then_the_chunk():
    cache = ring(window=7)
    cache.update(values(0, 30), values(0, 30), torch.arange(30))     # longer than the ring: its last rows kept
    keys, vals, kpos = cache.update(values(30, 5), values(30, 5), torch.arange(30, 35))
    assert torch.equal(kpos, torch.arange(24, 35)) and cache.length == 35
    assert torch.equal(keys, values(24, 11)) and torch.equal(vals, values(24, 11))


def test_room_cuts_a_call_so_its_keys_and_the_window_fit_the_ring():
    cache = ring(window=7, chunk=16, align=8)       # 24 rows: 7 - 1 + 18 rows a call at most
    assert cache.room(10) == 10 and cache.room(100) == 18
    assert KVCache(2, 4, torch.float32, "cpu").room(100) == 100


def test_truncate_only_where_the_ring_still_holds_the_window_before_it():
    cache = ring(window=7)
    cache.write(values(0, 40), values(0, 40), 0)
    cache.length = 40                    # holds 16..39
    assert not cache.truncate(21)        # its window, 15..20, lost 15
    assert cache.truncate(22) and cache.length == 22
    assert not cache.truncate(23)        # past what it holds


def test_a_snapshot_restores_into_a_fresh_ring():
    cache = ring()
    cache.write(values(0, 50), values(0, 50), 0)
    cache.length = 50
    saved = snapshot([cache])
    fresh = ring()
    restore([fresh], saved)
    assert fresh.length == 50
    assert torch.equal(fresh.ordered()[1], values(26, 24))


def test_the_memory_plan_counts_the_rows_a_ring_comes_to_hold():
    """kiln.api's state bytes (the --gpu-memory plan, kiln bench's state_bytes) use WindowKVCache.rows_for:
    what a ring holds once it has seen `limit` positions, the context's cap, or as many as it wraps at."""
    from kiln.api import _layer_state_bytes

    for window, chunk, align, limit in ((7, 16, 8, None), (300, 40, 32, None), (300, 40, 32, 100),
                                        (300, 40, 32, 300), (600, 64, 32, 4000), (600, 64, 32, 400)):
        cache = ring(window, chunk, align, limit)
        n = limit or 3000
        for start in range(0, n, chunk):
            t = min(chunk, n - start)
            cache.reserve(start + t)
            cache.write(values(start, t), values(start, t), start)
            cache.length = start + t
        held = cache.k.nbytes + cache.v.nbytes
        assert _layer_state_bytes(cache, limit or 10**9, chunk) == held, (window, chunk, align, limit)
