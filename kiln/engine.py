"""The generation loop: chunked prefill, then one token per decode step over the per-layer state.

Plain Python bookkeeping around the model runner; no token is re-run once its state is cached.
Each request chooses its token source once (the host's sampler over decode steps, or the greedy
choice made on the device); one loop around it keeps time, stops, and checks the request still owns
its state.
"""

from __future__ import annotations

import itertools
import os
import sys
import time
import weakref
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from . import indexcheck, steptrace
from .backends.graphs import PREFILL_GRAPH_ROWS, BatchGraphs, DecodeGraph, PrefillGraphs, graphable
from .cache import PAGE, PagedKV, PagedPrefix, SlotPool, StateBatch, key_span, pages_for, restore, snapshot, upload
from .errors import KilnError
from .sampling import Sampler, SamplingParams, sample_rows


@dataclass
class StepTimes:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    cached_tokens: int = 0     # prompt tokens whose state was reused from the previous request


@dataclass
class TokenStream:
    """Iterates generated token ids; `finish_reason` and `times` are final once exhausted."""
    ids: Iterator[int]
    times: StepTimes = field(default_factory=StepTimes)
    finish_reason: str | None = None    # "length" (max_new_tokens) | "context" (the max context) | "eos"


class GraphState(list):
    """The per-layer state the CUDA graph runs on: one per engine, reset for each request. Decode
    steps on it replay the graph; on any other state they run eagerly."""


@dataclass
class _Request:
    """One generate() call: its stream, its state and what that state was fed."""
    stream: TokenStream
    state: list
    consumed: list[int]     # the ids the state holds, grown as decode steps feed it (prefix reuse)
    reuse: bool
    on_graph: bool          # the state is the engine's GraphState


MIN_BUCKET = 2048   # smallest KV reservation when decode runs as a CUDA graph
POOL_CONTEXT = 32768    # a pooled batch slot's KV positions at most (a longer request gets its own state)
POOL_MEMORY = 0.6       # share of the free device memory a batch's slot pool may take
MAX_POOL = 64           # slots for LLM.generate's batches (more prompts wait for a free one)
PREFIX_BLOCK = 64       # a batch's prefix cache keeps state at multiples of this many prompt tokens
PREFIX_ENTRIES = 8      # ... for this many prefixes, the least recently used dropped first
# Batch._check at every step (debugging): 1 on the host only, 2 the block table read back too (a sync)
CHECK_POOL = int(os.environ.get("KILN_CHECK_POOL", "0") or 0)
# what a decode step launched inside a GPU prefill may not do (docs/batching.md, the index assert, fixed in
# kiln/ops/counters.py): "none" (default) anything a step does; "pages" only take free pages (no
# preemption, no prefix drop); "graphs" only replay a ready graph; "both" the two (the workaround of
# before the fix, ~6% slower under page pressure)
INSIDE = os.environ.get("KILN_INSIDE", "none")


