"""Expert streaming (docs/streaming.md): a MoE model's routed experts homed in host memory or on disk
(a packed directory's experts/layer_XXX.bin), a per-layer cache of expert slots on the compute
device, and the policy that picks what a slot holds.

Only placement changes: each slot holds a bit-exact copy of the expert the resident model holds (the
same dtype conversions as the load), and the MoE ops add the experts in ascending id as they do
resident, so a streamed run gives the resident run's logits bit for bit on the same backend.

Policies (per layer, `slots` experts):
- lru: a miss evicts the expert used least recently.
- lfu: a miss evicts the expert used in the fewest steps, the least recent among equals.
- static: a hot set from a routing profile fills the slots once and stays; misses go through
  `slots` scratch slots, reloaded every step.
- os: no cache of kiln's own: every needed expert is copied every step (the page cache caches).
A step needing more experts than the slots hold runs in batches of ascending ids.

Zero-copy (a backend whose MoE kernels take a table of slots and host stacks, a few rows a call:
decode). Homed in pinned host memory: a device table maps each expert to its slot or its place in
host memory, the backend fetches the misses over the link inside the step (no host round trip: the
decode runs as a CUDA graph); the layer's ids reach the host without a sync, and at its next call the
policy counts them and promotes (`SlotCache.admit`): lru any miss, lfu a miss used more often than
the least used cached expert. Homed on disk: the misses are read straight into pinned staging that
the kernels read, then the policy counts and promotes the same way.
"""

from __future__ import annotations

import errno
import mmap
import os
import sys
import threading
import time
from collections import Counter, deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..errors import KilnError
from .packed import DTYPES, align, check_file, read_manifest
from .quantized import QuantizedWeight
from .synth import parse_spec, quant_format

POLICIES = ("lfu", "lru", "static", "os")
SCRATCH = 16    # static's scratch slots at most (a token's misses, up to 10 in the 397B: decode fits them)
TRACE = 1 << 16         # MoE calls the store remembers the routing of (tests replay it; a long run forgets)
# A staged read's most bytes: a decode layer's few misses (about 5) read in pieces spread over every
# I/O thread, not one thread a miss (bench/disk_reads.py)
PIECE = 1 << 20
STACKS = ("experts.gate_up_proj", "experts.down_proj")


# -- which slot holds which expert: the policy, pure bookkeeping ------------------------------------

class SlotCache:
    """One layer's slots: expert -> slot, use counts and recency, and the policy's choice of victim.
    `plan(batch)` (ascending ids, every one needed this step) returns the slot of each and the
    (expert, slot) loads it takes."""

    def __init__(self, slots: int, policy: str, hot: list[int] | None = None):
        if policy not in POLICIES:
            raise KilnError(f"expert policy must be one of {', '.join(POLICIES)}, not {policy!r}")
        if slots < 1:
            raise KilnError(f"expert cache slots must be at least 1, got {slots}")
        self.policy, self.slots = policy, slots
        self.slot_of: dict[int, int] = {}           # cached experts (lru, lfu, static's hot set)
        self.uses: Counter = Counter()
        self.last: dict[int, int] = {}
        self.clock = 0
        self.hot = list(hot or [])[:slots] if policy == "static" else []
        self.scratch = min(slots, SCRATCH) if policy == "static" else 0

    @property
    def capacity(self) -> int:
        """Slots a stack needs: the cache, plus static's scratch (as many again, at most SCRATCH)."""
        return self.slots + self.scratch

    def batches(self, needed: list[int]) -> list[list[int]]:
        """needed (ascending) cut into runs whose loads fit: `slots` experts a run (lru, lfu, os), or
        (static) any number of the hot set's and `scratch` others (the scratch slots)."""
        if self.policy != "static":
            return [needed[i: i + self.slots] for i in range(0, len(needed), self.slots)]
        out, cur, loads = [], [], 0
        for e in needed:
            miss = e not in self.slot_of
            if miss and loads == self.scratch:
                out.append(cur)
                cur, loads = [], 0
            cur.append(e)
            loads += miss
        return out + ([cur] if cur else [])

    def plan(self, batch: list[int]) -> tuple[dict[int, int], list[tuple[int, int]]]:
        self.clock += 1
        for e in batch:
            self.uses[e] += 1
            self.last[e] = self.clock
        if self.policy == "os":
            where = {e: i for i, e in enumerate(batch)}
            return where, list(where.items())
        if self.policy == "static":
            where, loads, scratch = {}, [], self.slots
            for e in batch:
                if e in self.slot_of:
                    where[e] = self.slot_of[e]
                else:
                    where[e] = scratch
                    loads.append((e, scratch))
                    scratch += 1
            return where, loads
        loads = []
        taken = set(self.slot_of.values())
        free = [s for s in range(self.slots) if s not in taken]
        for e in batch:
            if e in self.slot_of:
                continue
            if not free:
                victim = min((x for x in self.slot_of if x not in batch), key=self._rank)
                free.append(self.slot_of.pop(victim))
            self.slot_of[e] = free.pop(0)
            loads.append((e, self.slot_of[e]))
        return {e: self.slot_of[e] for e in batch}, loads

    def admit(self, needed: list[int]) -> tuple[int, list[tuple[int, int, int | None]]]:
        """Zero-copy: a step that read its misses in place (one tick of the clock). Returns its hits and
        the promotions (expert, slot, evicted expert or None) into slots for the steps after: a free
        slot first; then lru any miss, evicting the least recent cached expert not needed this step;
        lfu a miss used more often than the least used such expert (most used misses first); static
        and os none."""
        self.clock += 1
        for e in needed:
            self.uses[e] += 1
            self.last[e] = self.clock
        hits = sum(e in self.slot_of for e in needed)
        if self.policy in ("static", "os"):
            return hits, []
        missing = [e for e in needed if e not in self.slot_of]
        if self.policy == "lfu":
            missing.sort(key=lambda e: (-self.uses[e], e))
        free = sorted(set(range(self.slots)) - set(self.slot_of.values()))
        promos = []
        for e in missing:
            victim = None
            if not free:
                victim = min((x for x in self.slot_of if x not in needed), key=self._rank, default=None)
                if victim is None or (self.policy == "lfu" and self.uses[e] <= self.uses[victim]):
                    break
                free.append(self.slot_of.pop(victim))
            self.slot_of[e] = free.pop(0)
            promos.append((e, self.slot_of[e], victim))
        return hits, promos

    def _rank(self, e: int) -> tuple:
        """The victim is the lowest: lru the oldest use, lfu the fewest uses then the oldest; ties
        (experts of one batch share a clock tick) to the lower id."""
        return (self.last[e], e) if self.policy == "lru" else (self.uses[e], self.last[e], e)

    def preload(self) -> list[tuple[int, int]]:
        """static: the hot set's (expert, slot) loads, once."""
        for s, e in enumerate(self.hot):
            self.slot_of[e] = s
        return [(e, s) for s, e in enumerate(self.hot)]


# -- where an expert's bytes come from: host memory or a packed directory's layer file -------------

@dataclass
class HostHome:
    """A layer's stacks in host memory, already in the run's dtypes (pinned where CUDA is). `rows`:
    the stacks hold only these experts, expert e at row rows[e] (the static policy's hot set lives
    in its device slots alone: ExpertStore.compact); None: every expert, e at row e."""
    stacks: dict[str, object]       # stack name -> [E, ...] tensor or QuantizedWeight
    rows: dict[int, int] | None = None

    tier = "host"

    def row(self, e: int) -> int:
        return e if self.rows is None else self.rows[e]

    def read(self, e: int) -> dict[str, object]:
        r = self.row(e)
        return {n: w[r] for n, w in self.stacks.items()}

    def nbytes(self) -> int:
        w = next(iter(self.stacks.values()))
        return sum(x.nbytes for x in self.stacks.values()) // (w.shape[0] if w.shape else 1)


