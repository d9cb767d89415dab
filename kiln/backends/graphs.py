"""The decode step captured as one CUDA graph.

A graph replays fixed kernels on fixed addresses, so it is captured over one persistent per-layer
state (the engine resets it between requests instead of allocating a new one) and over static
token/position inputs. A KV buffer that grows (a longer request: a new context bucket) changes the
addresses, and the graph is captured again. The first decode step of a bucket runs eagerly (it
compiles kernels and allocates workspaces), the next one is captured and then replayed every token.

Python bookkeeping inside the forward (each layer's `.length`) runs once during capture; the runner
restores it and advances it by one after each replay.

The step ends with the greedy choice (ops.greedy_next, kiln/ops/sample): argmax into the step's own token
input, position + 1. Greedy requests then feed the graph from the device and the host queues the
next step before reading a token (greedy_tokens); other requests fill both inputs from the host.
"""

from __future__ import annotations

import ctypes
import os
import sys
from collections import OrderedDict

import torch

from .. import steptrace
from ..cache import GDNState, KVCache, StateBatch, key_span
from ..errors import KilnError
from ..indexcheck import checked

GRAPHABLE = (KVCache, GDNState)


def graphable(state: list) -> bool:
    return all(isinstance(layer, GRAPHABLE) for layer in state)


def signature(state: list) -> tuple:
    """The buffer addresses a graph captured over this state depends on (and the positions a KV
    buffer is reserved for: a ring's decode grid grows with them, its address does not)."""
    out = []
    for layer in state:
        if isinstance(layer, KVCache):
            out += [layer.k.data_ptr(), layer.v.data_ptr(), layer.capacity]
        else:
            out += [layer.conv.data_ptr(), layer.ssm.data_ptr()]
    return tuple(out)