class Engine:
    def __init__(self, model, dtype, device, max_context: int, prefill_chunk: int = 512,
                 graphs: bool = False, quiet: bool = True, batch_graphs: bool = True):
        self.model, self.dtype, self.device = model, dtype, torch.device(device)
        if INSIDE not in ("none", "pages", "graphs", "both"):
            raise KilnError(f"KILN_INSIDE takes none, pages, graphs or both, not {INSIDE!r}")
        indexcheck.prepare(self.device)
        self.max_context, self.prefill_chunk = max_context, prefill_chunk
        self.quiet = quiet
        # Prefix reuse (off unless asked for): the last reusing request, whose state and consumed ids
        # serve a prompt that shares a prefix with them, so only the rest is prefilled.
        self.reuse_prefix = False
        self._kept: _Request | None = None
        # CUDA-graph decode: one persistent state, reset per request (kiln/backends/graphs.py).
        self.graph = None
        self._state: GraphState | None = None
        self._owner: _Request | None = None
        self._pool: SlotPool | None = None
        self.pool_limit: tuple | None = None    # (slots, context, pages) a --gpu-memory budget planned
        self._batch_graphs: BatchGraphs | None = None      # the pool's batched steps as graphs
        self.batch_graphs_on = graphs and batch_graphs and self.device.type == "cuda"
        self.prefill_graphs: PrefillGraphs | None = None    # short prefills as graphs: GraphState and pool slots
        if graphs and self.device.type == "cuda":   # dropped at the first state if it is not graphable
            self.graph = DecodeGraph(model, self.device)
            if PrefillGraphs.enabled():
                self.prefill_graphs = PrefillGraphs(model, self.device, min(prefill_chunk, PREFILL_GRAPH_ROWS))

    def new_state(self, tokens: int) -> list:
        """Per-layer state for a request of up to `tokens` positions: fresh, or with CUDA graphs the
        persistent GraphState, reset, its KV reserved for the context bucket holding `tokens`."""
        if self.graph is not None and self._state is None:
            # (not probed on the meta device at construction: meta tensors import torch._refs, ~2 s)
            state = self.capped(self.model.make_state(self.dtype, self.device))
            if graphable(state):
                self._state = GraphState(state)
            else:
                self.graph = None
        if self.graph is None:
            return self.capped(self.model.make_state(self.dtype, self.device))
        if self._kept is not None and self._kept.state is self._state:
            self._kept = None       # its prefix is about to be overwritten: nothing is left to reuse
        for layer in self._state:
            layer.reset()
        self.reserve(self._state, tokens)
        return self._state

    def slot_pool(self, slots: int) -> SlotPool | None:
        """The pool a batch's requests take their state from, with room for `slots` at once, on a backend
        whose batched decode kernels read pooled state (`ops.pooled`); None elsewhere, or where a
        layer's state cannot be pooled (ring caches). Made at the first batch that asks."""
        if not getattr(self.model.ops, "pooled", False):
            return None
        asked = slots
        if self.pool_limit is not None:         # a --gpu-memory budget planned the pool (kiln.api.batch_pool)
            slots = min(slots, self.pool_limit[0])
        if self._pool is not None and self._pool.count >= slots:
            return self._pool
        template = self.model.make_state(self.dtype, self.device)
        if not SlotPool.poolable(template) or (shape := self._pool_shape(template, slots)) is None:
            return None
        cap, pages = shape
        self._pool = SlotPool(template, slots, cap, pages)
        self._batch_graphs = BatchGraphs(self.model, self.device, self._pool) if self.batch_graphs_on else None
        if not self.quiet:
            gb = (SlotPool.bytes_per_slot(template, cap, rings=False) + slots * SlotPool.ring_bytes(template, cap)
                  + pages * SlotPool.page_bytes(template, cap)) / 1e9
            why = f": the concurrent requests --gpu-memory allows ({asked} asked)" if slots < asked else ""
            print(f"[kiln] batch state: {slots} slots of up to {cap} tokens each, KV in {pages} pages of {PAGE} "
                  f"tokens ({gb:.1f} GB; {_count(pages // pages_for(cap), 'request')} of {cap} tokens at once, "
                  f"more when shorter){why}", file=sys.stderr)
        return self._pool

    def _pool_shape(self, template: list, slots: int) -> tuple[int, int] | None:
        """(positions a request may hold, KV pages shared by the slots). A request holds up to the max
        context (at most POOL_CONTEXT); the pages are as many as `slots` such requests need, fewer where
        they would pass POOL_MEMORY of the free device memory (None: not 256 positions' worth); requests
        take them as they grow, so more short requests run at once than requests of the whole context.
        Under a --gpu-memory budget, the context and pages it planned (kiln.api.batch_pool)."""
        if self.pool_limit is not None:
            return self.pool_limit[1], self.pool_limit[2]
        cap = min(self.max_context, POOL_CONTEXT)
        pages = slots * pages_for(cap)
        if self.device.type == "cuda":      # the scratch slot, each slot's GDN states and rings, then pages
            room = (POOL_MEMORY * torch.cuda.mem_get_info(self.device)[0]
                    - SlotPool.bytes_per_slot(template, cap, rings=False) - slots * SlotPool.ring_bytes(template, cap))
            pages = min(pages, int(room // max(SlotPool.page_bytes(template, cap), 1)))
        return (cap, pages) if pages * PAGE >= min(256, self.max_context) else None

    def capped(self, state: list) -> list:
        """A KV cache never grows past the max context (its doubling would, up to twice over, and
        --gpu-memory sizes the cache at the max context)."""
        for layer in state:
            if hasattr(layer, "limit"):
                layer.limit = self.max_context
        return state

    def reserve(self, state: list, tokens: int) -> None:
        bucket = min(max(MIN_BUCKET, 1 << max(tokens - 1, 0).bit_length()), self.max_context)
        for layer in state:
            if hasattr(layer, "reserve"):
                layer.reserve(bucket)

    @property
    def live_state(self) -> list | None:
        """The state of the request that ran last (kept for prefix reuse, or the graph's): what it holds."""
        owner = self._kept or self._owner
        return owner.state if owner is not None else None

    @property
    def launches_per_token(self) -> int | None:
        return None if self.graph is None else self.graph.launches

    @torch.inference_mode()
    def prefill(self, ids: list[int], state, offset: int = 0) -> torch.Tensor:
        """Run the prompt through the model in chunks, from position `offset` on (the state already
        holds the first `offset` tokens); logits of the last position. A prompt that fits one chunk
        from position 0 on the CUDA-graph state replays its length bucket's graph (PrefillGraphs)."""
        if (offset == 0 and self.prefill_graphs is not None and isinstance(state, GraphState)
                and (logits := self.prefill_graphs.run(ids, state, self.quiet)) is not None):
            return logits
        logits = None
        for start in range(0, len(ids), self.prefill_chunk):
            chunk = upload(ids[start:start + self.prefill_chunk], self.device)
            pos = torch.arange(offset + start, offset + start + len(chunk), device=self.device)
            logits = self.model.forward(chunk, pos, state)
        return logits[-1]

    @torch.inference_mode()
    def prefill_rows(self, parts: list[tuple[list[int], list, int]]) -> torch.Tensor:
        """Several prompts' chunks in one forward: part j feeds ids_j from position offset_j into
        state_j (its own per-layer state); the logits of each part's last row, [J, V]. Projections,
        norms and MLPs run once over every row, attention and the GDN scan per request
        (StateBatch.rows): a short prompt's prefill is bound by the host issuing its kernels, and
        this issues most of them once for all. The parts should fit one prefill chunk together."""
        rows = [len(ids) for ids, _, _ in parts]
        layers = [StateBatch(layer) for layer in zip(*(state for _, state, _ in parts))]
        for layer in layers:
            layer.rows = rows
        ids = upload([t for part, _, _ in parts for t in part], self.device)
        pos = upload([off + k for part, _, off in parts for k in range(len(part))], self.device)
        last = upload([a + n - 1 for a, n in zip(itertools.accumulate([0] + rows), rows)], self.device)
        return self.model.forward(ids, pos, layers, last_only=last)

    @torch.inference_mode()
    def decode_step(self, token: int, pos: int, state) -> torch.Tensor:
        """The logits of one decode step fed `token` at `pos`."""
        step = self._graph_step if isinstance(state, GraphState) else self._eager_step
        return step(token, pos, state)

    @torch.inference_mode()
    def greedy_tokens(self, token: int, pos: int, state, steps: int, fed: list | None = None, before=None):
        """The tokens of `steps` greedy decode steps after `token` fed at `pos`. On the CUDA-graph
        state the device picks each token and one step is queued ahead (DecodeGraph.greedy_tokens);
        `fed` gets the tokens the state was fed, `before(k)` runs before step k is queued."""
        fed = [] if fed is None else fed
        tokens = self._graph_greedy if isinstance(state, GraphState) else self._eager_greedy
        yield from tokens(token, pos, state, steps, fed, before)

    def _graph_step(self, token: int, pos: int, state) -> torch.Tensor:
        return self.graph.step(token, pos, state, self.quiet)

    def _eager_step(self, token: int, pos: int, state) -> torch.Tensor:
        ids = torch.tensor([token], device=self.device)
        return self.model.forward(ids, torch.tensor([pos], device=self.device), state)[-1]

    def _graph_greedy(self, token: int, pos: int, state, steps: int, fed: list, before):
        return self.graph.greedy_tokens(token, pos, state, steps, fed, before, self.quiet)

    def _eager_greedy(self, token: int, pos: int, state, steps: int, fed: list, before):
        for k in range(steps):
            if before is not None:
                before(k)
            logits = self._eager_step(token, pos + k, state)
            fed.append(token)
            token = int(torch.argmax(logits))
            yield token

    @torch.inference_mode()
    def decode_batch(self, tokens: list[int], positions: list[int], states: list[list]) -> torch.Tensor:
        """One decode step of several requests, row j feeding tokens[j] at positions[j] into states[j]
        (each its own per-layer state): the logits [B, V]. Projections, norms and MLPs run on all rows
        at once; attention and the GDN recurrence per request (kiln.cache.StateBatch), or for all rows
        in one kernel when the states are slots of the engine's pool, then with CUDA graphs on as one
        graph per batch bucket (kiln.backends.graphs.BatchGraphs). The logits are valid until the
        next step."""
        slots = SlotPool.slots_of(states)
        if (self._graphed(states, slots)
                and (logits := self._batch_graphs.step(tokens, positions, slots, states, self.quiet)) is not None):
            return logits
        ids, pos = upload(tokens, self.device), upload(positions, self.device)   # not waiting for the stream
        layers = [StateBatch(layer) for layer in zip(*states)]
        if slots is not None:     # one launch a layer reads every request's slot
            slot_ids, keys = upload(slots, self.device, torch.int32), key_span(max(positions))
            pool = next((layer.pool for layer in states[0] if isinstance(layer, PagedKV)), None)
            flat = None if pool is None else pool.flat_rows_all(slot_ids, pos)
            for layer in layers:
                layer.slots, layer.keys, layer.flat = slot_ids, keys, flat
        ops = self.model.ops
        ops.rows_apart = getattr(ops, "batch_invariant", False)     # each row its single-row products
        try:
            return self.model.forward(ids, pos, layers, last_only=False)
        finally:
            ops.rows_apart = False

    def _graphed(self, states: list[list], slots: list[int] | None) -> bool:
        """Whether a batched step of these rows (their pool slots: SlotPool.slots_of) goes to the
        engine pool's graphs (BatchGraphs)."""
        return (slots is not None and self._batch_graphs is not None
                and states[0][0] is self._pool.states[slots[0]][0])

    def replays(self, positions: list[int], states: list[list]) -> bool:
        """Whether decode_batch of these rows would replay a captured graph as it is."""
        return self._graphed(states, SlotPool.slots_of(states)) and self._batch_graphs.ready(len(states), positions)

    def generate_batch(self, prompts: list[list[int]], params: list[SamplingParams], eos_ids) -> list[TokenStream]:
        """Token streams of several requests decoded together (kiln.engine.Batch): each stream's ids
        advance the shared batch as they are read, so they may be read in any order or interleaved."""
        for ids, p in zip(prompts, params):
            self.check_prompt(ids)
            p.validate()
        batch = Batch(self, set(eos_ids), slots=min(len(prompts), MAX_POOL))
        return [batch.add(ids, p).stream for ids, p in zip(prompts, params)]

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise KilnError("empty prompt")
        if len(ids) >= self.max_context:
            raise KilnError(f"prompt has {len(ids)} tokens, which does not fit the max context of "
                            f"{self.max_context} tokens (raise --max-context or shorten the prompt)")

    def generate(self, prompt_ids: list[int], params: SamplingParams, eos_ids,
                 reuse: bool | None = None) -> TokenStream:
        """Token ids as they are sampled. With `reuse` (default: `self.reuse_prefix`) the state of the
        previous reusing request serves the prefix this prompt shares with it.
        NOTE: with reuse, starting a request ends any earlier unfinished reusing stream."""
        self.check_prompt(prompt_ids)
        params.validate()
        stream = TokenStream(iter(()))
        stream.ids = self._loop(prompt_ids, params, set() if params.ignore_eos else set(eos_ids), stream,
                                self.reuse_prefix if reuse is None else reuse)
        return stream

    @torch.inference_mode()     # the token sources call the step functions directly, not the public ones
    def _loop(self, prompt_ids, params, eos, stream: TokenStream, reuse: bool):
        """The one decode loop, around the token source the request chose: timing, the eos, length and
        max-context stops (its finish reason). It lets the source run no decode step for a token nobody will read."""
        times = stream.times
        times.prompt_tokens = len(prompt_ids)
        req, times.cached_tokens = self._start(prompt_ids, params.max_new_tokens, stream, reuse)
        source = self._source(req, params)
        t0 = time.perf_counter()
        logits = self.prefill(prompt_ids[times.cached_tokens:], req.state, offset=times.cached_tokens)
        if reuse:
            self._kept = req
        stream.finish_reason = "length"
        # decode step k feeds the k-th generated token at position len(prompt) + k
        steps = min(params.max_new_tokens - 1, self.max_context - 1 - len(prompt_ids))
        tokens = source(logits, max(steps, 0))
        try:
            for token in tokens:
                now = time.perf_counter()
                if times.generated_tokens == 0:
                    times.prefill_s, t0 = now - t0, now     # prefill includes choosing the first token
                times.generated_tokens += 1
                times.decode_s = now - t0
                yield token
                if token in eos:
                    stream.finish_reason = "eos"
                    return
        finally:
            tokens.close()      # the pipelined source completes `consumed` with the steps run past us
        times.decode_s = time.perf_counter() - t0
        if times.generated_tokens < params.max_new_tokens:
            stream.finish_reason = "context"    # the max context ran out first: the user should know why

    def _start(self, ids: list[int], max_new: int, stream: TokenStream, reuse: bool) -> tuple[_Request, int]:
        """The request, owning its state, and how many prompt tokens that state already holds."""
        if reuse:
            state, cached = self._reused_state(ids, max_new)
        else:
            state, cached = self.new_state(len(ids) + max_new), 0
        req = _Request(stream, state, list(ids), reuse, on_graph=isinstance(state, GraphState))
        self._owner = req
        return req, cached

    def _reused_state(self, ids: list[int], max_new: int) -> tuple[list, int]:
        """The kept state rewound to the prefix it shares with `ids` (leaving at least one token to
        prefill, for the logits), or a fresh state when nothing is shared or a layer cannot rewind."""
        kept, self._kept = self._kept, None
        if kept is not None:
            n = min(_common_prefix(kept.consumed, ids), len(ids) - 1)
            if n > 0 and all(layer.truncate(n) for layer in kept.state):
                if kept.on_graph:
                    self.reserve(kept.state, len(ids) + max_new)
                return kept.state, n
        return self.new_state(len(ids) + max_new), 0

    def _source(self, req: _Request, params: SamplingParams) -> Callable[[torch.Tensor, int], Iterator[int]]:
        """The request's token source, chosen once: given the prefill's logits and how many decode
        steps it may run, its tokens. Greedy without a repetition penalty takes the device's choice
        (one step queued ahead on the CUDA graph); every other request the host's sampler."""
        if params.greedy and params.repetition_penalty == 1.0:
            more = self._graph_greedy if req.on_graph else self._eager_greedy
            return lambda logits, steps: self._greedy(req, logits, steps, more)
        step = self._graph_step if req.on_graph else self._eager_step
        sampler = Sampler(params, self.device)
        history = upload(req.consumed, self.device) if params.repetition_penalty != 1.0 else None
        return lambda logits, steps: self._sampled(req, logits, steps, step, sampler, history)

    def _greedy(self, req: _Request, logits, steps: int, more) -> Iterator[int]:
        """The argmax of the prefill's logits, then `more` greedy tokens. On the graph the state may
        run up to two steps past a stop: `consumed` still lists exactly what it was fed."""
        token, pos = int(torch.argmax(logits)), len(req.consumed)
        yield token
        yield from more(token, pos, req.state, steps, req.consumed, lambda k: self._check_owner(req))

    def _sampled(self, req: _Request, logits, steps: int, step, sampler: Sampler, history) -> Iterator[int]:
        """The sampler's choice from each step's logits; `history` (the fed ids) is for its repetition
        penalty (None without one)."""
        pos = len(req.consumed)
        token = sampler(logits, history)
        for k in range(steps):
            yield token
            self._check_owner(req)
            if history is not None:
                history = torch.cat([history, upload([token], history.device)])
            logits = step(token, pos + k, req.state)
            req.consumed.append(token)
            token = sampler(logits, history)
        yield token

    def _check_owner(self, req: _Request) -> None:
        if (req.reuse and self._kept is not req) or (req.on_graph and self._owner is not req):
            raise RuntimeError("this stream's state was taken over by a newer request")


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


_SERIALS = itertools.count()


@dataclass(eq=False)      # a request is itself: queues find and remove it by identity, not by its fields
class BatchRequest:
    """One request of a Batch: its prompt, its state, the token it feeds next and what it made."""
    ids: list[int]
    params: SamplingParams
    stream: TokenStream
    steps: int                          # decode steps it may run (max_new_tokens - 1, or to the max context)
    state: list | None = None           # None until prefilled
    token: int = -1                     # the token the next decode step feeds
    pos: int = 0                        # ... at this position
    sampler: Sampler | None = None      # None: greedy (argmax, no repetition penalty)
    history: torch.Tensor | None = None  # the fed ids, for the sampler's repetition penalty
    out: deque = field(default_factory=deque)    # made, not yet read
    done: bool = False
    cancelled: bool = False
    t0: float = 0.0
    keep_at: int = 0                    # the prompt position whose state the prefix cache keeps (0: none)
    span: int = 0                       # the positions it may reach: its prompt and its decode steps
    room: int = 0                       # positions its pool pages hold (0: none taken; own state: past span)
    made: list = field(default_factory=list)     # every token it made (a preempted request prefills them again)
    serial: int = field(default_factory=lambda: next(_SERIALS))     # names it in a KILN_TRACE file


class PrefixCache:
    """States of prompt prefixes that later requests may start from: a copy of the state after the
    first n tokens (n a multiple of PREFIX_BLOCK), keyed by those token ids, the least recently used
    of PREFIX_ENTRIES dropped. A request that shares a cached prefix copies its state and prefills
    only the rest (attention K/V and, for hybrid models, the GDN states alike)."""

    def __init__(self, entries: int = PREFIX_ENTRIES, block: int = PREFIX_BLOCK):
        self.entries, self.block = entries, block
        self.items: OrderedDict[tuple, list] = OrderedDict()

    def boundary(self, ids: list[int]) -> int:
        """Where a prompt's state is kept: its last block boundary before its last token (one token
        must be left to prefill, for the logits)."""
        return (len(ids) - 1) // self.block * self.block

    def lookup(self, ids: list[int]) -> tuple[int, list | None]:
        """The longest cached prefix of ids, as (tokens, snapshot), or (0, None)."""
        for n in range(self.boundary(ids), 0, -self.block):
            saved = self.items.get(key := tuple(ids[:n]))
            if saved is not None:
                self.items.move_to_end(key)
                return n, saved
        return 0, None

    def keep(self, ids: list[int], state: list, pool: SlotPool | None = None) -> None:
        """The state after ids kept: a pool slot's K/V pages shared as they are (SlotPool.share), else copied."""
        key = tuple(ids)
        if key in self.items:
            return
        mine = pool is not None and SlotPool.slots_of([state]) is not None
        saved = pool.share(state, len(ids)) if mine else snapshot(state)
        if saved is None:
            return
        self.items[key] = saved
        while len(self.items) > self.entries:
            self.drop_oldest()

    def clear(self) -> None:
        while self.drop_oldest():
            pass

    def drop_oldest(self) -> bool:
        """The least recently used prefix forgotten (its pages freed where no request holds them)."""
        if not self.items:
            return False
        _, saved = self.items.popitem(last=False)
        if isinstance(saved, PagedPrefix):
            saved.release()
        return True


class _Abandoned(Exception):
    """The request being prefilled was cancelled from inside its own prefill: the rest is not run."""


class Batch:
    """Requests decoded together. Each step prefills one chunk (the engine's prefill chunk, so the
    chunks fall where a single request's do) of the oldest waiting request, then runs one decode step
    for every running request (Engine.decode_batch): a long prompt joining costs the running streams
    one chunk's time a step, never the whole prompt's. Tokens follow the single-request loop's rules
    (Engine._loop): the same token choice, the same eos, length and max-context stops.

    With `interleave` (on by default on a GPU) more decode steps run inside a prefill chunk: after any
    layer of the chunk where the step in flight has finished, its tokens are read and the next step
    launched. A short prompt's prefill is bound by the host issuing its kernels, not by the GPU; the
    decode steps fill the GPU meanwhile instead of waiting for the chunk to end.

    With `group_prefill` the prompts waiting behind the oldest one join its forward while their next
    part fits the chunk's token budget whole (Engine.prefill_rows): a burst of short prompts issues
    its kernels once, not once a prompt.

    On a slot pool a request takes the KV pages of its prompt when it starts and one more each PAGE
    tokens it makes (_grow); where too few are free, the newest running request is preempted: freed,
    queued again with the tokens it made appended to its prompt, and prefilled again later."""

    def __init__(self, engine: "Engine", eos: set[int], slots: int | None = None, prefix_cache: bool = False,
                 interleave: bool | None = None, group_prefill: bool | None = None):
        """`slots`: the most requests running at once, when the engine pools their state (Engine.slot_pool);
        a request waits for a free slot before its prefill. `prefix_cache`: requests start from the
        state of a cached prompt prefix they share (PrefixCache). `interleave`: decode steps inside
        prefill chunks (default: on a CUDA device). `group_prefill`: several waiting prompts prefilled in
        one forward (Engine.prefill_rows) where the model can (default: on backends that are not
        batch-invariant, whose prefill products change with the row count anyway)."""
        self.engine, self.eos = engine, eos
        self.cuda = torch.device(engine.device).type == "cuda"
        if interleave is None:   # KILN_INTERLEAVE=1 or 0 overrides the default
            interleave = {"1": True, "0": False}.get(os.environ.get("KILN_INTERLEAVE", ""), self.cuda)
        self.interleave = interleave
        # called after the tokens of a step run inside a prefill are read: a server streams them then
        self.on_tokens: Callable[[], None] | None = None
        self._in_step = False                  # a decode step is being launched (the layer hook stays out)
        self._prefilling: list[BatchRequest] = []      # the requests whose prefill forward is running
        if group_prefill is None:   # KILN_GROUP_PREFILL=1 or 0 overrides the default
            group_prefill = {"1": True, "0": False}.get(os.environ.get("KILN_GROUP_PREFILL", ""),
                                                        not getattr(engine.model.ops, "batch_invariant", False))
        self.group_prefill = group_prefill and engine.model.several_prompts
        self.prefixes = PrefixCache() if prefix_cache else None
        self.pool = engine.slot_pool(slots) if slots else None
        if self.prefixes is not None:   # its kept pages go back to the engine's pool with the batch
            weakref.finalize(self, self.prefixes.clear)
        self.slots, self.lent, self.preempted = slots, 0, 0
        self.pending: tuple | None = None      # the step in flight: (its requests, their tokens, its end event)
        self.waiting: deque[BatchRequest] = deque()
        self.running: list[BatchRequest] = []

    def add(self, ids: list[int], params: SamplingParams) -> BatchRequest:
        """A request joins: prefilled at a coming step. Read its tokens from `request.stream.ids` (which
        steps the batch as needed), or step the batch yourself and take them from `request.out`."""
        eng = self.engine
        stream = TokenStream(iter(()))
        stream.times.prompt_tokens = len(ids)
        stream.finish_reason = "length"
        steps = max(min(params.max_new_tokens - 1, eng.max_context - 1 - len(ids)), 0)
        r = BatchRequest(list(ids), params, stream, steps, span=len(ids) + steps)
        stream.ids = self._tokens(r)
        self.waiting.append(r)
        return r

    def cancel(self, r: BatchRequest) -> None:
        """The request leaves at the next step (its reader is gone); its state is freed now."""
        if not r.done:
            steptrace.event("cancel", r=r.serial)
            r.cancelled = r.done = True
            self._release(r)
        if r in self.waiting:
            self.waiting.remove(r)

    def __len__(self) -> int:
        """Requests waiting or running (a step in flight counts until its tokens are read)."""
        return len(self.waiting) + sum(not r.done for r in self.running) + (self.pending is not None)

    def _tokens(self, r: BatchRequest):
        try:
            while True:
                while not r.out and not r.done:
                    self.step()
                if not r.out:
                    return
                yield r.out.popleft()
        finally:
            self.cancel(r)       # a reader that stopped early (a stop string, a closed stream) frees its row

    @torch.inference_mode()
    def step(self) -> None:
        """The tokens of the decode step in flight, then the next decode step launched for every running
        request (not waited for: the caller's work on the tokens overlaps it on the GPU), then one
        prefill forward (a request whose prefill ends now decodes from the next step)."""
        if self._in_step:   # e.g. on_tokens reading a stream: it would prefill the same chunk again
            raise RuntimeError("Batch.step called from inside a step (on_tokens must only read request.out)")
        steptrace.event("step", running=len(self.running), waiting=len(self.waiting))
        self._advance()
        if self.waiting:
            self._prefill_next()

    def _prefill_next(self) -> None:
        """One prefill forward: the oldest waiting request's next chunk and, with group_prefill, the
        next parts of the requests after it while they fit the same chunk's token budget whole."""
        parts, budget = [], self.engine.prefill_chunk
        for r in list(self.waiting):
            if parts and self._shares_prefix(r, parts):
                break               # it starts from the state one of them keeps: after them
            if not self._prepare(r):
                break               # every slot is lent: it waits for one
            end = self._part_end(r, budget)
            if parts and end < len(r.ids) and end != r.keep_at:
                break               # cut by the budget: its own chunk comes next
            parts.append((r, end))
            budget -= end - r.pos
            if not self.group_prefill or budget <= 0:
                break
        if parts:
            self._prefill(parts)

    def _shares_prefix(self, r: BatchRequest, parts: list) -> bool:
        """With a prefix cache: whether r, not started, shares a first prefix block with a request of
        the forward being gathered (prefilled beside it, it could not start from the state kept)."""
        block = None if self.prefixes is None or r.state is not None else self.prefixes.block
        return block is not None and len(r.ids) > block and any(q.ids[:block] == r.ids[:block] for q, _ in parts)

    def _prepare(self, r: BatchRequest) -> bool:
        """A waiting request's state, taken at its first chunk (from the cached prefix it shares);
        False while no slot is free."""
        if r.state is None:
            if not r.made:          # (a preempted request's decode time runs on from its first token)
                r.t0 = time.perf_counter()
            r.state = self._new_state(r)
            if r.state is None:
                return False
            self._start_from_prefix(r)
        return True

    def _part_end(self, r: BatchRequest, budget: int) -> int:
        """Where r's next prefill part ends: `budget` tokens on, or the prompt's end, or where the
        prefix cache keeps its state."""
        end = min(r.pos + budget, len(r.ids))
        return r.keep_at if r.pos < r.keep_at < end else end

    def _graphable(self, r: BatchRequest, end: int) -> bool:
        """Whether r's next part, from r.pos to `end` (the prompt's end, or where the prefix cache keeps
        its state), on a pool slot, may run as a prefill graph."""
        graphs = self.engine.prefill_graphs
        return (graphs is not None and self.pool is not None and SlotPool.slots_of([r.state]) is not None
                and graphs.applies(end - r.pos, self.pool.capacity - r.pos))

    def _prefill(self, parts: list[tuple[BatchRequest, int]]) -> None:
        """Each request's prompt from r.pos to its end in one forward (several: Engine.prefill_rows),
        decode steps run between its layers when interleaving; a part alone as a prefill graph where
        one applies (PrefillGraphs.run_slot: no decode steps inside it, which would use the scratch
        slot it fills). Several waiting prompts still share one eager forward (group_prefill): with
        decode steps between its layers, the GPU is kept as busy as by their graphs one by one."""
        if CHECK_POOL and self.pool is not None:
            self._check(parts)
        if len(parts) == 1 and self._graphable(*parts[0]):
            (r, end), = parts
            if steptrace.PATH:
                steptrace.event("prefill", how="graph", parts=self._trace_parts(parts))
            logits = self.engine.prefill_graphs.run_slot(r.ids[r.pos:end], r.state, self.pool, r.pos, self.engine.quiet)
            if logits is not None:
                self._prefilled(r, end, logits)
                return
        eng = self.engine
        model = eng.model
        model.between_layers = self._between_layers if self.interleave else None
        self._prefilling = [r for r, _ in parts]
        if steptrace.PATH:      # (its parts are listed only when tracing)
            steptrace.event("prefill", how="eager", parts=self._trace_parts(parts))
        try:
            if len(parts) == 1:
                (r, end), = parts
                logits = eng.prefill(r.ids[r.pos:end], r.state, offset=r.pos)[None]
            else:
                logits = eng.prefill_rows([(r.ids[r.pos:end], r.state, r.pos) for r, end in parts])
        except _Abandoned:
            logits = None           # every one of them cancelled inside it
        finally:
            model.between_layers, self._prefilling = None, []
            steptrace.event("prefill_end")
        for j, (r, end) in enumerate(parts):
            if not r.done:          # not cancelled during its prefill (a server drains between layers)
                self._prefilled(r, end, logits[j])

    def _prefilled(self, r: BatchRequest, end: int, logits: torch.Tensor) -> None:
        r.pos = end
        if end == r.keep_at:
            self.prefixes.keep(r.ids[:end], r.state, self.pool)
        if end < len(r.ids):
            return
        self.waiting.remove(r)
        eng = self.engine
        if not (r.params.greedy and r.params.repetition_penalty == 1.0):
            if r.sampler is None:   # (a preempted request draws on from its own generator)
                r.sampler = Sampler(r.params, eng.device)
            if r.params.repetition_penalty != 1.0:     # the fed ids, for the penalty only
                r.history = upload(r.ids, eng.device)
        self.running.append(r)
        if indexcheck.ON:
            indexcheck.report()
        self._emit(r, self._choose(r, logits))

    def _start_from_prefix(self, r: BatchRequest) -> None:
        """With a prefix cache: the state of the longest cached prefix of the prompt copied in (those
        tokens are not prefilled), and where this prompt's own state will be kept."""
        if self.prefixes is None:
            return
        n, saved = self.prefixes.lookup(r.ids)
        if isinstance(saved, PagedPrefix) and SlotPool.slots_of([r.state]) is not None:
            self.pool.adopt(r.state, saved)          # its pages, not a copy
        elif isinstance(saved, PagedPrefix):
            restore(r.state, saved.snapshot())
        elif saved is not None:
            restore(r.state, saved)
        if saved is not None:
            r.pos = n
            if not r.made:
                r.stream.times.cached_tokens = n
        at = self.prefixes.boundary(r.ids)
        r.keep_at = at if at > r.pos else 0

    def _new_state(self, r: BatchRequest) -> list | None:
        """A pool slot's state holding the pages of its prompt and first decode step (None while all
        slots are lent, or while those pages and one for each running request to grow into are not
        free), or its own where there is no pool or the request would outgrow a slot; never the graph's."""
        if self.pool is not None and self.pool.fits(r.span):
            state, first = None, min(len(r.ids) + 1, r.span)
            while (self.lent < self.slots and (state := self.pool.take(first, len(self.running))) is None
                   and self.pool.free):
                if self.prefixes is None or not self.prefixes.drop_oldest():
                    break           # pages held by running requests: it waits for one to end
            self.lent += state is not None
            r.room = 0 if state is None else self.pool.held(state[0].slot) * PAGE
            if state is not None:
                steptrace.event("take", r=r.serial, slot=state[0].slot, room=r.room, prompt=len(r.ids))
            return state
        eng = self.engine
        r.room = r.span + 1
        return eng.capped(eng.model.make_state(eng.dtype, eng.device))

    def _release(self, r: BatchRequest) -> None:
        if self.pool is not None and r.state is not None and SlotPool.slots_of([r.state]) is not None:
            steptrace.event("release", r=r.serial, slot=r.state[0].slot)
            self.pool.give(r.state)
            self.lent -= 1
        r.state = None

    def _between_layers(self) -> None:
        """A prefill chunk's layer hook: when the decode step in flight has finished on the GPU, its
        tokens are read and the next step launched (queued behind the layers issued so far)."""
        if self._in_step or self.pending is None:
            return
        done = self.pending[2]
        if done is not None and not done.query():
            steptrace.event("hook", ready=False)
            return
        self._in_step = True        # the decode forward and a bucket's capture call this hook too
        try:
            self._advance(inside=True)
            if self.on_tokens is not None:
                self.on_tokens()
        finally:
            self._in_step = False
        if self._prefilling and all(r.done for r in self._prefilling):
            raise _Abandoned        # their clients left: the rest of the layers would be wasted

    def _advance(self, inside: bool = False) -> None:
        """The step in flight's tokens read, the next step launched for the requests still running.
        `inside` a prefill's layers (on a GPU) KILN_INSIDE may hold the step back until the
        prefill's end: where it would not replay a ready graph, or would preempt (a diagnosis switch)."""
        self._resolve()
        self.running = [r for r in self.running if not r.done]
        careful = inside and self.cuda
        if self.pool is not None:
            if not self._grow(preempt=not (careful and INSIDE in ("both", "pages"))):
                return
            if CHECK_POOL:
                self._check()
        rows = self.running
        if (careful and INSIDE in ("both", "graphs") and rows
                and not self.engine.replays([r.pos for r in rows], [r.state for r in rows])):
            return
        if self.running:
            self._launch(self.running, inside)

    def _grow(self, preempt: bool = True) -> bool:
        """Each pooled running request holding the page its next step writes, oldest first; while too
        few pages are free, the prefix cache's kept ones are dropped, then the newest pooled running
        request is preempted (the requester itself when it is the newest; one with a state of its own
        frees no page). Without `preempt`: False at the first request short of a page (none dropped)."""
        for r in list(self.running):
            while r.pos >= r.room and r.state is not None:      # (a preempted one: state None)
                if self.pool.grow(r.state, r.pos + 1):
                    r.room = self.pool.held(r.state[0].slot) * PAGE
                    steptrace.event("grow", r=r.serial, slot=r.state[0].slot, room=r.room)
                elif not preempt:
                    return False
                elif self.prefixes is None or not self.prefixes.drop_oldest():
                    self._preempt(next(q for q in reversed(self.running) if SlotPool.slots_of([q.state])))
        return True

    def _check(self, parts: list | None = None) -> None:
        """KILN_CHECK_POOL=1: the pool's books (SlotPool.check) and what the next step or prefill
        `parts` feed, checked on the host before they run (a bad index would otherwise surface later
        as a device-side assert)."""
        self.pool.check(table=CHECK_POOL >= 2)
        vocab = self.engine.model.cfg.vocab_size
        for r in self.running:
            assert 0 <= r.token < vocab, f"token {r.token} out of the vocabulary"
            assert r.state is None or r.pos < r.room, f"position {r.pos} past the {r.room} its pages hold"
        for r, end in parts or ():
            assert all(0 <= t < vocab for t in r.ids[r.pos:end]), "a prompt token out of the vocabulary"
            assert all(layer.length == r.pos for layer in r.state), f"state lengths not at {r.pos}"
            slot = SlotPool.slots_of([r.state])
            assert slot is None or self.pool.held(slot[0]) * PAGE >= end, f"pages short of position {end}"

    def _preempt(self, r: BatchRequest) -> None:
        """A running request's state freed for older ones (vLLM's recompute preemption): it goes back to
        the head of the queue with the tokens it made appended to its prompt, prefilled again when
        pages free up; its stream goes on where it was (a sampled one with its own generator). It
        queues behind the prompts already holding a slot, which must finish their prefill to free it."""
        steptrace.event("preempt", r=r.serial)
        self._release(r)
        self.running.remove(r)
        r.ids, r.pos, r.keep_at, r.room = r.ids[: r.span - r.steps] + r.made, 0, 0, 0
        self.waiting.insert(sum(q.state is not None for q in self.waiting), r)
        self.preempted += 1

    def _launch(self, live: list[BatchRequest], inside: bool = False) -> None:
        """The decode step launched, each row's token chosen on the device behind it (the greedy
        rows' argmax in one launch, the sampled rows' draws together: sample_rows, each under its own
        settings and generator), and on a GPU the tokens copied to pinned memory and an event marking
        the end: read without waiting for work queued after it, such as a prefill's layers."""
        if steptrace.PATH:
            self._trace_launch(live, inside)
        logits = self.engine.decode_batch([r.token for r in live], [r.pos for r in live], [r.state for r in live])
        sampled = [j for j, r in enumerate(live) if r.sampler is not None]
        chosen = logits.argmax(-1) if len(sampled) < len(live) else None
        if sampled:
            chosen = self._draw(live, sampled, logits, chosen)
        done = None
        if self.cuda:
            chosen = torch.empty(len(live), dtype=torch.long, pin_memory=True).copy_(chosen, non_blocking=True)
            done = torch.cuda.Event()
            done.record()
        self.pending = (list(live), chosen, done)

    def _draw(self, live: list[BatchRequest], sampled: list[int], logits: torch.Tensor,
              chosen: torch.Tensor | None) -> torch.Tensor:
        """`chosen` (the other rows' argmax; None when every row is sampled) with the sampled rows'
        tokens in their places (their histories take the token this step feeds first: the
        repetition penalty counts it)."""
        for j in sampled:
            r = live[j]
            if r.history is not None:
                r.history = torch.cat([r.history, upload([r.token], r.history.device)])
        rows = [live[j] for j in sampled]
        if len(sampled) == len(live):
            return sample_rows(logits, [r.sampler for r in rows], [r.history for r in rows])
        at = upload(sampled, logits.device)
        drawn = sample_rows(logits.index_select(0, at), [r.sampler for r in rows], [r.history for r in rows])
        return chosen.index_copy(0, at, drawn)

    def _trace_launch(self, live: list[BatchRequest], inside: bool) -> None:
        """KILN_TRACE: a decode step about to be launched, and how it will run (a graph ready as it is,
        or a warm-up, capture or eager step)."""
        pos, states = [r.pos for r in live], [r.state for r in live]
        slots = SlotPool.slots_of(states)
        steptrace.event("launch", inside=inside, rows=len(live), slots=slots, first=min(pos), last=max(pos),
                        ready=bool(slots is not None and self.engine.replays(pos, states)))

    @staticmethod
    def _trace_parts(parts: list[tuple[BatchRequest, int]]) -> list:
        """KILN_TRACE: each part of a prefill as [request, slot (None: a state of its own), from, to]."""
        return [[r.serial, (SlotPool.slots_of([r.state]) or [None])[0], r.pos, end] for r, end in parts]

    def _resolve(self) -> None:
        """Each row's token from the step in flight; a request cancelled since its launch is skipped."""
        if self.pending is None:
            return
        live, chosen, done = self.pending
        self.pending = None
        steptrace.event("resolve", rows=len(live))
        if done is not None:
            done.synchronize()
        for r, token in zip(live, chosen.tolist()):
            if not r.done:
                r.pos += 1
                self._emit(r, token)

    def _choose(self, r: BatchRequest, logits: torch.Tensor) -> int:
        return int(torch.argmax(logits)) if r.sampler is None else r.sampler(logits, r.history)

    def _emit(self, r: BatchRequest, token: int) -> None:
        times, now = r.stream.times, time.perf_counter()
        if times.generated_tokens == 0:
            times.prefill_s, r.t0 = now - r.t0, now
        times.generated_tokens += 1
        times.decode_s = now - r.t0
        r.out.append(token)
        r.made.append(token)
        r.token = token
        if token in self.eos and not r.params.ignore_eos:
            r.stream.finish_reason = "eos"
        elif times.generated_tokens <= r.steps:
            return
        elif times.generated_tokens < r.params.max_new_tokens:
            r.stream.finish_reason = "context"
        r.done = True
        self._release(r)