@dataclass
class DiskHome:
    """A packed directory's layer file: expert e's blob of `stride` bytes at e * stride, its parts at
    fixed offsets (docs/format.md), read with pread; the file must stay as it was when opened."""
    path: Path
    stride: int
    count: int
    records: dict[str, dict]        # stack name -> the manifest's tensor record
    convert: object                 # the load's dtype rule: stored -> as the model holds it
    sha256: str | None = None       # checked once, at the first read (the load's --verify lazy or full)
    direct: bool = False            # O_DIRECT: past the page cache (the stride and offsets are 4 KiB-aligned)
    fd: int = -1
    ident: tuple = ()
    lock: threading.Lock = field(default_factory=threading.Lock)
    plans: dict = field(default_factory=dict)   # reads()' calls by destination

    tier = "disk"

    def open(self) -> None:
        with self.lock:
            if self.fd < 0:
                self._open()

    def _open(self) -> None:
        if self.sha256 is not None:
            check_file(self.path, self.sha256)
        try:
            self.fd = os.open(self.path, os.O_RDONLY | (os.O_DIRECT if self.direct else 0))
        except OSError as e:
            if self.direct and e.errno == errno.EINVAL:
                raise KilnError(f"{self.path}: this file system does not take direct I/O (O_DIRECT): "
                                f"drop --direct-io") from None
            raise KilnError(f"{self.path}: cannot open ({e.strerror})") from None
        st = os.fstat(self.fd)
        self.ident = (st.st_size, st.st_mtime_ns, st.st_ino)
        if st.st_size < self.count * self.stride:
            raise KilnError(f"{self.path}: {st.st_size} bytes, {self.count} experts of {self.stride} need "
                            f"{self.count * self.stride} (the file is cut short: run kiln verify)")

    def check(self) -> None:
        st = os.fstat(self.fd)
        if (st.st_size, st.st_mtime_ns, st.st_ino) != self.ident:
            raise KilnError(f"{self.path}: the expert file changed during the run (size or time differs from "
                            f"when it was opened): run kiln verify, then load again")

    def read(self, e: int) -> dict[str, object]:
        """Expert e's stacks as the model holds them: one read of its blob into this thread's buffer
        (page-aligned, as direct I/O needs), then its parts converted (copies: the buffer is reused)."""
        return {name: self.convert(stored) for name, stored in self._stored(e).items()}

    def read_into(self, e: int, dest: dict[str, object]) -> None:
        """Expert e's stacks copied into `dest` (name -> one expert's tensors, e.g. a pinned staging
        slot, typed as read() would give them: the copy converts as it does)."""
        with torch.inference_mode():    # (per thread: the staging was made in the forward's)
            for name, stored in self._stored(e).items():
                _copy_into_slot(dest[name], stored)

    def reads(self, e: int, dest: dict[str, object]) -> list[tuple[int, list[memoryview]]] | None:
        """Expert e's blob straight into `dest` (name -> one expert's tensors, as read_into takes), as
        preadv calls (file offset, buffers) of up to PIECE bytes, each over a run of the file with no
        gap; None where a part is not held as stored (another dtype or shape, not a contiguous host
        tensor) or the file is read with direct I/O (its buffers must be page-aligned). The calls are
        worked out once a destination (the staging slots stay: its buffers keep them alive)."""
        if self.direct:
            return None
        key = tuple(t.data_ptr() for w in dest.values()
                    for t in ((w.packed, w.scales, w.biases) if isinstance(w, QuantizedWeight) else (w,)))
        if key not in self.plans:
            self.plans[key] = self._reads(dest)
        plan = self.plans[key]
        return None if plan is None else [(e * self.stride + at, views) for at, views in plan]

    def _reads(self, dest: dict[str, object]) -> list[tuple[int, list[memoryview]]] | None:
        runs = []
        for name, rec in self.records.items():
            held = dest[name]
            tensors = ({"weight": held.packed, "scales": held.scales, "biases": held.biases}
                       if isinstance(held, QuantizedWeight) else {"tensor": held})
            for part, p in rec["parts"].items():
                t = tensors.get(part)
                if (t is None or t.dtype != DTYPES[p["dtype"]] or list(t.shape) != list(p["shape"])
                        or t.device.type != "cpu" or not t.is_contiguous()):
                    return None
                runs.append((p["offset"], memoryview(t.reshape(-1).view(torch.uint8).numpy())))
        reads: list[tuple[int, list[memoryview]]] = []
        end = size = -1
        for at, view in sorted(runs, key=lambda r: r[0]):
            while len(view):
                if at != end or size >= PIECE:
                    reads.append((at, []))
                    size = 0
                take = view[:PIECE - size]
                reads[-1][1].append(take)
                view, at, size, end = view[len(take):], at + len(take), size + len(take), at + len(take)
        return reads

    def read_piece(self, e: int, at: int, views: list[memoryview]) -> None:
        """One of reads()' preadv calls (expert e's, for the error)."""
        want = sum(len(v) for v in views)
        try:
            got = os.preadv(self.fd, views, at)
        except OSError as err:
            raise KilnError(f"{self.path}: reading expert {e} failed ({err.strerror})") from None
        if got != want:
            raise KilnError(f"{self.path}: expert {e} is cut short ({got} of {want} bytes at {at}): the file "
                            f"was truncated (run kiln verify)")

    def _stored(self, e: int) -> dict[str, object]:
        """Expert e's parts as stored: views of this thread's buffer, valid until its next read."""
        self.open()
        view = _buffer(self.stride)
        try:
            got = os.preadv(self.fd, [view], e * self.stride)
        except OSError as err:
            raise KilnError(f"{self.path}: reading expert {e} failed ({err.strerror})") from None
        if got != self.stride:
            raise KilnError(f"{self.path}: expert {e} is cut short ({got} of {self.stride} bytes at "
                            f"{e * self.stride}): the file was truncated (run kiln verify)")
        buf = torch.frombuffer(view, dtype=torch.uint8)
        out = {}
        for name, rec in self.records.items():
            parts = {k: _part(buf, p) for k, p in rec["parts"].items()}
            if "quant" in rec:
                q = rec["quant"]
                stored = QuantizedWeight(parts["weight"], parts["scales"], parts["biases"], q["bits"],
                                         q["group_size"], DTYPES[q["out_dtype"]] if "out_dtype" in q else None)
            else:
                stored = parts["tensor"]
            out[name] = stored
        return out

    def nbytes(self) -> int:
        return self.stride


_BUFFERS = threading.local()


def _buffer(size: int) -> memoryview:
    """This thread's read buffer of `size` bytes: anonymous memory (page-aligned), kept for the next
    read; one a thread whatever the layers."""
    mm = getattr(_BUFFERS, "mm", None)
    if mm is None or len(mm) < size:
        _BUFFERS.mm = mm = mmap.mmap(-1, align(size, mmap.PAGESIZE))
    return memoryview(mm)[:size]


def _part(buf: torch.Tensor, p: dict) -> torch.Tensor:
    dtype = DTYPES[p["dtype"]]
    return buf[p["offset"]: p["offset"] + p["nbytes"]].view(dtype).view(tuple(p["shape"]))