class DecodeGraph:
    def __init__(self, model, device: torch.device):
        self.model, self.device = model, device
        self.store = getattr(model, "expert_store", None)
        self.ids = torch.zeros(1, dtype=torch.long, device=device)
        self.pos = torch.zeros(1, dtype=torch.long, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None
        self.logits: torch.Tensor | None = None
        self.key: tuple | None = None
        self.warm: tuple | None = None    # the signature an eager step has run on
        self.launches: int | None = None
        self.captures = 0
        self.failed = False               # a capture failed: decode eagerly

    def step(self, token: int, pos: int, state: list, quiet: bool = True) -> torch.Tensor:
        """The logits of one decode step fed `token` at `pos` (the host's inputs)."""
        self.ids.fill_(token)
        self.pos.fill_(pos)
        return self.run(state, quiet)

    def run(self, state: list, quiet: bool = True) -> torch.Tensor:
        """One decode step on the graph's own ids/pos: the host's (step) or the last step's greedy
        choice (the pipelined greedy loop). Asynchronous: nothing is read back."""
        key = signature(state)
        if self.failed:
            return self._body(state)[-1]
        if self.key != key:
            if self.warm != key:           # first step on these buffers: eager (compiles, allocates)
                self.warm = key
                return self._body(state)[-1]
            if not self._try_capture(state, key, quiet):
                return self._body(state)[-1]
        self.graph.replay()
        if self.store is not None:      # streamed experts read in place: the replay's ids counted later
            self.store.replayed()
        for layer in state:
            layer.length += 1
        return self.logits[-1]

    def _body(self, state: list) -> torch.Tensor:
        """The forward, then the greedy choice written into ids (and pos + 1) for the next step."""
        logits = self.model.forward(self.ids, self.pos, state)
        self.model.ops.greedy_next(logits[-1], self.ids, self.pos)
        return logits

    def greedy_tokens(self, token: int, pos: int, state: list, steps: int, fed: list, before=None,
                      quiet: bool = True):
        """The tokens of `steps` greedy decode steps after `token` fed at `pos`, chosen on the device;
        while the host reads one, the next step is already queued, so the GPU never waits for Python.
        A consumer that stops early leaves up to two more steps run: `fed` gets every token the state
        was fed, in order (completed when the generator closes). `before(k)` runs before step k."""
        cuda = self.device.type == "cuda"
        host = torch.empty(4, dtype=torch.long, pin_memory=cuda)
        events = [torch.cuda.Event() if cuda else None for _ in range(4)]
        self.ids.fill_(token)
        self.pos.fill_(pos)
        launched, read, known = 0, 0, [token]

        def launch() -> None:
            nonlocal launched
            if before is not None:
                before(launched)
            self.run(state, quiet)
            host[launched % 4 : launched % 4 + 1].copy_(self.ids, non_blocking=True)   # the token it chose
            if cuda:
                events[launched % 4].record()
            launched += 1

        def collect() -> int:
            nonlocal read
            if cuda:
                events[read % 4].synchronize()
            read += 1
            known.append(int(host[(read - 1) % 4]))
            return known[-1]

        try:
            while launched < min(2, steps):
                launch()
            while read < steps:
                tok = collect()
                if launched < steps:
                    launch()
                yield tok
        finally:
            while read < launched - 1:       # the steps run past the consumer: their fed tokens
                collect()
            fed.extend(known[:launched])

    def _try_capture(self, state: list, key: tuple, quiet: bool) -> bool:
        """Capture, or on failure (an op that is not graph-safe) warn once and decode eagerly from now on."""
        lengths = [layer.length for layer in state]
        try:
            self._capture(state, key, quiet)
            return True
        except Exception as e:        # noqa: BLE001 - any capture error means: run eagerly
            for layer, n in zip(state, lengths):
                layer.length = n
            self.failed, self.graph, self.logits, self.key = True, None, None, None
            torch.cuda.synchronize(self.device)
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"[kiln] warning: the decode step could not be captured as a CUDA graph ({why}); decoding eagerly",
                  file=sys.stderr)
            return False

    def _capture(self, state: list, key: tuple, quiet: bool) -> None:
        self.graph = self.logits = None
        lengths = [layer.length for layer in state]
        torch.cuda.synchronize(self.device)
        try:                 # keep_graph: the node list stays readable until instantiate()
            graph, kept = torch.cuda.CUDAGraph(keep_graph=True), True
        except TypeError:
            graph, kept = torch.cuda.CUDAGraph(), False
        with torch.cuda.graph(graph):
            logits = self._body(state)
        for layer, n in zip(state, lengths):
            layer.length = n
        self.launches = count_nodes(graph) if kept else None
        if kept:
            graph.instantiate()
        self.graph, self.logits, self.key = graph, logits, key
        self.captures += 1
        if not quiet:
            cap = max((layer.capacity for layer in state if isinstance(layer, KVCache)), default=0)
            n = "?" if self.launches is None else self.launches
            print(f"[kiln] decode step captured as one CUDA graph: {n} launches per token "
                  f"(context bucket {cap})", file=sys.stderr)


# The largest prefill graph's rows: its activations stay reserved in the graphs' memory pool (kiln.api
# counts them in a --gpu-memory budget); longer prompts are bound by the GPU, not the host, anyway.
PREFILL_GRAPH_ROWS = 2048


