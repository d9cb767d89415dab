"""Per-layer decode state. Attention layers keep K/V; sliding-window layers keep a ring bounded by
the window, not the context; Gated DeltaNet layers keep a conv window and an f32 recurrent state.

Protocol of every per-layer state: `.length` is the number of tokens it has consumed, and
`truncate(n) -> bool` makes it represent exactly the first n tokens if it can (True), or
returns False when it cannot rewind that far (the engine then prefills from scratch)."""

from __future__ import annotations

import itertools
from collections import Counter

import torch

from .errors import KilnError
from .indexcheck import checked


def upload(values, device: torch.device, dtype=torch.long) -> torch.Tensor:
    """Host integers on the device, queued behind the stream's work instead of waiting for it: a
    copy from pageable memory makes the driver wait for the stream (a prefill's token ids would wait
    for the decode step launched before it); a copy from pinned memory does not."""
    t = torch.tensor(values, dtype=dtype)
    if torch.device(device).type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


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
        # a sliding-window layer's window: only the last `window` positions are ever read (a pool keeps those)
        self.window: int | None = None

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

    ring_rows: int | None = None     # a WindowKVCache's rows; None: position p at row p

    def rows_at(self, positions: torch.Tensor) -> torch.Tensor:
        """The buffer rows of `positions` (a device tensor)."""
        return positions

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """K/V [T, KV, D] of positions start .. start + T - 1 written (the length is left as it is)."""
        self._reserve(start + k.shape[0])
        self.k[start:start + k.shape[0]] = k
        self.v[start:start + k.shape[0]] = v

    def ordered(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        """(first, K, V): the positions first .. length - 1 it holds, in order (copies)."""
        return 0, self.k[:self.length].clone(), self.v[:self.length].clone()

    def room(self, t: int) -> int:
        """Positions one attention call of t rows may write and then read back: all of them."""
        return t


class WindowKVCache(KVCache):
    """A sliding-window layer's K/V on a GPU backend: a plain buffer that stops growing at `target`
    rows (window - 1 + a prefill chunk, in whole key blocks of `align`) and from then on wraps:
    position p at row p % rows (`ring_rows`; the attention kernels and the KV append take it:
    kiln/ops/attention/kernels.py). A long context so holds its window and a chunk, not every position.
    A call of up to `chunk` rows writes its keys and reads them with the window's before them (a
    longer one is cut: `room`). Until it wraps it grows as a plain buffer (positions below its rows,
    copied over); after, its address is fixed, and `reserve` grows `capacity` instead, the positions the
    decode kernels' split grid covers, as a plain buffer's would (so the splits, and the bits, are a
    plain buffer's)."""

    def __init__(self, n_kv: int, head_dim: int, window: int, chunk: int, align: int, dtype, device):
        self.target = self.rows_for(window, chunk, align)
        self.align = align
        super().__init__(n_kv, head_dim, dtype, device, capacity=min(self.FIRST, self.target))
        self.window, self.span = window, self.FIRST

    def _alloc(self, cap: int, n_kv: int, head_dim: int, dtype, device) -> torch.Tensor:
        return torch.zeros(cap, n_kv, head_dim, dtype=dtype, device=device)    # rows a window skips load: finite

    FIRST = 256         # a plain buffer's first capacity (span), and so the ring's first rows at most

    @staticmethod
    def rows_for(window: int, chunk: int, align: int, limit: int | None = None) -> int:
        """The rows such a ring holds at most: its window and a chunk in whole key blocks (`target`), or
        under a context of `limit` positions its first rows or that limit in whole blocks, if fewer."""
        target = -(-(window - 1 + chunk) // align) * align
        return target if limit is None else min(target, max(WindowKVCache.FIRST, -(-limit // align) * align))

    @property
    def ring_rows(self) -> int:
        return self.k.shape[0]

    @property
    def capacity(self) -> int:
        return self.span

    def _reserve(self, n: int) -> None:
        if n > self.span:
            self.span = max(n, 2 * self.span if self.limit is None else min(2 * self.span, self.limit))
        rows = min(-(-self.span // self.align) * self.align, self.target)
        if rows > self.k.shape[0]:      # not wrapped yet: every position held sits at its own row
            for name in ("k", "v"):
                old = getattr(self, name)
                new = self._alloc(rows, *old.shape[1:], old.dtype, old.device)
                new[: self.length] = old[: self.length]
                setattr(self, name, new)

    def rows_at(self, positions: torch.Tensor) -> torch.Tensor:
        return positions % self.ring_rows

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        self._reserve(start + k.shape[0])
        t = min(k.shape[0], self.ring_rows)      # a longer call's first rows are overwritten by its last
        rows = torch.arange(start + k.shape[0] - t, start + k.shape[0], device=self.k.device) % self.ring_rows
        self.k.index_copy_(0, rows, k[k.shape[0] - t:])
        self.v.index_copy_(0, rows, v[v.shape[0] - t:])

    def ordered(self) -> tuple[int, torch.Tensor, torch.Tensor]:
        first = max(0, self.length - self.ring_rows)
        rows = torch.arange(first, self.length, device=self.k.device) % self.ring_rows
        return first, self.k.index_select(0, rows), self.v.index_select(0, rows)

    def update(self, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor):
        """Append [T, KV, D] at `positions` (from self.length); return the keys, values and key
        positions the chunk's queries see: the window before it, then the chunk."""
        start = self.length
        lo = max(0, start - self.window + 1)      # the ring holds these: it has window - 1 rows or more
        rows = torch.arange(lo, start, device=self.k.device) % self.ring_rows
        keys = torch.cat([self.k.index_select(0, rows), k])
        values = torch.cat([self.v.index_select(0, rows), v])
        self.write(k, v, start)
        self.length = start + k.shape[0]
        return keys, values, torch.arange(lo, self.length, device=k.device)

    def room(self, t: int) -> int:
        return min(t, self.target - self.window + 1)

    def truncate(self, n: int) -> bool:
        """Forget positions >= n, where the ring still holds the window before n."""
        if n > self.length or max(0, n - self.window + 1) < self.length - self.ring_rows:
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
    # each row's K/V row in a paged pool's stores through each table, by id(table) (SlotPool.flat_rows_all):
    # computed once a step for every layer
    flat: dict | None = None
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


PAGE = 128   # K/V positions a page of a SlotPool holds (a multiple of every decode variant's keys a step)


def pages_for(tokens: int) -> int:
    return -(-tokens // PAGE)


def ring_pages(window: int | None, capacity: int) -> int:
    """Pages a sliding-window layer's ring holds a request: its window and a page more (a step of keys
    aligned down may read up to a page before the window: those rows must be finite, not current); 0
    (no ring: a page for every position) where that saves nothing."""
    ring = pages_for(window) + 1 if window else 0
    return ring if ring < pages_for(capacity) else 0


class PagedKV(KVCache):
    """Slot `slot`'s K/V in a SlotPool (kiln.cache.SlotPool): pages of PAGE positions in the pool's
    stores [pages * PAGE, KV, D] (pool_k, pool_v; one pair a layer), found through the slot's row of a
    block table (`table`). A batched decode step reads and writes them there (the kernels take the
    table). Where the slot's pages are one run of consecutive pages (the pool takes them so where it
    can; the scratch slot's always are), `k` and `v` are views of that run, a plain KV buffer to every
    other op; else its K/V are read and written as rows (`read`, `write`), and an op that wants them
    whole gets a contiguous copy (`stage`).

    A sliding-window layer (`ring` > 0) keeps only a ring of `ring` pages a slot: position p at
    page p // PAGE mod ring (its table row repeats the ring), so a request's window layers hold the
    same few pages however long it runs; positions before the window are overwritten, and the window
    kernels never read them (a masked key still loads: every row stays finite)."""

    def __init__(self, pool: "SlotPool", layer: int, slot: int, ring: int = 0, window: int | None = None):
        self.head_major, self.limit, self.length, self.window = False, pool.capacity, 0, window
        self.pool, self.layer, self.slot = pool, layer, slot
        self.ring = 0 if slot == pool.count else ring      # the scratch is one plain buffer of the capacity
        self.keeps = ring * PAGE if ring else pool.capacity   # positions a lent slot of this layer keeps
        self.pool_k, self.pool_v = pool.k_stores[layer], pool.v_stores[layer]
        # the layer's table, the scratch's too (a ring table's scratch row runs over the capacity in order)
        self.table = pool.ring_tables[ring] if ring else pool.table

    def bind(self, pages: list[int]) -> None:
        """The slot's pages now `pages`: k and v views of them where they run in order, else none. A
        ring is such a run while the request fits in it (its positions never wrap)."""
        if self.ring and len(pages) <= self.ring:
            pages = list(range(self.pool.ring_base(self.ring, self.slot), self.pool.ring_base(self.ring, self.slot)
                               + len(pages)))
        elif self.ring:
            pages = []
        if pages and pages == list(range(pages[0], pages[-1] + 1)):
            a, b = pages[0] * PAGE, (pages[-1] + 1) * PAGE
            self.k, self.v = self.pool_k[a:b], self.pool_v[a:b]
        else:
            self.__dict__.pop("k", None)
            self.__dict__.pop("v", None)

    @property
    def contiguous(self) -> bool:
        return "k" in self.__dict__

    def __getattr__(self, name):     # k and v of a slot whose pages do not run in order
        if name in ("k", "v"):
            raise KilnError("a paged KV slot is read through its block table (PagedKV.read/write, or staged)")
        raise AttributeError(name)

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def kept(self) -> int:
        """Positions this slot's pages keep (a ring: its last ring * PAGE; else every one)."""
        return self.ring * PAGE if self.ring else self.pool.capacity

    def _reserve(self, n: int) -> None:
        if n > self.pool.held(self.slot) * PAGE:
            raise KilnError(f"a pooled KV slot holds {self.pool.held(self.slot) * PAGE} positions, {n} asked for")

    def rows(self, start: int, count: int) -> torch.Tensor:
        """The stores' rows (device int64 [count]) of positions start .. start + count - 1."""
        return self.pool.rows(self.table, self.slot, start, count)

    def read(self, n: int, first: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V at positions first .. n - 1, [n - first, KV, D] each."""
        rows = self.rows(first, n - first)
        rows = checked(rows, self.pool_k.shape[0], "kv_rows")
        return self.pool_k.index_select(0, rows), self.pool_v.index_select(0, rows)

    def read_whole(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Copies of K and V at every position it holds, [length, KV, D] each; a ring's positions before
        those it keeps are zeros (a window never reads them)."""
        first = max(0, self.length - self.kept)
        k, v = self.read(self.length, first)
        if first:
            k, v = (torch.cat([t.new_zeros((first, *t.shape[1:])), t]) for t in (k, v))
        return k, v

    def held_bytes(self) -> int:
        """The bytes of the pages this slot holds in this layer (a ring's, or its share of the pages)."""
        pages = self.ring or self.pool.held(self.slot)
        return 2 * pages * PAGE * self.pool_k[0].numel() * self.pool_k.element_size()

    def write(self, k: torch.Tensor, v: torch.Tensor, start: int) -> None:
        """K and V [T, KV, D] at positions start .. start + T - 1 (of a ring, the last it keeps)."""
        self._reserve(start + k.shape[0])
        if (cut := k.shape[0] - self.kept) > 0:
            k, v, start = k[cut:], v[cut:], start + cut
        rows = self.rows(start, k.shape[0])
        self.pool_k.index_copy_(0, rows, k)
        self.pool_v.index_copy_(0, rows, v)


class SlotGDN(GDNState):
    """A GDNState whose conv and recurrent states are slot `slot` of pools [S, K, C] and [S, Hv, dk, dv]."""

    def __init__(self, pool_conv: torch.Tensor, pool_ssm: torch.Tensor, slot: int):
        self.pool_conv, self.pool_ssm, self.slot = pool_conv, pool_ssm, slot
        self.conv, self.ssm = pool_conv[slot], pool_ssm[slot]
        self.length = 0

    def held_bytes(self) -> int:
        return self.conv.nbytes + self.ssm.nbytes


class PagedPrefix:
    """The state of a prompt prefix of n tokens kept by a pool without copying its K/V: its pages
    (counted as held, so they outlive the request), and copies of what is not paged as positions: the
    GDN states and the sliding-window layers' rings (their last positions), each of fixed size."""

    def __init__(self, pool: "SlotPool", n: int, pages: list[int], copies: list):
        self.pool, self.n, self.pages, self.copies = pool, n, pages, copies

    def release(self) -> None:
        self.pool.drop(self.pages)
        self.pages = []

    def snapshot(self) -> list:
        """Copies of it in `snapshot`'s form, for a request whose state is not of the pool (a ring's
        positions before its window zeros: never read)."""
        pos = torch.arange(self.n, device=self.pool.table.device)
        rows = torch.tensor(self.pages, dtype=torch.long, device=pos.device)[pos // PAGE] * PAGE + pos % PAGE
        copies, out = iter(self.copies), []
        for layer, mine in zip(self.pool.scratch, self.pool.states[0]):
            if isinstance(layer, GDNState):
                out.append((self.n, *next(copies)))
            elif mine.ring:
                first, k, v = next(copies)
                full = [torch.zeros((self.n, *t.shape[1:]), dtype=t.dtype, device=t.device) for t in (k, v)]
                full[0][first:], full[1][first:] = k, v
                out.append((self.n, *full))
            else:
                out.append((self.n, layer.pool_k.index_select(0, rows), layer.pool_v.index_select(0, rows)))
        return out


class SlotPool:
    """The decode state of up to `slots` requests at once. GDN conv and recurrent states: one pooled
    tensor [slots + 1, ...] a layer, a slot each. K/V: paged. Each attention layer keeps two stores of
    pages of PAGE positions; a request holds the pages its positions so far need (`pages` are shared
    by the slots; its prompt's taken when it starts, one more each PAGE tokens it makes: `grow`),
    listed in its slot's row of the block table (`table`, int32 [slots + 1, capacity / PAGE] on the
    device), so that a batched decode step updates every request's state in one launch a layer. A
    page may be held by several: a prompt prefix kept for later requests (`share`) is given to them
    as is (`adopt`), not copied. A sliding-window layer (KVCache.window) keeps a ring of ring_pages()
    pages a slot instead, fixed, with tables of their own (`ring_tables`, by ring size).
    `take(tokens)` lends a slot (None while no slot or not enough pages are free), `give(state)`
    returns it. Slot `count` is the scratch, never lent: the spare rows of a captured batch step and
    the prefill graphs use it; its pages are the stores' first capacity / PAGE, in order (one plain
    buffer, windowed layers too). Layers of other kinds (ring caches) make a pool impossible:
    `poolable` says so first."""

    def __init__(self, template: list, slots: int, capacity: int, pages: int | None = None):
        self.width = pages_for(capacity)
        self.capacity, self.count = self.width * PAGE, slots
        self.pages = slots * self.width if pages is None else pages     # for lent slots (the scratch's apart)
        total = self.width + self.pages
        self.free = list(range(slots - 1, -1, -1))
        self.free_pages = list(range(total - 1, self.width - 1, -1))
        self.refs = [0] * total
        self._held: dict[int, list[int]] = {}
        kv = [layer for layer in template if type(layer) is not GDNState]
        rings = [ring_pages(layer.window, self.capacity) for layer in kv]
        sizes = [(self.width + slots * r if r else total) * PAGE for r in rings]   # no stray NaN bits: zeros
        self.k_stores = [layer.k.new_zeros((n, *layer.k.shape[1:])) for layer, n in zip(kv, sizes)]
        self.v_stores = [layer.v.new_zeros((n, *layer.v.shape[1:])) for layer, n in zip(kv, sizes)]
        device = kv[0].k.device if kv else torch.device("cpu")
        self.table = torch.zeros((slots + 1, self.width), dtype=torch.int32, device=device)
        self.table[slots] = torch.arange(self.width, dtype=torch.int32, device=device)
        self.ring_tables = {r: self._ring_table(r, device) for r in set(rings) - {0}}
        self.states: list[list] = [[] for _ in range(slots + 1)]
        i = 0
        for layer in template:
            if type(layer) is GDNState:
                conv = layer.conv.new_zeros((slots + 1, *layer.conv.shape))
                ssm = layer.ssm.new_zeros((slots + 1, *layer.ssm.shape))
                made = [SlotGDN(conv, ssm, s) for s in range(slots + 1)]
            else:
                made = [PagedKV(self, i, s, rings[i], layer.window) for s in range(slots + 1)]
                i += 1
            for s in range(slots + 1):
                self.states[s].append(made[s])
        for layer in self.scratch:       # its pages: the stores' first, in order
            if isinstance(layer, PagedKV):
                layer.bind(list(range(self.width)))

    def ring_base(self, ring: int, slot: int) -> int:
        """The first of slot `slot`'s `ring` pages in a windowed layer's stores (after the scratch's)."""
        return self.width + slot * ring

    def _ring_table(self, ring: int, device) -> torch.Tensor:
        """Each slot's row: its ring's pages over and over (position p at page p // PAGE mod ring)."""
        j = torch.arange(self.width)
        rows = [self.ring_base(ring, s) + j % ring for s in range(self.count)] + [j]
        return torch.stack(rows).to(torch.int32).to(device)

    @property
    def scratch(self) -> list:
        """The spare slot's state (slot `count`): never lent."""
        return self.states[self.count]

    @staticmethod
    def poolable(template: list) -> bool:
        return all(type(layer) is GDNState or (type(layer) in (KVCache, WindowKVCache) and not layer.head_major)
                   for layer in template)

    @staticmethod
    def bytes_per_slot(template: list, capacity: int, rings: bool = True) -> int:
        """A lent slot's bytes when its requests hold `capacity` positions (a windowed layer its ring,
        unless `rings` is False: the scratch slot's)."""
        size = 0
        for layer in template:
            if type(layer) is GDNState:
                size += layer.conv.nbytes + layer.ssm.nbytes
            else:
                ring = ring_pages(layer.window, capacity) if rings else 0
                kept = min(capacity, ring * PAGE) if ring else capacity
                size += 2 * kept * layer.k.shape[1] * layer.k.shape[2] * layer.k.element_size()
        return size

    @staticmethod
    def ring_bytes(template: list, capacity: int) -> int:
        """A lent slot's bytes that do not depend on the pages it holds: GDN states and windowed layers' rings."""
        return SlotPool.bytes_per_slot(template, capacity) - capacity * SlotPool.page_bytes(template, capacity) // PAGE

    @staticmethod
    def page_bytes(template: list, capacity: int) -> int:
        """The bytes of a page of the shared pages (the full layers' stores; windowed layers keep rings)."""
        return sum(2 * PAGE * layer.k.shape[1] * layer.k.shape[2] * layer.k.element_size() for layer in template
                   if type(layer) is not GDNState and not ring_pages(layer.window, capacity))

    def held(self, slot: int) -> int:
        """Pages slot `slot` holds."""
        return self.width if slot == self.count else len(self._held.get(slot, ()))

    def check(self, table: bool = True) -> None:
        """Raise AssertionError where the books disagree: a held page out of range or counted fewer
        times than slots hold it (slots share an adopted prefix's pages, each counted), a free page
        still counted or listed twice, or a table row (read from the device: a sync) not listing its
        slot's pages."""
        total, held = len(self.refs), [p for pages in self._held.values() for p in pages]
        assert all(self.width <= p < total for p in held + self.free_pages), "a page out of range"
        assert all(self.refs[p] >= n for p, n in Counter(held).items()), "a held page counted too few times"
        assert len(self.free_pages) == len(set(self.free_pages)), "a page freed twice"
        assert not set(held) & set(self.free_pages), "a held page listed free"
        assert all(self.refs[p] == 0 for p in self.free_pages), "a free page still counted"
        rows = self.table.tolist() if table else {}
        for slot, pages in self._held.items() if table else ():
            assert rows[slot][: len(pages)] == pages, f"slot {slot}'s table row is not its pages"

    def fits(self, tokens: int) -> bool:
        """Whether a request of `tokens` positions can ever hold its pages here."""
        return tokens <= self.capacity and pages_for(tokens) <= self.pages

    def take(self, tokens: int | None = None, spare: int = 0) -> list | None:
        """A free slot's per-layer state, reset, holding the pages of `tokens` positions (default: the
        capacity; `grow` adds more as it runs); None while every slot is lent or fewer than those
        pages and `spare` more are free (the pages running requests will grow into first)."""
        need = pages_for(self.capacity if tokens is None else max(tokens, 1))
        if not self.free or need + spare > len(self.free_pages):
            return None
        slot = self.free.pop()
        self._set_pages(slot, self._alloc(need))
        state = self.states[slot]
        for layer in state:
            layer.reset()
        return state

    def grow(self, state: list, tokens: int) -> bool:
        """A lent slot made to hold `tokens` positions (up to the capacity): the pages it lacks added
        after its own (the next page of its run where that one is free, so its K/V stay one buffer);
        False, nothing taken, while too few pages are free."""
        slot = state[0].slot
        mine = self._held[slot]
        need = pages_for(min(tokens, self.capacity)) - len(mine)
        if need <= 0:
            return True
        if need > len(self.free_pages):
            return False
        self._set_pages(slot, mine + self._alloc(need, after=mine[-1] if mine else None))
        return True

    def give(self, state: list) -> None:
        slot = state[0].slot
        if slot not in self.free:
            self.free.append(slot)
            self.drop(self._held.pop(slot, []))

    def _alloc(self, need: int, after: int | None = None) -> list[int]:
        """`need` free pages, held once: the ones right after page `after` where they are free, else
        consecutive ones where the free pages have such a run (the slot's K/V then read as one
        buffer by every op: no copies), else the lowest free ones."""
        follow = [] if after is None else list(range(after + 1, after + 1 + need))
        if follow and all(self.width <= p < len(self.refs) and self.refs[p] == 0 for p in follow):
            for page in follow:          # a request growing by its next page: no sort of the free list
                self.free_pages.remove(page)
                self.refs[page] = 1
            return follow
        free = sorted(self.free_pages)
        start = next((i for i in range(len(free) - need + 1) if free[i + need - 1] - free[i] == need - 1), None)
        pages = free[start: start + need] if start is not None else free[:need]
        taken = set(pages)
        self.free_pages = [p for p in self.free_pages if p not in taken]
        for page in pages:
            self.refs[page] = 1
        return pages

    def drop(self, pages: list[int]) -> None:
        """Each page held once less; a page no one holds is free again."""
        for page in pages:
            self.refs[page] -= 1
            if self.refs[page] == 0:
                self.free_pages.append(page)

    def _set_pages(self, slot: int, pages: list[int]) -> None:
        self._held[slot] = pages
        row = pages + [0] * (self.width - len(pages))      # past a request's pages: never read
        self.table[slot].copy_(upload(row, self.table.device, torch.int32))
        for layer in self.states[slot]:
            if isinstance(layer, PagedKV):
                layer.bind(pages)

    @staticmethod
    def rows(table: torch.Tensor, slot: int, start: int, count: int) -> torch.Tensor:
        """The stores' rows of slot `slot`'s positions start .. start + count - 1 through `table` (device int64)."""
        pos = torch.arange(start, start + count, device=table.device)
        return table[slot].long()[pos // PAGE] * PAGE + pos % PAGE

    def flat_rows_all(self, slots: torch.Tensor, positions: torch.Tensor) -> dict:
        """flat_rows through each of the pool's tables, by id(table) (StateBatch.flat): once a step."""
        return {id(t): self.flat_rows(slots, positions, t) for t in (self.table, *self.ring_tables.values())}

    def flat_rows(self, slots: torch.Tensor, positions: torch.Tensor, table: torch.Tensor | None = None):
        """The stores' row of each batch row's position (slots, positions: device tensors [B]) through
        `table` (default: the full layers'); CUDA-graph safe."""
        table = self.table if table is None else table
        return table[slots.long(), positions // PAGE].long() * PAGE + positions % PAGE

    def share(self, state: list, n: int) -> PagedPrefix:
        """The state after its first n tokens, kept without copying K/V: its first pages_for(n) pages
        held once more (the request appends past n only, so they stay as they are up to n); copies of
        its GDN states and of its rings' last positions."""
        pages = self._held[state[0].slot][: pages_for(n)]
        for page in pages:
            self.refs[page] += 1
        copies = []
        for layer in state:
            if isinstance(layer, GDNState):
                copies.append((layer.conv.clone(), layer.ssm.clone()))
            elif isinstance(layer, PagedKV) and layer.ring:
                first = max(0, n - layer.kept)
                copies.append((first, *layer.read(n, first)))
        return PagedPrefix(self, n, pages, copies)

    def adopt(self, state: list, prefix: PagedPrefix) -> None:
        """A freshly taken state made to hold the prefix: its whole pages the prefix's own (its pages
        there given back), the rows of a partly filled last page copied, the GDN states and rings copied."""
        slot, n = state[0].slot, prefix.n
        mine, whole = self._held[slot], n // PAGE
        self.drop(mine[:whole])
        for page in prefix.pages[:whole]:
            self.refs[page] += 1
        pages = prefix.pages[:whole] + mine[whole:]
        self._set_pages(slot, pages)
        if n % PAGE:        # (two distinct pages: the ranges do not overlap)
            src, dst, r = prefix.pages[whole] * PAGE, pages[whole] * PAGE, n % PAGE
            for layer in state:
                if isinstance(layer, PagedKV) and not layer.ring:
                    for store in (layer.pool_k, layer.pool_v):
                        store[dst: dst + r].copy_(store[src: src + r])
        copies = iter(prefix.copies)
        for layer in state:
            if isinstance(layer, GDNState):
                conv, ssm = next(copies)
                layer.conv.copy_(conv)
                layer.ssm.copy_(ssm)
            elif isinstance(layer, PagedKV) and layer.ring:
                first, k, v = next(copies)
                layer.write(k, v, first)
            layer.length = n

    @staticmethod
    def slots_of(states: list[list]):
        """The slot of each request when every request's state comes from one pool (else None)."""
        firsts = [s[0] for s in states]
        if not firsts or not all(isinstance(f, (PagedKV, SlotGDN)) for f in firsts):
            return None
        pool = _pool_of(firsts[0])
        if any(_pool_of(f) is not pool for f in firsts):
            return None
        return [f.slot for f in firsts]


def paged(state: list) -> bool:
    """Whether a request's state holds K/V in pages that do not run in order (read and written as rows only)."""
    return any(isinstance(layer, PagedKV) and not layer.contiguous for layer in state)


def stage(state: list, upto: int) -> list:
    """A request's state for ops that read K/V contiguously (a prefill, a decode step run request by
    request): each paged layer a plain KVCache of room `upto` holding copies of its positions."""
    out = []
    for layer in state:
        if isinstance(layer, PagedKV) and not layer.contiguous:
            k, v = layer.read_whole()
            flat = KVCache(k.shape[1], k.shape[2], k.dtype, k.device, capacity=max(upto, layer.length, 1))
            flat.k[: layer.length], flat.v[: layer.length] = k, v
            flat.length, flat.limit, flat.window = layer.length, layer.capacity, layer.window
            layer = flat
        out.append(layer)
    return out


def unstage(state: list, staged: list) -> None:
    """The positions a staged state gained written back into the request's pages."""
    for layer, flat in zip(state, staged):
        if flat is not layer:
            n = layer.length
            layer.write(flat.k[n: flat.length], flat.v[n: flat.length], n)
            layer.length = flat.length


def _pool_of(layer):
    return layer.pool_ssm if isinstance(layer, SlotGDN) else layer.pool


def snapshot(state: list) -> list | None:
    """Copies of what a request's per-layer state holds (attention K/V of its positions, GDN conv and
    recurrent states): what `restore` puts into another request's fresh state. None for states
    holding a RingKVCache (the reference's: it keeps a window, not the positions a later request would
    need). A WindowKVCache's holds the positions its ring keeps (the last ones, enough for the window)."""
    out = []
    for layer in state:
        if isinstance(layer, GDNState):
            out.append((layer.length, layer.conv.clone(), layer.ssm.clone()))
        elif isinstance(layer, PagedKV) and not layer.contiguous:
            out.append((layer.length, *layer.read_whole()))
        elif isinstance(layer, KVCache):
            out.append((layer.length, *layer.ordered()[1:]))
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
        else:       # the last positions up to n (a ring's snapshot holds only those)
            if not (isinstance(layer, PagedKV) and not layer.contiguous):    # (a slot's pages are taken)
                layer.reserve(n)
            layer.write(a, b, n - a.shape[0])
        layer.length = n