def _empty_like_stack(w, count: int, device, pin: bool = False):
    """Slots: `count` experts shaped and typed like one expert of `w` (pinned host memory with `pin`)."""
    if isinstance(w, QuantizedWeight):
        new = lambda t: torch.empty((count, *t.shape), dtype=t.dtype, device=device, pin_memory=pin)  # noqa: E731
        return QuantizedWeight(new(w.packed), new(w.scales), new(w.biases), w.bits, w.group_size, w.out_dtype)
    return torch.empty((count, *w.shape), dtype=w.dtype, device=device, pin_memory=pin)


def _slot(stack, s: int):
    """Expert s of a stack (a view)."""
    if isinstance(stack, QuantizedWeight):
        return stack._with(stack.packed[s], stack.scales[s], stack.biases[s])
    return stack[s]


def _shape(w) -> tuple:
    return tuple(w.packed.shape) + tuple(w.scales.shape) if isinstance(w, QuantizedWeight) else tuple(w.shape)


def _copy_into_slot(slot, w, non_blocking: bool = False) -> None:
    """w into one expert's tensors (a view of a slot)."""
    if isinstance(slot, QuantizedWeight):
        slot.packed.copy_(w.packed, non_blocking=non_blocking)
        slot.scales.copy_(w.scales, non_blocking=non_blocking)
        slot.biases.copy_(w.biases, non_blocking=non_blocking)
    else:
        slot.copy_(w, non_blocking=non_blocking)


def _copy_into(slot_stack, s: int, w) -> None:
    """w into slot s of a stack, queued (host to device from pinned memory need not wait)."""
    _copy_into_slot(_slot(slot_stack, s), w, non_blocking=True)


# -- the store --------------------------------------------------------------------------------------

@dataclass
class Stats:
    hits: int = 0
    misses: int = 0
    bytes: int = 0          # read from the home: copies into slots, (zero-copy) misses read in place; from
                            # disk, the reads (a promotion then copies the staged read)
    promoted: int = 0       # zero-copy: experts copied into slots after the step that read them in place
    io_s: float = 0.0       # from a layer's reads submitted to their copies done
    wait_s: float = 0.0     # of which the step waited (the rest overlapped its hits' compute)


class ExpertStack:
    """What a streamed model holds in place of one routed-expert stack: the MoE ops hand it to its
    store (`ExpertStore.moe`). `shape` is the resident stack's."""

    def __init__(self, store: "ExpertStore", layer: str, name: str, shape: tuple):
        self.store, self.layer, self.name, self.shape = store, layer, name, tuple(shape)

    def __repr__(self) -> str:
        return f"ExpertStack({self.layer}{self.name}, {self.store.home_tier})"

    @property
    def nbytes(self) -> int:
        """The resident stack's bytes (as its home holds it): what a decode token's share is taken of."""
        home = self.store.homes[self.layer]
        if isinstance(home, HostHome):      # (a compacted home holds fewer experts: scaled to them all)
            w = home.stacks[self.name]
            return w.nbytes // w.shape[0] * self.shape[0]
        return home.count * sum(p["nbytes"] for p in home.records[self.name]["parts"].values())


