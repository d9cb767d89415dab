"""Per-layer decode state. Attention layers keep K/V; sliding-window layers keep a ring bounded by
the window, not the context; Gated DeltaNet layers keep a conv window and an f32 recurrent state.

Protocol of every per-layer state: `.length` is the number of tokens it has consumed, and
`truncate(n) -> bool` makes it represent exactly the first n tokens if it can (True), or
returns False when it cannot rewind that far (the engine then prefills from scratch)."""

from __future__ import annotations

import itertools

import torch

from .errors import KilnError


class KVCache:
    """K/V of every past position, [S, KV, D], in a buffer that grows by doubling. `head_major` stores
    each KV head's positions contiguously ([KV, S, D] underneath, `k`/`v` still read [S, KV, D]): a
    CPU's attention then reads each head's keys in one sweep (about half the time of the strided
    layout at 512 positions on our 2-core CPU); GPU kernels take the position-major layout."""

    def __init__(self, n_kv: int, head_dim: int, dtype, device, capacity: int = 256, head_major: bool = False):
        self.head_major = head_major
        self.k = self._alloc(capacity, n_kv, head_dim, dtype, device)
        self.v = self._alloc(capacity, n_kv, head_dim, dtype, device)
        self.length = 0
        self.limit: int | None = None       # the most positions it will hold (the engine's max context)

    def _alloc(self, cap: int, n_kv: int, head_dim: int, dtype, device) -> torch.Tensor:
        if self.head_major:
            return torch.empty(n_kv, cap, head_dim, dtype=dtype, device=device).transpose(0, 1)
        return torch.empty(cap, n_kv, head_dim, dtype=dtype, device=device)

    @property
    def capacity(self) -> int:
        return self.k.shape[0]

    def reserve(self, n: int) -> None:
        """Room for n positions. A CUDA graph holds these buffers' addresses, so the engine reserves a
        request's whole context before capturing its decode step."""
        self._reserve(n)

    def reset(self) -> None:
        self.length = 0

    def _reserve(self, n: int) -> None:
        if n <= self.k.shape[0]:
            return
        cap = max(n, 2 * self.k.shape[0] if self.limit is None else min(2 * self.k.shape[0], self.limit))
        for name in ("k", "v"):
            old = getattr(self, name)
            new = self._alloc(cap, *old.shape[1:], old.dtype, old.device)
            new[: self.length] = old[: self.length]
            setattr(self, name, new)

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Append [T, KV, D] at `positions` (contiguous from self.length); return all keys, values, key positions."""
        end = self.length + k.shape[0]
        self._reserve(end)
        self.k[self.length:end] = k
        self.v[self.length:end] = v
        self.length = end
        kpos = torch.arange(end, device=k.device)
        return self.k[:end], self.v[:end], kpos

    def truncate(self, n: int) -> bool:
        """Forget positions >= n (prefix reuse)."""
        if n > self.length:
            return False
        self.length = n
        return True


class RingKVCache:
    """K/V of the last `window` positions only: a query at p sees keys in (p - window, p]."""

    def __init__(self, n_kv: int, head_dim: int, window: int, dtype, device):
        self.window = window
        self.k = torch.empty(0, n_kv, head_dim, dtype=dtype, device=device)
        self.v = torch.empty_like(self.k)
        self.pos = torch.empty(0, dtype=torch.long, device=device)
        self.length = 0

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        keys, values = torch.cat([self.k, k]), torch.cat([self.v, v])
        kpos = torch.cat([self.pos, positions.to(self.pos.device)])
        # Future queries start at the next position, so only the last window-1 keys stay useful.
        keep = self.window - 1
        self.k, self.v, self.pos = keys[-keep:], values[-keep:], kpos[-keep:]
        self.length = int(positions[-1]) + 1
        return keys, values, kpos

    def truncate(self, n: int) -> bool:
        # Rewinding would need keys that already fell out of the ring.
        return n == self.length


class GDNState:
    """Gated DeltaNet layer state: the last K conv inputs [K, C] in the activation dtype (as HF
    keeps them; K-1 would do) and the recurrent state [Hv, dk, dv] kept in f32."""

    # A padded prefill (kiln.backends.graphs.PrefillGraphs): only the first `valid` rows (an int
    # tensor [1] on the device) are the prompt's; the rows after it must leave both states untouched.
    valid: torch.Tensor | None = None

    def __init__(self, conv_dim: int, kernel: int, heads: int, dk: int, dv: int, dtype, device):
        self.conv = torch.zeros(kernel, conv_dim, dtype=dtype, device=device)
        self.ssm = torch.zeros(heads, dk, dv, dtype=torch.float32, device=device)
        self.length = 0

    def truncate(self, n: int) -> bool:
        return n == self.length  # a recurrence cannot be rewound

    def reset(self) -> None:
        """Back to the empty state, in place (a captured decode graph keeps these buffers)."""
        self.conv.zero_()
        self.ssm.zero_()
        self.length = 0


KEY_SPAN_MIN = 2048     # as the single-row decode graph's smallest context bucket


def key_span(last_position: int) -> int:
    """StateBatch.keys for a step whose rows sit at positions <= last_position: the power of two (at
    least KEY_SPAN_MIN) above it, so that a captured step serves every later one until it is passed."""
    return max(KEY_SPAN_MIN, 1 << last_position.bit_length())


class StateBatch(list):
    """One layer's state of each request in a batched decode step, in the batch's row order (row j
    is request j's token). The ops that read a request's own state (attention over its cache, the
    GDN recurrence) run once per request on its row (`kiln.models.base.per_request`); the
    projections, norms and MLPs run on all rows at once, reading each weight once for the batch.
    Several prompts prefilled together (Engine.prefill_rows) give each request `rows[j]` rows."""

    slots: torch.Tensor | None = None   # each request's pool slot (int32, on the device), when all are pooled
    # A bound on every row's keys (positions < keys, a power of two: key_span): a batched attention reads
    # that much of each pooled slot, its split grid fixed by it, not by the slot's whole capacity.
    keys: int | None = None
    rows: list[int] | None = None       # several prompts prefilled together: each request's row count
    # A step being captured as a CUDA graph: its per-layer objects stand in for the rows' states (the
    # slots say whose), so an op that would run request by request cannot be captured.
    whole_only = False

    def spans(self) -> list[tuple[int, int]]:
        """Each request's rows [a, b) among the step's: one each, or `rows` of them."""
        if self.rows is None:
            return [(j, j + 1) for j in range(len(self))]
        ends = list(itertools.accumulate(self.rows))
        return [(e - n, e) for n, e in zip(self.rows, ends)]


class SlotKV(KVCache):
    """A KVCache whose buffers are slot `slot` of a pool [S, capacity, KV, D] (kiln.cache.SlotPool):
    a fixed capacity, so a batched decode kernel finds every request's keys from the pool and a slot
    index."""

    def __init__(self, pool_k: torch.Tensor, pool_v: torch.Tensor, slot: int):
        self.head_major, self.limit = False, pool_k.shape[1]
        self.pool_k, self.pool_v, self.slot = pool_k, pool_v, slot
        self.k, self.v = pool_k[slot], pool_v[slot]
        self.length = 0

    def _reserve(self, n: int) -> None:
        if n > self.k.shape[0]:
            raise KilnError(f"a pooled KV slot holds {self.k.shape[0]} positions, {n} asked for")


class SlotGDN(GDNState):
    """A GDNState whose conv and recurrent states are slot `slot` of pools [S, K, C] and [S, Hv, dk, dv]."""

    def __init__(self, pool_conv: torch.Tensor, pool_ssm: torch.Tensor, slot: int):
        self.pool_conv, self.pool_ssm, self.slot = pool_conv, pool_ssm, slot
        self.conv, self.ssm = pool_conv[slot], pool_ssm[slot]
        self.length = 0


class SlotPool:
    """The decode state of up to `slots` requests at once, each layer's in one pooled tensor [slots, ...]
    (GDN conv and recurrent states; K/V of `capacity` positions), so that a batched decode step
    updates every request's state in one launch a layer. `take()` lends one request's per-layer
    state (reset), `give(state)` returns it. Layers of other kinds (ring caches) make a pool
    impossible: `poolable` says so first."""

    def __init__(self, template: list, slots: int, capacity: int):
        self.capacity, self.count = capacity, slots
        self.free = list(range(slots - 1, -1, -1))
        # one slot more, never lent: the spare rows of a captured batch step (kiln.backends.graphs) write there
        self.states: list[list] = [[] for _ in range(slots + 1)]
        for layer in template:
            if type(layer) is GDNState:
                conv = layer.conv.new_zeros((slots + 1, *layer.conv.shape))
                ssm = layer.ssm.new_zeros((slots + 1, *layer.ssm.shape))
                made = [SlotGDN(conv, ssm, s) for s in range(slots + 1)]
            else:
                k = layer.k.new_zeros((slots + 1, capacity, *layer.k.shape[1:]))     # no stray NaN bits
                v = layer.v.new_zeros((slots + 1, capacity, *layer.v.shape[1:]))
                made = [SlotKV(k, v, s) for s in range(slots + 1)]
            for s in range(slots + 1):
                self.states[s].append(made[s])

    @property
    def scratch(self) -> list:
        """The spare slot's state (slot `count`): never lent."""
        return self.states[self.count]

    @staticmethod
    def poolable(template: list) -> bool:
        return all(type(layer) is GDNState or (type(layer) is KVCache and not layer.head_major) for layer in template)

    @staticmethod
    def bytes_per_slot(template: list, capacity: int) -> int:
        size = 0
        for layer in template:
            if type(layer) is GDNState:
                size += layer.conv.nbytes + layer.ssm.nbytes
            else:
                size += 2 * capacity * layer.k.shape[1] * layer.k.shape[2] * layer.k.element_size()
        return size

    def take(self) -> list | None:
        """A free slot's per-layer state, reset; None when every slot is lent."""
        if not self.free:
            return None
        state = self.states[self.free.pop()]
        for layer in state:
            layer.reset()
        return state

    def give(self, state: list) -> None:
        slot = state[0].slot
        if slot not in self.free:
            self.free.append(slot)

    @staticmethod
    def slots_of(states: list[list]):
        """The slot of each request when every request's state comes from one pool (else None)."""
        firsts = [s[0] for s in states]
        if not firsts or not all(isinstance(f, (SlotKV, SlotGDN)) for f in firsts):
            return None
        pool = _pool_of(firsts[0])
        if any(_pool_of(f) is not pool for f in firsts):
            return None
        return [f.slot for f in firsts]


def _pool_of(layer):
    return layer.pool_ssm if isinstance(layer, SlotGDN) else layer.pool_k


def snapshot(state: list) -> list | None:
    """Copies of what a request's per-layer state holds (attention K/V of its positions, GDN conv and
    recurrent states): what `restore` puts into another request's fresh state. None for states
    holding a ring cache (it keeps a window, not the positions a later request would need)."""
    out = []
    for layer in state:
        if isinstance(layer, GDNState):
            out.append((layer.length, layer.conv.clone(), layer.ssm.clone()))
        elif isinstance(layer, KVCache):
            out.append((layer.length, layer.k[:layer.length].clone(), layer.v[:layer.length].clone()))
        else:
            return None
    return out


def restore(state: list, saved: list) -> None:
    """A fresh state made to hold a snapshot's tokens, copied into its own buffers (in place: a pooled
    slot or a captured graph keeps its addresses)."""
    for layer, (n, a, b) in zip(state, saved):
        if isinstance(layer, GDNState):
            layer.conv.copy_(a)
            layer.ssm.copy_(b)
        else:
            layer.reserve(n)
            layer.k[:n].copy_(a)
            layer.v[:n].copy_(b)
        layer.length = n