class PrefillGraphs:
    """Short prompts' prefill as CUDA graphs, one per length bucket (and start). A short prefill is
    bound by the host issuing its few hundred kernels (bench/NOTES.md: a 1,000-token prompt of the
    0.8b spends 5.7 ms in kernels and 18.8 ms of wall); a graph issues them in one launch.

    A prompt of n tokens runs its bucket's graph (b >= n: eight buckets an octave, so at most 1/8 of
    the rows are spare past 128), the spare rows after the prompt. The padding changes nothing the
    prompt computes: causal attention never lets a row see a later one, the spare rows' K/V land past
    the prompt where decode overwrites them, and the GDN layers are told the prompt's length
    (GDNState.valid) so spare rows leave their states as they were. The logits are row n-1's.

    Two forms: `run` on the engine's persistent state (GraphState; a KV buffer that grows changes the
    key), and `run_slot` for a batch's request on a pool slot: the graph prefills the pool's scratch
    slot, which no request holds, then copies it into the request's slot (a device input), so one
    graph a bucket serves every slot; it also runs a prompt's later part (after a cached prefix),
    the scratch slot given the request's state first. A bucket's first prompt runs the forward
    eagerly (it compiles, allocates), then it is captured (the capture runs nothing); later prompts
    replay it. KILN_PREFILL_GRAPHS=0 turns them off."""

    KEEP = 32           # graphs kept (least recently used dropped): one memory pool, so each costs little
    MIN = 16            # the smallest bucket
    SEEN = 256          # (bucket, offset) keys of later parts remembered, waiting for a second use

    def __init__(self, model, device: torch.device, max_tokens: int):
        self.model, self.device, self.max_tokens = model, device, max_tokens
        self.graphs: OrderedDict[tuple, tuple] = OrderedDict()    # key -> (graph, logits, ids, tail)
        self.seen: OrderedDict[tuple, None] = OrderedDict()       # later parts' keys met once (a set, oldest first)
        self.pool = None
        self.failed = False
        self.captures = 0
        self.replays = 0

    @staticmethod
    def enabled() -> bool:
        return os.environ.get("KILN_PREFILL_GRAPHS", "1") != "0"

    def bucket(self, n: int) -> int | None:
        """Rows of the graph a prompt of n tokens runs: n rounded up to 1/8 of its power of two."""
        step = max(self.MIN, (1 << max(n - 1, 0).bit_length()) // 8)
        b = -(-n // step) * step
        return b if b <= self.max_tokens else None

    def applies(self, n: int, room: int) -> bool:
        """Whether a part of n tokens, with room for `room` more positions, may run as a graph."""
        return self._usable([], self.bucket(n), room)

    def _usable(self, state: list, b: int | None, room: int, start: int = 0) -> bool:
        """No failed capture, a bucket, room for b positions in every KV buffer (no growth while
        captured), a state holding `start` tokens, and no streamed experts (placed on the host)."""
        return (not self.failed and b is not None and b <= room
                and getattr(self.model, "expert_store", None) is None
                and all(layer.length == start for layer in state))

    @staticmethod
    def _rows(layer, slot: torch.Tensor, start: int, count: int, n: torch.Tensor | None = None) -> torch.Tensor:
        """The stores' rows of positions start..start+count of slot `slot` (a device tensor [1]), through
        the layer's block table (kiln.cache.SlotPool). With `n` (the part's length, on the device), rows
        a windowed layer's ring must not take go to row 0 (the scratch's, not needed after): the padding
        past the part, and positions the ring's later ones overwrite (one write a row: no duplicates)."""
        pos = start + torch.arange(count, device=slot.device)
        rows = layer.pool.flat_rows(slot.expand(count), pos, layer.table)
        if n is None or layer.keeps >= layer.pool.capacity:
            return rows
        end = start + n
        return torch.where((pos < end) & (pos >= end - layer.keeps), rows, torch.zeros_like(rows))

    def run(self, ids: list[int], state: list, quiet: bool = True) -> torch.Tensor | None:
        """The logits of the prompt's last token with `state` fed the prompt, or None where no graph
        applies (the caller prefills eagerly)."""
        b = self.bucket(len(ids))
        room = min((layer.capacity for layer in state if isinstance(layer, KVCache)), default=b or 0)
        if not self._usable(state, b, room):
            return None
        body = lambda ids, tail: self._body(state, ids, tail)   # noqa: E731
        return self._run((b, signature(state)), ids, b, [], body, state, 0, quiet)

    def run_slot(self, ids: list[int], state: list, pool, offset: int = 0, quiet: bool = True) -> torch.Tensor | None:
        """`run` for a request whose state is a slot of `pool` (kiln.cache.SlotPool) holding `offset`
        tokens: a prompt's first part (offset 0), or a later one (the rest after where the prefix
        cache keeps its state). Offsets vary with the prompts, so a later part's (bucket, offset) is
        graphed only from the second time it comes (None the first time: the caller runs it)."""
        b = self.bucket(len(ids))
        if not self._usable(state, b, pool.capacity - offset, offset):
            return None
        scratch = pool.scratch
        key = (b, offset, pool.count, pool.capacity, signature(scratch))
        if offset and key not in self.graphs and key not in self.seen:
            self.seen[key] = None
            while len(self.seen) > self.SEEN:
                self.seen.popitem(last=False)
            return None
        self._set_length(scratch, offset)
        body = lambda ids, tail: self._slot_body(scratch, ids, tail, offset)   # noqa: E731
        logits = self._run(key, ids, b, [state[0].slot], body, scratch, offset, quiet)
        self._set_length(scratch, 0)
        self._set_length(state, offset + len(ids))
        return logits

    def _run(self, key: tuple, ids: list[int], b: int, extra: list[int], body, state: list, start: int,
             quiet: bool):
        """body(ids [b], tail [1 + len(extra)]: the part's length, then `extra`) replayed, or run and
        captured at the key's first use; `state` (holding `start` tokens) left holding the part too."""
        n = len(ids)
        host = torch.tensor(ids + [0] * (b - n) + [n] + extra, dtype=torch.long)
        steptrace.event("prefill_graph", rows=b, start=start, n=n, extra=extra,
                        how="replay" if key in self.graphs else "eager_then_capture")
        if key not in self.graphs:
            inputs = host[:b].to(self.device), host[b:].to(self.device)
            logits = body(*inputs)
            self._set_length(state, start + n)
            self._capture(key, inputs, body, state, start, quiet)
            return logits[0]
        self.graphs.move_to_end(key)
        graph, logits, *inputs = self.graphs[key]
        host = host.pin_memory()       # copied without waiting for the stream (upload)
        inputs[0].copy_(host[:b], non_blocking=True)
        inputs[1].copy_(host[b:], non_blocking=True)
        graph.replay()
        self.replays += 1
        self._set_length(state, start + n)
        return logits[0].clone()

    def _body(self, state: list, ids: torch.Tensor, tail: torch.Tensor, start: int = 0) -> torch.Tensor:
        n = tail[:1]
        gdn = [layer for layer in state if isinstance(layer, GDNState)]
        for layer in gdn:
            layer.valid = n
        try:
            pos = start + torch.arange(ids.shape[0], device=ids.device)
            return self.model.forward(ids, pos, state, last_only=n - 1)
        finally:
            for layer in gdn:
                layer.valid = None

    def _slot_body(self, scratch: list, ids: torch.Tensor, tail: torch.Tensor, offset: int) -> torch.Tensor:
        """The part prefilled in the scratch slot (first given the request's state: its GDN states and
        its first `offset` K/V rows; fresh at offset 0), then the states and the part's K/V rows copied
        into slot tail[1] of each layer's pool."""
        slot, b = tail[1:2], ids.shape[0]
        for layer in scratch:
            if isinstance(layer, GDNState):
                for mine, pool in ((layer.conv, layer.pool_conv), (layer.ssm, layer.pool_ssm)):
                    if offset:
                        mine.copy_(pool.index_select(0, checked(slot, pool.shape[0], "slot_state"))[0])
                    else:
                        mine.zero_()
            elif offset:
                rows = self._rows(layer, slot, 0, offset)
                for pool, part in ((layer.pool_k, layer.k), (layer.pool_v, layer.v)):
                    part[:offset].copy_(pool.index_select(0, rows))
        logits = self._body(scratch, ids, tail, offset)
        for layer in scratch:      # (the sources are cloned: index_copy_ refuses a view of its own pool)
            if isinstance(layer, GDNState):
                layer.pool_conv.index_copy_(0, slot, layer.conv[None].clone())
                layer.pool_ssm.index_copy_(0, slot, layer.ssm[None].clone())
            else:
                rows = self._rows(layer, slot, offset, b, tail[:1])
                for pool, part in ((layer.pool_k, layer.k), (layer.pool_v, layer.v)):
                    pool.index_copy_(0, rows, part[offset:offset + b].clone())
        return logits

    @staticmethod
    def _set_length(state: list, n: int) -> None:
        for layer in state:
            layer.length = n

    def _capture(self, key: tuple, inputs: tuple, body, state: list, start: int, quiet: bool) -> None:
        """Capture the bucket's forward. The state already holds the part (the capture runs nothing),
        but the forward reads each layer's length as where the part starts: `start` while capturing."""
        n = state[0].length
        torch.cuda.synchronize(self.device)
        self._set_length(state, start)
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                logits = body(*inputs)
        except Exception as e:        # noqa: BLE001 - any capture error means: prefill eagerly
            self.failed = True
            torch.cuda.synchronize(self.device)
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"[kiln] warning: prefills could not be captured as CUDA graphs ({why}); running them eagerly",
                  file=sys.stderr)
            return
        finally:
            self._set_length(state, n)
        self.graphs[key] = (graph, logits, *inputs)
        while len(self.graphs) > self.KEEP:
            self.graphs.popitem(last=False)
        self.captures += 1
        if not quiet:
            at = f" at position {key[1]}" if len(key) > 2 and key[1] else ""
            print(f"[kiln] prefill of up to {key[0]} tokens{at} captured as one CUDA graph", file=sys.stderr)


def count_nodes(graph: torch.cuda.CUDAGraph) -> int | None:
    """Kernel, copy and memset nodes of a captured graph (the driver's cuGraphGetNodes), or None."""
    try:
        lib = ctypes.CDLL("libcuda.so.1")
        count = ctypes.c_size_t(0)
        if lib.cuGraphGetNodes(ctypes.c_void_p(graph.raw_cuda_graph()), None, ctypes.byref(count)) != 0:
            return None
        return int(count.value)
    except Exception:                   # no driver library, a torch without the accessor
        return None


class BatchGraphs:
    """Batched decode steps (Engine.decode_batch over one SlotPool's states) as CUDA graphs, one per
    batch bucket (powers of two up to the pool's slots, and the slot count): B rows replay the
    graph of the first bucket >= B, its spare rows on the pool's scratch slot (position 0). The
    graph's inputs are the rows' tokens, positions and slots, so it serves any requests of the pool.
    A bucket's first step runs eagerly (compiles, allocates), its second is captured. The per-layer
    objects the forward sees stand in for the requests (StateBatch.whole_only): an op that would
    run request by request fails the capture, and batched steps then run eagerly."""

    def __init__(self, model, device: torch.device, pool):
        self.model, self.device, self.pool = model, device, pool
        self.buckets = sorted({1 << i for i in range(pool.count.bit_length()) if 1 << i <= pool.count} | {pool.count})
        self.graphs: dict[int, tuple] = {}       # bucket -> (graph, logits, ids, pos, slots)
        self.warm: set[int] = set()
        self.failed = False
        self.captures = 0

    def ready(self, rows: int, positions: list[int]) -> bool:
        """Whether a step of `rows` rows at `positions` would replay a captured graph as it is (no
        eager warm-up, no capture: what a decode step launched inside a prefill's layers may run)."""
        bucket = next((k for k in self.buckets if k >= rows), None)
        return (not self.failed and bucket in self.graphs
                and self.graphs[bucket][0] == key_span(max(positions)))

    def step(self, tokens: list[int], positions: list[int], slots: list[int], states: list[list],
             quiet: bool = True) -> torch.Tensor | None:
        """The logits [B, V] of one decode step of the rows, states advanced; None where it cannot run
        here (more rows than the largest bucket, an earlier failed capture): run it eagerly then."""
        b = len(tokens)
        bucket = next((k for k in self.buckets if k >= b), None)
        if bucket is None or self.failed:
            return None
        spare, keys = bucket - b, key_span(max(positions))
        host = torch.tensor([tokens + [0] * spare, positions + [0] * spare, slots + [self.pool.count] * spare])
        steptrace.event("batch_graph", bucket=bucket, rows=b, keys=keys,
                        how="warm" if bucket not in self.warm else "replay" if
                        self.graphs.get(bucket, (None,))[0] == keys else "capture")
        if bucket not in self.warm:
            self.warm.add(bucket)
            self._warm(bucket, keys)
            return None
        if self.graphs.get(bucket, (keys,))[0] != keys:      # the rows' keys passed its span: captured again
            del self.graphs[bucket]
        if bucket not in self.graphs:
            if (logits := self._capture(bucket, keys, host.to(self.device), quiet)) is None:
                return None
        else:
            _, graph, logits, ids, pos, slot_ids = self.graphs[bucket]
            host = host.pin_memory()    # copied without waiting for the stream (upload)
            for dst, src in zip((ids, pos, slot_ids), host):
                dst.copy_(src, non_blocking=True)
            graph.replay()
        for state in states:
            for layer in state:
                layer.length += 1
        return logits[:b]

    def _warm(self, bucket: int, keys: int) -> None:
        """The bucket's step run once eagerly with every row on the scratch slot (its kernels compiled,
        its workspaces allocated; no request's state touched). An op that would run request by request
        stops it: no graphs then."""
        scratch = torch.full((bucket,), self.pool.count, device=self.device)
        zeros = torch.zeros(bucket, dtype=torch.long, device=self.device)
        lengths = [layer.length for layer in self.pool.scratch]
        try:
            self._body(zeros, zeros, scratch, keys)
        except KilnError as e:
            self.failed = True
            print(f"[kiln] warning: batched decode steps run eagerly ({e})", file=sys.stderr)
        finally:
            for layer, n in zip(self.pool.scratch, lengths):
                layer.length = n

    def _body(self, ids, pos, slots, keys: int) -> torch.Tensor:
        rows = ids.shape[0]
        layers = [StateBatch([layer] * rows) for layer in self.pool.scratch]
        slots, flat = slots.to(torch.int32), self.pool.flat_rows_all(slots, pos)
        for layer in layers:
            layer.slots, layer.keys, layer.flat, layer.whole_only = slots, keys, flat, True
        return self.model.forward(ids, pos, layers, last_only=False)

    def _capture(self, bucket: int, keys: int, inputs: torch.Tensor, quiet: bool) -> torch.Tensor | None:
        ids, pos, slots = (t.clone() for t in inputs)
        lengths = [layer.length for layer in self.pool.scratch]
        torch.cuda.synchronize(self.device)
        try:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                logits = self._body(ids, pos, slots, keys)
        except Exception as e:        # noqa: BLE001 - any capture error means: run eagerly
            self.failed = True
            torch.cuda.synchronize(self.device)
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            print(f"[kiln] warning: batched decode steps could not be captured as CUDA graphs ({why}); "
                  "running them eagerly", file=sys.stderr)
            return None
        finally:
            for layer, n in zip(self.pool.scratch, lengths):
                layer.length = n
        self.graphs[bucket] = (keys, graph, logits, ids, pos, slots)
        self.captures += 1
        if not quiet:
            print(f"[kiln] batched decode step of {bucket} rows captured as one CUDA graph (keys below {keys})",
                  file=sys.stderr)
        graph.replay()     # the capture ran nothing: this step runs now
        return logits