class ExpertStore:
    """Every streamed layer's home (host or disk), its slots on `device` and their SlotCache."""

    def __init__(self, homes: dict[str, object], device, policy: str = "lfu", slots: int = 16,
                 io_threads: int = 8, profile: dict | None = None, zero_copy: bool = False):
        self.homes, self.device, self.policy = homes, torch.device(device), policy
        self.zero_copy = zero_copy
        self.staging: dict[tuple, object] = {}              # zero-copy from disk: pinned stacks the misses land in
        self.tables: dict[str, torch.Tensor] = {}          # zero-copy: expert -> slot, or -1 - expert (in place)
        self.pending: dict[str, list] = {}                  # zero-copy: ids of calls not yet counted
        self.ahead: dict[str, tuple] = {}                   # zero-copy: misses staged ahead (prefetch)
        self.log: torch.Tensor | None = None                # zero-copy in a CUDA graph: each layer's ids a replay
        self.logged: dict[str, int] = {}                    # ... the layers captured writing it, their rows
        self.row = {p: i for i, p in enumerate(homes)}      # ... each layer's row of it
        self.slots = slots
        self.caches = {p: SlotCache(slots, policy, _hot(profile, p, slots)) for p in homes}
        self.stacks: dict[str, dict[str, object]] = {}
        self.stats = {p: Stats() for p in homes}
        self.trace: deque = deque(maxlen=TRACE)           # (layer, needed ids) of the last TRACE MoE calls
        self.tokens: dict[str, int] = {}                    # rows through each layer
        self.pool = ThreadPoolExecutor(max_workers=max(1, io_threads), thread_name_prefix="kiln-experts")
        self.kept: dict[str, list[int]] = {}               # compacted layers: their hot sets, only in slots
        self.arena: PinnedArena | None = None              # the host stacks' pinned memory (ExpertPlan.store)
        if policy == "static" and not profile:
            raise KilnError("expert policy static needs a routing profile (--expert-profile FILE)")

    @property
    def home_tier(self) -> str:
        return next(iter(self.homes.values())).tier if self.homes else "none"

    def handle(self, layer: str, name: str, shape: tuple) -> ExpertStack:
        return ExpertStack(self, layer, name, shape)

    def _slots(self, layer: str) -> dict[str, object]:
        """The layer's slot stacks, made at its first use (shaped as one expert read from its home); the
        static policy's hot set loaded into them then (not counted as misses)."""
        if layer not in self.stacks:
            cache = self.caches[layer]
            sample = self.homes[layer].read(0)
            self.stacks[layer] = {n: _empty_like_stack(w, cache.capacity, self.device) for n, w in sample.items()}
            loads = cache.preload()
            if loads:
                self._load(layer, loads, count=False)
        return self.stacks[layer]

    def compact(self, layer: str, arena: PinnedArena | None = None) -> None:
        """The static policy, homed in host memory: the layer's hot set loaded into its slots now (where
        it stays: static never evicts), then its host stacks cut to the other experts (HostHome.rows),
        so that host memory holds only what is read from it: the 397B's hot 60% on the GPU and the rest
        in 96 GB of pinned host memory, where the whole would not fit. The cut stacks in `arena` (pinned)
        if given, else in plain host memory."""
        home, cache = self.homes[layer], self.caches[layer]
        if self.policy != "static" or not isinstance(home, HostHome) or home.rows is not None:
            return
        with torch.inference_mode():
            self._slots(layer)
        count = next(iter(home.stacks.values())).shape[0]
        keep = [e for e in range(count) if e not in cache.slot_of]
        if not keep:            # every expert hot: nothing is read from the host (its stacks stay whole)
            return
        home.stacks = {n: _take(w, keep, arena) for n, w in home.stacks.items()}
        home.rows = {e: r for r, e in enumerate(keep)}
        self.kept[layer] = list(cache.hot)
        self.tables.pop(layer, None)

    def _load(self, layer: str, loads: list[tuple[int, int]], count: bool = True) -> None:
        self._finish(layer, loads, self._start(layer, loads), count)

    def _start(self, layer: str, loads: list[tuple[int, int]]) -> tuple:
        """The loads' reads submitted to the I/O threads (the disk file checked first)."""
        home = self.homes[layer]
        if isinstance(home, DiskHome):
            home.open()
            home.check()
        return time.perf_counter(), [self.pool.submit(home.read, e) for e, _ in loads]

    def _finish(self, layer: str, loads: list[tuple[int, int]], started: tuple, count: bool = True) -> None:
        """Wait for the reads, copy each expert into its slot, check the file again, count."""
        t0, futures = started
        home, stats, stacks = self.homes[layer], self.stats[layer], self.stacks[layer]
        wait = time.perf_counter()
        for (_, s), f in zip(loads, futures):
            for n, w in f.result().items():
                _copy_into(stacks[n], s, w)
        if isinstance(home, DiskHome):
            home.check()
        if count:
            stats.misses += len(loads)
            stats.bytes += len(loads) * home.nbytes()
            stats.io_s += time.perf_counter() - t0
            stats.wait_s += time.perf_counter() - wait

    def moe(self, ops, x, idx, weights, gate_up: ExpertStack, down: ExpertStack, act: str,
            gate: tuple | None = None) -> torch.Tensor:
        """The routed experts of x through the slots (plus Qwen's gated shared expert, gate = (gate_w,
        shared)). Zero-copy where it applies (_in_place from host memory, _staged from disk); otherwise
        (_copied) the needed experts in ascending id, in batches that fit the slots. When one batch
        holds them all and the backend has kernels for slots (`slot_kernels`), its resident kernels run
        on them (`ops.moe_from_slots`, rows mapping each pair to its slot). Otherwise a batch's misses
        are read while its hits compute (`ops.expert_out`), then the misses compute, and the outputs
        are added in id order, as the reference adds them."""
        layer = gate_up.layer
        capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
        if not capturing:           # (a capture only records kernels: the counting waits for replayed)
            self._settle(layer)
        self.zero_copy = self.zero_copy and getattr(ops, "mapped_rows", 0) > 0      # the backend has the kernels
        if self.zero_copy and x.shape[0] <= ops.mapped_rows:
            staged = isinstance(self.homes[layer], DiskHome)
            y = (self._staged if staged else self._in_place)(ops, x, idx, weights, gate_up, down, act, gate)
            if y is not None:
                return y
        try:
            return self._copied(ops, x, idx, weights, gate_up, down, act, gate)
        finally:
            if layer in self.tables:
                self.tables[layer].copy_(self._table_values(layer, self.tables[layer].shape[0]))

    def prefetch(self, ops, idx, gate_up: ExpertStack, down: ExpertStack) -> None:
        """Zero-copy from host memory: start copying idx's misses into device scratch now, on a side
        stream (ops.stage_ahead), so that what the caller queues before the experts (Gemma 4's dense MLP)
        overlaps the copy; moe() with the same idx joins it. Nothing where that path does not apply."""
        layer = gate_up.layer
        disk = isinstance(self.homes[layer], DiskHome)    # (its misses are read on the host, in moe())
        if not self.zero_copy or idx.shape[0] > getattr(ops, "mapped_rows", 0) or disk:
            return
        if not (idx.is_cuda and torch.cuda.is_current_stream_capturing()):
            self._settle(layer)         # the table as moe() would find it: promotions applied first
        home = self.homes[layer]
        staged = ops.stage_ahead(idx, self._table(layer, gate_up.shape[0]),
                                 (home.stacks[gate_up.name], home.stacks[down.name]))
        if staged is not None:
            self.ahead[layer] = (idx, staged)

    def _table(self, layer: str, experts: int) -> torch.Tensor:
        """The layer's device table (expert -> slot, or -1 - expert), made at its first zero-copy call."""
        if layer not in self.tables:
            self.tables[layer] = self._table_values(layer, experts).to(self.device)
        return self.tables[layer]

    def _in_place(self, ops, x, idx, weights, gate_up: ExpertStack, down: ExpertStack, act: str, gate):
        """Zero-copy from host memory: every pair's expert taken from its slot or from host memory by
        the table (the backend stages the misses on the device, or reads them in place); the ids sent
        to the host without a wait, counted at the layer's next call (_settle). None where the
        backend's kernels do not apply."""
        layer = gate_up.layer
        stacks, home = self._slots(layer), self.homes[layer]
        host = (home.stacks[gate_up.name], home.stacks[down.name])
        ahead = self.ahead.pop(layer, None)
        staged = {"staged": ahead[1]} if ahead is not None and ahead[0] is idx else {}
        y = ops.moe_from_slots(x, idx, None, weights, stacks[gate_up.name], stacks[down.name], act, gate, host=host,
                               table=self._table(layer, gate_up.shape[0]), **staged)
        if y is None:
            return None
        if idx.is_cuda and torch.cuda.is_current_stream_capturing():
            self._log(layer, idx)
            return y
        self.tokens[layer] = self.tokens.get(layer, 0) + x.shape[0]
        if idx.is_cuda:
            ids = torch.empty(idx.shape, dtype=idx.dtype, pin_memory=True)
            ids.copy_(idx, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        else:
            ids, done = idx.clone(), None
        self.pending.setdefault(layer, []).append((ids, done))
        return y

    def _staged(self, ops, x, idx, weights, gate_up: ExpertStack, down: ExpertStack, act: str, gate):
        """Zero-copy from disk: the ids read on the host, the misses read by the I/O threads straight
        into pinned staging stacks that the kernels read in place (row -1 - j: staged expert j); then
        the policy counts (SlotCache.admit) and its promotions are copied from the staging into their
        slots. The next call's wait for its ids is what frees the staging (this call's kernels and
        copies are done by then). None where the backend's kernels do not apply (nothing counted)."""
        layer = gate_up.layer
        home, cache, stacks = self.homes[layer], self.caches[layer], self._slots(layer)
        needed = torch.unique(idx).tolist()
        missing = [e for e in needed if e not in cache.slot_of]
        staging = self._staging(stacks, idx.numel())
        t0 = time.perf_counter()
        home.open()
        home.check()
        read_staged(home, self.pool, staging, missing)
        home.check()
        waited = time.perf_counter() - t0
        table = torch.zeros(gate_up.shape[0], dtype=torch.int32)
        for j, e in enumerate(missing):
            table[e] = -1 - j
        for e in needed:
            if e in cache.slot_of:
                table[e] = cache.slot_of[e]
        rows = table.to(idx.device)[idx]
        y = ops.moe_from_slots(x, idx, rows, weights, stacks[gate_up.name], stacks[down.name], act, gate,
                               host=(staging[gate_up.name], staging[down.name]))
        if y is None:
            return None
        hits, promos = cache.admit(needed)
        staged = {e: j for j, e in enumerate(missing)}
        for e, slot, _ in promos:       # after the kernels that read the staging and the evicted slots
            for n, w in staging.items():
                _copy_into(stacks[n], slot, _slot(w, staged[e]))
        self.trace.append((layer, needed))
        self.tokens[layer] = self.tokens.get(layer, 0) + x.shape[0]
        st = self.stats[layer]
        st.hits, st.misses, st.promoted = st.hits + hits, st.misses + len(missing), st.promoted + len(promos)
        st.bytes += len(missing) * home.nbytes()
        st.io_s += waited
        st.wait_s += waited
        return y

    def _staging(self, stacks: dict, count: int) -> dict:
        """Pinned host stacks of `count` experts shaped as `stacks`' (one set for layers of one shape:
        layers run one after another)."""
        suffix = {n: n.rsplit(".", 1)[-1] for n in stacks}
        key = tuple(sorted((suffix[n], _shape(w)) for n, w in stacks.items())) + (count,)
        if key not in self.staging:
            pin = self.device.type == "cuda"
            self.staging[key] = {suffix[n]: _empty_like_stack(_slot(w, 0), count, "cpu", pin)
                                 for n, w in stacks.items()}
        return {n: self.staging[key][suffix[n]] for n in stacks}

    @property
    def graph_safe(self) -> bool:
        """Decode can run as a CUDA graph: zero-copy from host memory on quantised experts (no host
        read inside a step)."""
        return self.zero_copy and all(isinstance(h, HostHome) and all(isinstance(w, QuantizedWeight)
                                                                      for w in h.stacks.values())
                                      for h in self.homes.values())

    def _log(self, layer: str, idx: torch.Tensor) -> None:
        """Inside a capture: the layer's ids copied into its row of the graph's log, which replayed()
        sends to the host after each replay."""
        if self.log is None or self.log.shape[1] != idx.numel():
            self.log, self.logged = idx.new_empty((len(self.homes), idx.numel())), {}
        self.logged[layer] = idx.shape[0]
        self.log[self.row[layer]].copy_(idx.reshape(-1))

    def replayed(self) -> None:
        """After a decode graph's replay (queued, not waited for): the earlier calls counted and their
        promotions queued, then this replay's ids sent to the host, counted at the next."""
        for layer in self.logged:
            self._settle(layer)
        if self.log is None:
            return
        ids = torch.empty(self.log.shape, dtype=self.log.dtype, pin_memory=True)
        ids.copy_(self.log, non_blocking=True)
        done = torch.cuda.Event()
        done.record()
        for layer, rows in self.logged.items():
            self.pending.setdefault(layer, []).append((ids[self.row[layer]], done))
            self.tokens[layer] = self.tokens.get(layer, 0) + rows

    def _table_values(self, layer: str, count: int) -> torch.Tensor:
        """Each expert's slot, or -1 - its row of the host stacks where it is read in place."""
        home = self.homes[layer]
        rows = getattr(home, "rows", None)
        if rows is None:
            table = -1 - torch.arange(count, dtype=torch.int32)
        else:               # (an expert the host does not hold is always in a slot)
            table = torch.zeros(count, dtype=torch.int32)
            for e, r in rows.items():
                table[e] = -1 - r
        for e, s in self.caches[layer].slot_of.items():
            table[e] = s
        return table

    def _settle(self, layer: str) -> None:
        """Zero-copy: the layer's earlier calls counted (their ids are on the host by now), and the
        policy's promotions copied into slots; the table's entries change around the copies, in stream
        order: an evicted expert is read in place before its slot is overwritten."""
        for ids, done in self.pending.pop(layer, []):
            if done is not None:
                done.synchronize()
            needed = sorted(set(ids.reshape(-1).tolist()))
            self.trace.append((layer, needed))
            hits, promos = self.caches[layer].admit(needed)
            stats, home, table = self.stats[layer], self.homes[layer], self.tables[layer]
            stats.hits += hits
            stats.misses += len(needed) - hits
            stats.promoted += len(promos)
            stats.bytes += (len(needed) - hits + len(promos)) * home.nbytes()
            for _, _, victim in promos:
                if victim is not None:
                    table[victim: victim + 1].fill_(-1 - home.row(victim))
            for e, slot, _ in promos:
                for n, w in home.read(e).items():
                    _copy_into(self.stacks[layer][n], slot, w)
                table[e: e + 1].fill_(slot)

    def _copied(self, ops, x, idx, weights, gate_up: ExpertStack, down: ExpertStack, act: str, gate):
        """The misses copied into slots before they compute (batches of ascending ids)."""
        layer = gate_up.layer
        needed = torch.unique(idx).tolist()
        self.trace.append((layer, needed))
        self.tokens[layer] = self.tokens.get(layer, 0) + x.shape[0]
        stacks = self._slots(layer)
        gu, dn = stacks[gate_up.name], stacks[down.name]
        batches = self.caches[layer].batches(needed)
        out = torch.zeros_like(x)
        # a prefill chunk on a backend with the grouped kernels: each batch's pairs into per-pair outputs,
        # added once every batch is in (ops.slot_pairs, ops.moe_combine); else expert by expert below
        pairs = (x.new_zeros((idx.numel(), x.shape[1])) if getattr(ops, "pairs_apply", None)
                 and ops.pairs_apply(x, gu, dn, act) else None)
        for batch in batches:
            where, loads = self.caches[layer].plan(batch)
            self.stats[layer].hits += len(batch) - len(loads)
            started = self._start(layer, loads)
            if len(batches) == 1 and getattr(ops, "slot_kernels", False):
                self._finish(layer, loads, started)
                started = None
                table = torch.zeros(gate_up.shape[0], dtype=idx.dtype)
                for e, s in where.items():
                    table[e] = s
                y = ops.moe_from_slots(x, idx, table.to(idx.device)[idx], weights, gu, dn, act, gate)
                if y is not None:
                    return y
            if pairs is not None:
                if started is not None:
                    self._finish(layer, loads, started)
                ops.slot_pairs(x, idx, weights, {e: where[e] for e in batch}, gu, dn, act, pairs)
                continue
            missing = {e for e, _ in loads}
            ys = {}
            for e in [e for e in batch if e not in missing] + [None] + sorted(missing):
                if e is None:       # the hits computed while the misses were read: now wait for them
                    if started is not None:
                        self._finish(layer, loads, started)
                    continue
                tok, slot = torch.where(idx == e)
                ys[e] = (tok, ops.expert_out(x, tok, slot, weights, gu[where[e]], dn[where[e]], act))
            for e in batch:         # added in id order, as resident
                tok, y = ys[e]
                out.index_add_(0, tok, y.to(out.dtype))
        if pairs is not None:
            return ops.moe_combine(pairs, idx, x, gate)
        return out if gate is None else ops.shared_gate_add(out, x, *gate)

    def reset(self, policy: str | None = None, profile: dict | None = None, zero_copy: bool | None = None) -> None:
        """Empty slots and fresh counts, under another policy (and profile) or zero-copy choice if given:
        one load measured under several (bench/stream_policies.py). A decode graph captured before
        keeps its read mode, and its slots unless the capacity stays: the caller drops it. A compacted
        layer (compact()) keeps its hot set: only static with the same one."""
        policy = policy or self.policy
        if policy == "static" and not profile:
            raise KilnError("expert policy static needs a routing profile (--expert-profile FILE)")
        caches = {p: SlotCache(self.slots, policy, _hot(profile, p, self.slots)) for p in self.homes}
        if any(caches[p].hot != hot for p, hot in self.kept.items()):
            raise KilnError("this load keeps the static policy's hot experts on the device only (not in host "
                            "memory): it runs static with the same profile; load again for another policy")
        self.policy, self.caches = policy, caches
        self.stats = {p: Stats() for p in self.homes}
        self.pending, self.tokens = {}, {}
        self.trace.clear()
        if zero_copy is not None:
            self.zero_copy = zero_copy
        for layer in [p for p, st in self.stacks.items() if self._count(st) != self.caches[p].capacity]:
            del self.stacks[layer]      # static's scratch slots: made again at the next call
            self.tables.pop(layer, None)
        with torch.inference_mode():    # (the forward made them in inference mode)
            for layer in self.stacks:       # the same tensors (a captured graph reads them), emptied
                if (loads := self.caches[layer].preload()) and layer not in self.kept:
                    self._load(layer, loads, count=False)   # (a compacted layer's slots still hold them)
            for layer, table in self.tables.items():
                table.copy_(self._table_values(layer, table.shape[0]))

    @staticmethod
    def _count(stacks: dict) -> int:
        w = next(iter(stacks.values()))
        return (w.packed if isinstance(w, QuantizedWeight) else w).shape[0]

    def summary(self) -> dict:
        """Hit rate, misses and bytes moved per tier, summed over the layers (the bench's expert_store)."""
        tot = Stats()
        for s in self.stats.values():
            tot.hits, tot.misses, tot.bytes = tot.hits + s.hits, tot.misses + s.misses, tot.bytes + s.bytes
            tot.io_s, tot.wait_s = tot.io_s + s.io_s, tot.wait_s + s.wait_s
        seen = tot.hits + tot.misses
        tokens = sum(self.tokens.values()) / max(1, len(self.homes))      # rows through a layer
        tot.promoted = sum(s.promoted for s in self.stats.values())
        return {"policy": self.policy, "slots": self.slots, "home": self.home_tier, "layers": len(self.homes),
                "zero_copy": self.zero_copy, "promoted": tot.promoted,
                "hits": tot.hits, "misses": tot.misses, "hit_rate": tot.hits / seen if seen else None,
                "bytes": tot.bytes, "tokens": tokens, "bytes_per_token": tot.bytes / tokens if tokens else None,
                "io_s": round(tot.io_s, 4), "wait_s": round(tot.wait_s, 4),
                "host_bytes": sum(w.nbytes for h in self.homes.values() if isinstance(h, HostHome)
                                  for w in h.stacks.values()),
                "host_pinned_bytes": self.arena.nbytes if self.arena is not None else 0}

    def line(self) -> str:
        """The summary in the stats line (since the load)."""
        s = self.summary()
        rate = "n/a" if s["hit_rate"] is None else f"{s['hit_rate']:.0%}"
        per = "n/a" if s["bytes_per_token"] is None else f"{s['bytes_per_token'] / 1e6:.2f} MB"
        return (f"experts {s['policy']} {s['slots']} slots from {s['home']}: hit {rate}, {per} a token, "
                f"I/O {s['io_s']:.2f} s since load")

    def profile(self) -> dict:
        """Use counts per layer and expert: a routing profile for the static policy."""
        return {p: {str(e): n for e, n in c.uses.items()} for p, c in self.caches.items()}

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        for home in self.homes.values():
            if isinstance(home, DiskHome) and home.fd >= 0:
                os.close(home.fd)
                home.fd = -1


def read_staged(home: DiskHome, pool: ThreadPoolExecutor, staging: dict, missing: list[int]) -> None:
    """Experts `missing` read into slots 0.. of the staging stacks (missing[j] into slot j) by the
    pool, all at once: straight into the slots in pieces where the parts are held as stored
    (DiskHome.reads), else each whole through a thread's buffer (DiskHome.read_into)."""
    futures = []
    for j, e in enumerate(missing):
        dest = {n: _slot(w, j) for n, w in staging.items()}
        reads = home.reads(e, dest)
        if reads is None:
            futures.append(pool.submit(home.read_into, e, dest))
        else:
            futures += [pool.submit(home.read_piece, e, at, views) for at, views in reads]
    for f in futures:
        f.result()


def _hot(profile: dict | None, layer: str, slots: int) -> list[int]:
    counts = (profile or {}).get(layer, {})
    ranked = sorted(counts.items(), key=lambda kv: (-kv[1], int(kv[0])))
    return [int(e) for e, _ in ranked[:slots]]


# -- the plan: which layers stream, from where ------------------------------------------------------

HOMES = ("auto", "host", "disk")
ZERO_COPY = ("auto", "on", "off")


@dataclass
class ExpertPlan:
    """How a model's routed experts stream (kiln.load's expert_* arguments, the CLI's flags): the
    policy and slots a layer, their home (auto: host memory when every layer's experts fit in
    `host_memory` GB, or without it in host_room(); else disk, which needs a packed directory), I/O
    threads, and a routing profile for the static policy."""
    policy: str = "lfu"
    slots: int = 16
    home: str = "auto"
    host_memory: float | None = None
    io_threads: int = 8
    profile: dict | None = None
    verify: str = "lazy"            # a packed directory's expert files hashed at first use unless "off"
    direct_io: bool = False         # disk home: O_DIRECT reads, past the page cache
    zero_copy: str = "auto"         # misses read in place by the kernels, from host memory or a pinned
                                    # staging the disk reads land in (auto: on a CUDA device)

    def store(self, ckpt, shapes: dict, dtype, device) -> tuple[ExpertStore, dict[str, ExpertStack]]:
        """The store and one handle a routed-expert stack of the model (its weight names)."""
        from .upload import placed

        if self.home not in HOMES:
            raise KilnError(f"expert home must be one of {', '.join(HOMES)}, not {self.home!r}")
        names = sorted(n for n in shapes if n.endswith(STACKS))
        if not names:
            raise KilnError("this model has no routed experts to stream (--expert-cache-slots is for MoE models)")
        prefix = {n: layer_prefix(n) for n in names}
        home = self._auto_home(ckpt, names, dtype) if self.home == "auto" else self.home
        convert = lambda stored: placed(stored, dtype, "cpu")  # noqa: E731
        if home == "disk":
            homes = _disk_homes(ckpt, names, prefix, convert, self.verify != "off", self.direct_io)
        elif self.direct_io:
            raise KilnError("--direct-io reads experts homed on disk (--expert-home disk)")
        else:
            homes = {prefix[n]: HostHome({}) for n in names}
        if self.zero_copy not in ZERO_COPY:
            raise KilnError(f"zero copy must be one of {', '.join(ZERO_COPY)}, not {self.zero_copy!r}")
        zero = self.zero_copy == "on" or (self.zero_copy == "auto" and torch.device(device).type == "cuda")
        store = ExpertStore(homes, device, self.policy, self.slots, self.io_threads, self.profile, zero)
        if home != "disk":
            self._host_stacks(store, ckpt, names, prefix, convert, torch.device(device).type == "cuda")
        return store, {n: store.handle(prefix[n], n, shapes[n]) for n in names}

    def _host_stacks(self, store: ExpertStore, ckpt, names: list[str], prefix: dict, convert, pin: bool) -> None:
        """Each layer's stacks read into host memory (pinned on a CUDA device); under the static policy
        each layer compacted as soon as its stacks are in (ExpertStore.compact: the hot set to the
        device, the rest pinned), so host memory never holds every layer's whole stacks."""
        left, static = Counter(prefix[n] for n in names), self.policy == "static"
        arena = PinnedArena() if pin else None
        for n in names:
            w, p = convert(ckpt.load(n)), prefix[n]
            store.homes[p].stacks[n] = arena.copy(w) if pin and not static else w   # (static: only its cut)
            left[p] -= 1
            if left[p] == 0 and static:
                store.compact(p, arena)
        store.arena = arena

    def _auto_home(self, ckpt, names: list[str], dtype) -> str:
        """Host unless the experts, as they will be held, pass --host-memory; without it, unless they
        pass host_room() (where their size is known without loading them): then disk for a packed
        directory, said in a [kiln] line; any other checkpoint stays in host memory with a warning
        (MemAvailable can read far below what a VM gives as it is used: no refusal on it)."""
        share = self._host_share(ckpt, names)
        if self.host_memory is not None:
            need = sum(weight_bytes(ckpt, names, dtype).values()) * share
            return "host" if need <= self.host_memory * GB else "disk"
        room, need = host_room(), _known_bytes(ckpt, names, dtype)
        need = None if need is None else int(need * share)
        if room is None or need is None or need <= room:
            return "host"
        why = (f"the routed experts take {need / GB:.3g} GB, more than the {room / GB:.3g} GB of host memory "
               f"kiln takes by default ({HOST_SHARE:.0%} of the available)")
        if ckpt.format == "packed":
            print(f"[kiln] {why}: streamed from disk (--expert-home host or --host-memory GB keeps them in "
                  "host memory)", file=sys.stderr)
            return "disk"
        print(f"[kiln] warning: {why}; they stay in host memory (kiln pack {ckpt.path} DIR makes a packed "
              "directory that streams them from disk)", file=sys.stderr)
        return "host"

    def _host_share(self, ckpt, names: list[str]) -> float:
        """The share of the experts host memory holds: static keeps its hot set on the device only."""
        count = max(ckpt.shapes[n][0] for n in names)
        return 1 - min(self.slots, count) / count if self.policy == "static" else 1.0


HOST_SHARE = 0.75   # of the host's available memory the experts take without --host-memory: our GPU
                    # machine pins 96 GB of its 125 GiB (REFERENCE.md), and the process needs the rest


def host_room() -> int | None:
    """Bytes of host memory streamed experts may take without --host-memory: HOST_SHARE of what the
    kernel reports available (Linux's MemAvailable); None where it does not say."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(int(line.split()[1]) * 1024 * HOST_SHARE)
    except (OSError, ValueError, IndexError):
        return None
    return None


def _known_bytes(ckpt, names: list[str], dtype) -> int | None:
    """weight_bytes' total where it comes without loading a tensor (a packed manifest, a synthesized
    draw, plain safetensors spans); None for the rest (GGUF, mlx-lm's quantised files)."""
    if ckpt.format in ("packed", "synth") or all(ckpt.locate(n) is not None for n in names):
        return sum(weight_bytes(ckpt, names, dtype).values())
    return None


def layer_prefix(name: str) -> str:
    """A routed-expert stack's layer: its name less the stack's suffix (STACKS)."""
    return name[: -len(next(s for s in STACKS if name.endswith(s)))]


class PinnedArena:
    """Pinned host memory carved out of chunks of CHUNK bytes, each request placed in the first chunk
    with room (4 KiB-aligned): torch's caching host allocator rounds every request up to a power of
    two (a 1.1 GB stack takes 2 GiB), which the 397B's ~90 GB of host experts cannot afford, and
    pinning once in large chunks is the fast way (REFERENCE.md). Never freed piecemeal: the experts
    live as long as the load. Chunks grow from FIRST to CHUNK bytes (a small model pins little). Not
    pinned where CUDA is absent (CPU tests)."""
    FIRST, CHUNK = 1 << 26, 1 << 32

    def __init__(self):
        self.chunks: list[list] = []        # [uint8 tensor, bytes used]

    def empty(self, shape, dtype) -> torch.Tensor:
        n = _numel(shape) * torch.empty((), dtype=dtype).element_size()
        room = align(max(n, 1), 4096)
        chunk = next((c for c in self.chunks if c[1] + room <= c[0].numel()), None)
        if chunk is None:
            size = max(room, min(self.CHUNK, self.FIRST << len(self.chunks)))
            chunk = [torch.empty(size, dtype=torch.uint8, pin_memory=torch.cuda.is_available()), 0]
            self.chunks.append(chunk)
        at = chunk[1]
        chunk[1] += room
        return chunk[0][at: at + n].view(dtype).view(shape)

    def copy(self, w):
        """w (a tensor or QuantizedWeight) in the arena."""
        if isinstance(w, QuantizedWeight):
            return w._with(self.copy(w.packed), self.copy(w.scales), self.copy(w.biases))
        return self.empty(tuple(w.shape), w.dtype).copy_(w)

    @property
    def nbytes(self) -> int:
        return sum(c[0].numel() for c in self.chunks)


def _take(w, keep: list[int], arena: PinnedArena | None = None):
    """Experts `keep` of a host stack, in that order, in a new one (in `arena` if given)."""
    if isinstance(w, QuantizedWeight):
        return w._with(_take(w.packed, keep, arena), _take(w.scales, keep, arena), _take(w.biases, keep, arena))
    shape = (len(keep), *w.shape[1:])
    out = arena.empty(shape, w.dtype) if arena is not None else torch.empty(shape, dtype=w.dtype)
    return torch.index_select(w, 0, torch.tensor(keep, dtype=torch.long), out=out)


def _disk_homes(ckpt, names: list[str], prefix: dict, convert, check: bool, direct: bool) -> dict[str, DiskHome]:
    if ckpt.format != "packed":
        raise KilnError(f"experts homed on disk are read from a packed directory (kiln pack {ckpt.path} DIR); "
                        f"{ckpt.path} is a {ckpt.format} checkpoint")
    layers = {}
    manifest = read_manifest(Path(ckpt.path), check=False)
    for layer in manifest.get("experts", {}).get("layers", []):
        for n, rec in layer["tensors"].items():
            layers[n] = (layer, rec)
    homes: dict[str, DiskHome] = {}
    for n in names:
        if n not in layers:
            raise KilnError(f"{ckpt.path}: the manifest has no expert file for {n}")
        layer, rec = layers[n]
        digest = manifest["files"].get(layer["file"], {}).get("sha256") if check else None
        home = homes.setdefault(prefix[n], DiskHome(Path(ckpt.path) / layer["file"], layer["stride"],
                                                    layer["count"], {}, convert, digest, direct))
        home.records[n] = rec
    return homes


# -- the device memory budget: what stays resident, how many slots fit beside it ----------------------

GB = 1e9                    # --gpu-memory and --host-memory count in 10^9 bytes
WORKSPACE_FIXED = 256 << 20  # cuBLAS and Triton workspaces, the sampler, the allocator's rounding
AUTO_MARGIN_FIXED = 1 << 30  # automatic streaming: the free memory less this and AUTO_MARGIN_SHARE of it
AUTO_MARGIN_SHARE = 0.05


def weight_bytes(ckpt, names, dtype) -> dict[str, int]:
    """Bytes each tensor takes on the device as the model holds it (upload.placed's rule: a plain
    tensor in `dtype`; a quantised one's words as stored, its scales and biases in `dtype` unless
    kept f32), known before it loads: from a packed directory's manifest, from the span of a plain
    tensor (safetensors, a synthesized draw), from a synthesized quantised draw's format; any other
    (GGUF, mlx-lm's quantised safetensors) read as its reader presents it and measured on the host."""
    records = _manifest_records(ckpt)
    spec = parse_spec(str(ckpt.path)) if ckpt.format == "synth" else None
    item = torch.empty((), dtype=dtype).element_size()
    out = {}
    for n in names:
        shape = ckpt.shapes[n]
        if n in records:
            out[n] = _record_bytes(*records[n], item)
        elif ckpt.locate(n) is not None:
            out[n] = _numel(shape) * item
        elif spec is not None:
            out[n] = _drawn_bytes(quant_format(spec, n, shape), shape, item)
        else:
            out[n] = _held(ckpt.load(n), item)
    return out


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _manifest_records(ckpt) -> dict[str, tuple[dict, int]]:
    """A packed directory's records by name, with how many experts a part's bytes count for."""
    if ckpt.format != "packed":
        return {}
    m = read_manifest(Path(ckpt.path), check=False)
    out = {n: (r, 1) for n, r in m["tensors"].items()}
    for layer in m.get("experts", {}).get("layers", []):
        out.update({n: (r, layer["count"]) for n, r in layer["tensors"].items()})
    return out


def _record_bytes(rec: dict, count: int, item: int) -> int:
    if "quant" not in rec:
        return _numel(rec["shape"]) * item
    parts = rec["parts"]
    side = parts["scales"]
    kept = side["dtype"] == "f32" and "out_dtype" not in rec["quant"]     # f32 scales stay f32
    per = parts["weight"]["nbytes"] + 2 * side["nbytes"] // DTYPES[side["dtype"]].itemsize * (4 if kept else item)
    return count * per


def _drawn_bytes(fmt: tuple[int, int] | None, shape, item: int) -> int:
    """A synthesized tensor: plain, or drawn quantised (scales and biases in the draw's 16-bit dtype,
    so held in the run's)."""
    if fmt is None:
        return _numel(shape) * item
    bits, group = fmt
    return _numel(shape) * bits // 8 + 2 * (_numel(shape) // group) * item


def _held(stored, item: int) -> int:
    if not isinstance(stored, QuantizedWeight):
        return stored.numel() * item
    kept = stored.scales.dtype == torch.float32 and stored.out_dtype is None
    side = stored.scales.numel() + stored.biases.numel()
    return stored.packed.numel() * stored.packed.element_size() + side * (4 if kept else item)


@dataclass
class MemoryPlan:
    """What a device memory budget holds: the core (every weight but the routed experts), the KV
    cache and recurrent state, the workspace, and `slots` expert slots a layer (None: every expert
    resident). Bytes throughout; `expert` is one slot in every streamed layer, `experts` them all."""
    budget: int
    core: int
    cache: int
    workspace: int
    expert: int = 0
    experts: int = 0
    count: int = 0                  # experts a layer
    slots: int | None = None
    policy: str = "lfu"
    auto: bool = False              # chosen because the weights did not fit in the free memory
    batch: int = 0                  # --max-batch: the batch state pool's slots (0: no pool planned)
    batch_slot: int = 0             # bytes a pool slot holds (its requests' state at batch_context)
    batch_context: int = 0
    batch_spare: int = 0            # bytes of the pool's spare slot (its windowed layers hold every position)
    batch_pages: int = 0            # KV pages the slots share (kiln.cache.SlotPool), of batch_page bytes
    batch_page: int = 0
    batch_full: int = 0             # requests the pages hold at once at batch_context (more when shorter)
    chunk: int = 0                  # the prefill chunk the cache and workspace hold (kiln.api.stream_chunk)

    @property
    def pool(self) -> int:
        """The batch state pool's bytes: its slots and the spare one (kiln.cache.SlotPool)."""
        if not self.batch:
            return 0
        return self.batch * self.batch_slot + self.batch_pages * self.batch_page + self.batch_spare

    @property
    def need(self) -> int:
        return self.core + self.cache + self.workspace + self.pool

    @property
    def per_slot(self) -> int:
        """One slot a layer: the static policy keeps a scratch slot beside each, up to SCRATCH
        (SlotCache.capacity)."""
        return self.slot_cost(1)

    def slot_cost(self, slots: int) -> int:
        """Bytes of `slots` slots a layer, static's scratch beside them."""
        return self.expert * (slots + (min(slots, SCRATCH) if self.policy == "static" else 0))

    def slots_in(self, room: int) -> int:
        """The most slots a layer that `room` bytes hold (slot_cost's inverse)."""
        n = room // self.expert
        if self.policy != "static":
            return n
        return n - SCRATCH if n >= 2 * SCRATCH else n // 2

    @property
    def slot_bytes(self) -> int:
        return 0 if self.slots is None else self.slot_cost(self.slots)

    def summary(self) -> dict:
        return {"gb": round(self.budget / GB, 6), "auto": self.auto, "slots": self.slots,
                "experts_per_layer": self.count or None, "core_bytes": self.core, "cache_bytes": self.cache,
                "workspace_bytes": self.workspace, "expert_slot_bytes": self.slot_bytes,
                "resident_expert_bytes": self.experts if self.slots is None else 0,
                "batch_slots": self.batch or None, "batch_context": self.batch_context or None,
                "batch_kv_pages": self.batch_pages or None,
                "batch_bytes": self.pool, "prefill_chunk": self.chunk or None}

    def line(self) -> str:
        """The plan on one line (stderr at load)."""
        if not self.count:
            experts = "a dense model: every weight resident"
        elif self.slots is None:
            experts = f"every expert resident ({_gb(self.experts)})"
        else:
            experts = (f"streaming the routed experts, {self.slots} slots a layer of {self.count} "
                       f"({_gb(self.slot_bytes)}, {self.policy})")
        head = (f"the model ({_gb(self.need + self.experts)} resident) passes the free device memory less a "
                f"margin ({_gb(self.budget)})" if self.auto else f"--gpu-memory {_gb(self.budget)}")
        batch = (f"; batch state {self.batch} slots of up to {self.batch_context} tokens ({_gb(self.pool)}): "
                 f"{self.batch} concurrent requests, KV pages for {self.batch_full} of them at the full "
                 f"{self.batch_context} tokens (more when shorter)" if self.batch else "")
        return (f"[kiln] {head}: {experts}; core {_gb(self.core)}, cache {_gb(self.cache)}, "
                f"workspace {_gb(self.workspace)} (prefill chunks of {self.chunk} tokens){batch}")


def _gb(n: int) -> str:
    """Bytes for a message: GB (10^9), or MB below 10 MB (a tiny test model's)."""
    return f"{n / GB:.2f} GB" if abs(n) >= 1e7 else f"{n / 1e6:.2f} MB"


def auto_budget(free: int) -> int:
    """The budget automatic streaming plans in: the free device memory less a margin (docs/streaming.md)."""
    return int(free - AUTO_MARGIN_FIXED - AUTO_MARGIN_SHARE * free)


def fit(plan: MemoryPlan, slots: int | None = None) -> MemoryPlan:
    """`plan` (its budget and sizes) with its slots chosen: every expert resident if they all fit,
    else as many slots a layer as the rest of the budget holds (at most a layer's experts); `slots`
    given: those, if they fit. One-line KilnError when the core, cache and workspace do not fit, or
    not one slot a layer, or not the slots asked for."""
    left = plan.budget - plan.need
    what = "the free device memory less a margin" if plan.auto else "--gpu-memory"
    if left < 0:
        raise KilnError(f"{what} {_gb(plan.budget)} is too small: the core ({_gb(plan.core)}), "
                        f"cache ({_gb(plan.cache)}) and workspace ({_gb(plan.workspace)}) need "
                        f"{_gb(plan.need)} (a lower --max-context shrinks the cache)")
    if not plan.count:
        return plan
    most = min(plan.slots_in(left), plan.count)
    if slots is not None:
        if plan.slot_cost(slots) > left:
            raise KilnError(f"--expert-cache-slots {slots} needs {_gb(plan.slot_cost(slots))} of expert slots; "
                            f"{what} {_gb(plan.budget)} leaves {_gb(left)} after the core, cache "
                            f"and workspace: {most} slots a layer fit")
        plan.slots = slots
    elif plan.experts <= left:
        plan.slots = None
    elif most < 1:
        raise KilnError(f"{what} {_gb(plan.budget)} is too small: after the core, cache and workspace "
                        f"({_gb(plan.need)}) it leaves {_gb(left)}, less than one expert slot a "
                        f"layer ({_gb(plan.per_slot)})")
    else:
        plan.slots = most
    return plan
