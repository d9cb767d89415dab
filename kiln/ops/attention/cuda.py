"""Attention on the cuda backend: q/k norm, RoPE and the KV append in one kernel (kiln.ops.rope), then
flash prefill or split-KV decode over a plain KV buffer or a sliding window's ring (WindowKVCache);
the reference for the reference's ring cache or a shape the kernels do not take."""

from __future__ import annotations

import torch

from ...cache import PAGE, KVCache, PagedKV, WindowKVCache
from ..dispatch import TunedOps
from ..rope import kernels as rope
from . import kernels, paged
from .reference import AttentionReference


class AttentionCuda(TunedOps, AttentionReference):
    static_windows = True   # sliding windows masked in the kernel over a fixed buffer (window_cache)

    def window_cache(self, n_kv: int, head_dim: int, window: int, dtype, device) -> WindowKVCache:
        """A sliding-window layer's ring: its window and a prefill chunk's positions (the engine's
        chunk, `prefill_chunk`), in whole key blocks of the device's kernels."""
        return WindowKVCache(n_kv, head_dim, window, self.prefill_chunk, kernels.ring_align(self.dev), dtype, device)

    def _attention_fits(self, q, cache) -> bool:
        return self.on("attention", q) and isinstance(cache, KVCache) and kernels.supports(q, cache.k)

    def attention(self, q, k, v, cache, positions, scale, window=None, softcap=None):
        if not self._attention_fits(q, cache):
            return super().attention(q, k, v, cache, positions, scale, window, softcap)
        t = q.shape[0]
        if cache.room(t) < t:   # a ring's keys of a longer call: in pieces that each find theirs
            return self._pieces(cache, t, lambda a, b: self.attention(q[a:b], k[a:b], v[a:b], cache, positions[a:b],
                                                                      scale, window, softcap))
        if t == 1:   # decode: append at the device-side position; the kernel reads the length there
            cache.reserve(cache.length + 1)
            rows = cache.rows_at(positions)
            cache.k.index_copy_(0, rows, k)
            cache.v.index_copy_(0, rows, v)
        else:
            cache.write(k, v, cache.length)
        return self._attend(q, cache, positions, scale, window, softcap)

    @staticmethod
    def _pieces(cache, t: int, run) -> torch.Tensor:
        """run(a, b) over rows a..b-1 in turn, each as many as the cache's room, outputs joined."""
        step = cache.room(t)
        return torch.cat([run(a, min(a + step, t)) for a in range(0, t, step)])

    def _attend(self, q, cache, positions, scale, window, softcap, gate=None):
        """Attention of q over the cache, whose K/V at `positions` are written (its length not yet
        advanced); with a gate, sigmoid(gate) * o (at decode inside the combine kernel)."""
        t, start, (h, kv, d) = q.shape[0], cache.length, (q.shape[1], cache.k.shape[1], q.shape[2])
        cache.length += t
        ring = cache.ring_rows
        if t == 1:
            inside = gate is not None and kernels.gate_ok(q, gate)
            keys = cache.capacity if ring else cache.k.shape[0]     # a ring: the positions it is reserved for
            shape = kernels.DecodeShape(keys, h, kv, d, window, softcap)
            o = kernels.decode_attention(q, cache.k, cache.v, positions, scale, window, softcap,
                                         v=self.choose(kernels.DECODE_OP, shape), gate=gate if inside else None,
                                         ring=ring, span=keys)
            if inside:
                return o
        else:
            shape = kernels.PrefillShape(t, h, kv, d, window, softcap, 0)
            o = kernels.prefill_attention(q, cache.k, cache.v, start, start + t, scale, window, softcap,
                                          v=self.choose(kernels.PREFILL_OP, shape), ring=ring)
        return o if gate is None else self.act_mul(gate, o.view(gate.shape), "sigmoid")

    def qk_norm_rope_attention(self, q, k, v, q_norm_w, k_norm_w, eps, style, rope_tables, cache, positions, scale,
                               window=None, softcap=None, gate=None, v_norm=False):
        cos, sin = rope_tables
        if not self._attention_fits(q, cache) or not self.on("rope", q) or not rope.supports(q, k, v, cache.k, cos):
            return super().qk_norm_rope_attention(q, k, v, q_norm_w, k_norm_w, eps, style, rope_tables, cache,
                                                  positions, scale, window, softcap, gate, v_norm)
        t, r = q.shape[0], cos.shape[-1]
        if cache.room(t) < t:   # a ring's keys of a longer call: in pieces that each find theirs
            return self._pieces(cache, t, lambda a, b: self.qk_norm_rope_attention(
                q[a:b], k[a:b], v[a:b], q_norm_w, k_norm_w, eps, style, (cos[a:b], sin[a:b]), cache, positions[a:b],
                scale, window, softcap, None if gate is None else gate[a:b], v_norm))
        cache.reserve(cache.length + t)
        shape = rope.RopeShape(t, q.shape[1], k.shape[1], q.shape[2], r, style if q_norm_w is not None else None,
                               v_norm)
        q = rope.qk_rope(q, k, v, q_norm_w, k_norm_w, eps, style, cos, sin, cache.k, cache.v, positions,
                         var=self.choose(rope.OP, shape), v_norm=v_norm, ring=cache.ring_rows)
        return self._attend(q, cache, positions, scale, window, softcap, gate)

    def qk_norm_rope_attention_rows(self, q, k, v, q_norm_w, k_norm_w, eps, style, rope_tables, states, positions,
                                    scale, window=None, softcap=None, gate=None, v_norm=False):
        """A batched decode step's attention in three launches (norm + RoPE + append, split-KV, combine)
        when every request's KV is a slot of one pool (StateBatch.slots), read and written through its
        block table (kiln.cache.SlotPool); else None. Each row is computed as decode_attention computes
        it alone."""
        cos, sin = rope_tables
        first = states[0]
        if states.slots is None or not isinstance(first, PagedKV) or not self.on("attention", q):
            return None
        pool, k_store, v_store = first.pool, first.pool_k, first.pool_v
        if not self.on("rope", q) or not kernels.supports(q, k_store) or not rope.supports(q, k, v, k_store, cos):
            return None
        t, h, d = q.shape
        kv = k_store.shape[1]
        # each row's K/V lands in its own slot's page (through the layer's table: a windowed layer's ring)
        table = first.table
        flat = (states.flat or {}).get(id(table))
        flat = pool.flat_rows(states.slots, positions, table) if flat is None else flat
        shape = rope.RopeShape(t, h, kv, d, cos.shape[-1], style if q_norm_w is not None else None, v_norm)
        q = rope.qk_rope(q, k, v, q_norm_w, k_norm_w, eps, style, cos, sin, k_store, v_store, flat,
                         var=self.choose(rope.OP, shape), v_norm=v_norm)
        inside = gate is not None and gate.shape == q.shape and gate.dtype == q.dtype and gate.stride(-1) == 1
        # the rows' keys lie below states.keys: the split grid (and the variant) for that many, not the
        # slot's capacity
        keys = min(pool.capacity, states.keys or pool.capacity)
        var = self.choose(kernels.DECODE_OP, kernels.DecodeShape(keys, h, kv, d, window, softcap))
        o = paged.decode_attention_paged(q, k_store, v_store, positions, states.slots, table, PAGE, keys, scale,
                                         window, softcap, var, gate=gate if inside else None)
        for s in states:
            s.length += 1
        return o if gate is None or inside else self.act_mul(gate, o.view(gate.shape), "sigmoid")
