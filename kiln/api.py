"""The Python API: `kiln.load(...) -> LLM`; `LLM.generate / stream / chat / chat_stream`, and
`Generation`, one running request, for callers that need both its text pieces and its finish."""

from __future__ import annotations

import hashlib
import json
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from . import hub
from .backends import get_ops
from .backends.graphs import PREFILL_GRAPH_ROWS
from .cache import PAGE, KVCache, RingKVCache, SlotPool, WindowKVCache, pages_for
from .engine import POOL_CONTEXT, Engine, TokenStream
from .errors import KilnError
from .models import build_model, model_config
from .models.base import eos_ids
from .sampling import SamplingParams, StopMatcher
from .tokenizer import StreamDecoder, Tokenizer
from .weights import open_checkpoint
from .weights.experts import (
    GB,
    STACKS,
    WORKSPACE_FIXED,
    ExpertPlan,
    MemoryPlan,
    auto_budget,
    fit,
    layer_prefix,
    weight_bytes,
)
from .weights.synth import parse_spec

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}
EXPERT_SLOTS = 16     # expert slots a layer when streaming and not told (--expert-cache-slots)
DENSE_ROUTERS = ("mlp.gate.weight", "shared_expert_gate.weight", "router.proj.weight")
# A streamed model's prefill chunk halves (down to this) while its slots a layer fall short of those
# asked (else EXPERT_SLOTS): the cuda backend's smallest tuned chunk (backends.cuda.PREFILL_CHUNK).
STREAM_CHUNK_MIN = 512


@dataclass
class Stats:
    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_tok_s: float = 0.0
    decode_tok_s: float = 0.0
    load_s: float = 0.0
    finish_reason: str | None = None    # as Completion's
    max_context: int | None = None      # the limit a "context" finish hit
    experts: str | None = None          # streamed experts: ExpertStore.line()

    def line(self) -> str:
        return (f"prompt {self.prompt_tokens} tok, generated {self.generated_tokens} tok | "
                f"prefill {self.prefill_tok_s:.1f} tok/s | decode {self.decode_tok_s:.1f} tok/s | "
                f"load {self.load_s:.2f} s{self._finish()}" + (f" | {self.experts}" if self.experts else ""))

    def _finish(self) -> str:
        if self.finish_reason is None:
            return ""
        if self.finish_reason == "context":     # a cut the user did not ask for: say where the limit is
            return f" | finish context (max context {self.max_context} tokens)"
        return f" | finish {self.finish_reason}"


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    # "length" (max_new_tokens reached), "context" (the max context reached first), "eos" (an end of
    # sequence or turn token), "stop" (a stop string)
    finish_reason: str
    stats: Stats = field(default_factory=Stats)


def _is_gguf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"GGUF"
    except OSError:       # a folder, or a synth: spec
        return False


def resolve_model(model: str | Path | None, quiet: bool = False) -> Path:
    """A bundled model's name (pulled if missing), a path, a `synth:` spec, or None for the default model."""
    if model is None:
        return hub.ensure(hub.DEFAULT_MODEL, quiet=quiet)
    if str(model).startswith("synth:"):  # synth:NAME[:layers=N][:seed=S], drawn in memory (kiln.synth)
        parse_spec(str(model))
        return Path(str(model))
    if str(model) in hub.BUNDLED:
        return hub.ensure(str(model), quiet=quiet)
    p = Path(model).expanduser()
    if not p.exists():
        raise KilnError(f"no such model: {model} (not a path, nor a bundled model: {', '.join(hub.BUNDLED)})")
    return p


def pick_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise KilnError(f"invalid device {device!r} (use auto, cpu or cuda[:N])") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise KilnError("device cuda was asked for, but no CUDA GPU is available")
    return dev


def pick_dtype(dtype: str | None, device: torch.device) -> torch.dtype:
    if dtype is None:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in DTYPES:
        raise KilnError(f"invalid dtype {dtype!r} (use one of: {', '.join(DTYPES)})")
    return DTYPES[dtype]


def load_tokenizer(ckpt):
    if ckpt.format == "synth":
        return None
    if ckpt.gguf_metadata is not None:
        st = ckpt.path.stat()
        key = hashlib.sha256(f"{ckpt.path.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:24]
        return Tokenizer.from_gguf(ckpt.gguf_metadata, cache_key=key)
    if (ckpt.path / "tokenizer.json").exists():
        return Tokenizer.from_hf_dir(ckpt.path)
    return None  # synthesized checkpoints: token ids in, token ids out


def render_chat(tokenizer: Tokenizer | None, messages: list[dict], tools: list | None = None) -> str:
    """The prompt text of a conversation, ready for the assistant's turn. KilnError for a model without
    a tokenizer or a chat template, or a conversation its template refuses."""
    if tokenizer is None:
        raise KilnError("this model has no tokenizer, so it cannot chat")
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tools=tools)


class LLM:
    def __init__(self, path: Path, model, tokenizer, engine: Engine, eos: list[int], load_s: float):
        self.path, self.model, self.tokenizer, self.engine = path, model, tokenizer, engine
        self.eos_ids, self.load_s = eos, load_s
        self.load_stages: dict[str, float] = {}     # seconds by stage (kiln.load fills it)
        self.memory: MemoryPlan | None = None       # the device memory budget's plan (kiln.load's gpu_memory)
        self.config = model.cfg

    # -- prompts -------------------------------------------------------------------------
    def encode(self, prompt: str | list[int], add_special_tokens: bool = True) -> list[int]:
        """The prompt's token ids: text through the tokenizer (with the model's BOS unless
        `add_special_tokens` is False), or a list of ids checked against the vocabulary. KilnError on
        an empty prompt, text for a model without a tokenizer, or ids that are not in the vocabulary."""
        if isinstance(prompt, str):
            if not prompt:
                raise KilnError("empty prompt")
            if self.tokenizer is None:
                raise KilnError("this model has no tokenizer; pass a list of token ids")
            return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)
        ids = list(prompt)
        vocab = self.model.cfg.vocab_size
        if not ids or not all(isinstance(i, int) and 0 <= i < vocab for i in ids):
            raise KilnError(f"token ids must be a non-empty list of integers in [0, {vocab})")
        return ids

    def chat_prompt(self, messages: list[dict], tools: list | None = None) -> list[int]:
        return self.tokenizer.encode(render_chat(self.tokenizer, messages, tools), add_special_tokens=False)

    # -- generation ------------------------------------------------------------------------
    def stream(self, prompt: str | list[int], **sampling) -> Iterator[str]:
        """Text pieces as they are generated, each valid UTF-8; stop strings excluded."""
        yield from Generation(self, self.encode(prompt), SamplingParams(**sampling))

    def generate(self, prompt: str | list[int] | list[str] | list[list[int]], **sampling):
        """A Completion of one prompt (text or token ids); of a list of prompts (texts, or lists of
        ids), their Completions in order, decoded together as one batch (generate_batch)."""
        if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list, tuple)) for p in prompt):
            return self.generate_batch(prompt, [SamplingParams(**sampling) for _ in prompt])
        return Generation(self, self.encode(prompt), SamplingParams(**sampling)).complete()

    def generate_batch(self, prompts: list, params: list[SamplingParams]) -> list[Completion]:
        """Each prompt under its own SamplingParams (seed, temperature, stops, max tokens), decoded
        together: each decode step reads the weights once for every running request. The same
        tokens as one at a time wherever the batched products round as the single-row ones do
        (docs/batching.md)."""
        if len(prompts) != len(params):
            raise KilnError(f"{len(prompts)} prompts but {len(params)} sampling settings")
        ids = [self.encode(p) for p in prompts]
        streams = self.engine.generate_batch(ids, params, self.eos_ids)
        gens = [Generation(self, i, p, stream=s) for i, p, s in zip(ids, params, streams)]
        pieces = [iter(g) for g in gens]
        live = list(range(len(gens)))
        while live:         # read the requests in turn, so one that stops early frees its row early
            for j in list(live):
                if next(pieces[j], None) is None:
                    live.remove(j)
        return [g.completion() for g in gens]

    def chat(self, messages: list[dict], tools: list | None = None, **sampling) -> Completion:
        return Generation(self, self.chat_prompt(messages, tools), SamplingParams(**sampling)).complete()

    def chat_stream(self, messages: list[dict], tools: list | None = None, **sampling) -> Iterator[str]:
        yield from Generation(self, self.chat_prompt(messages, tools), SamplingParams(**sampling))


class Generation:
    """One request as it runs: the engine's token ids -> text pieces -> the stop-string filter.

    `Generation(llm, llm.encode(prompt), SamplingParams(...))` starts it (`prompt_ids` as `LLM.encode`
    or `LLM.chat_prompt` give them). Iterate it for the text pieces (each valid UTF-8, stop strings
    cut), or `complete()` it. `token_ids` collects every generated id, an end-of-turn id included;
    `finish_reason` (as Completion's) and `stats()` are final once it is exhausted. `stream` is the
    engine's TokenStream: its `ids` give the raw token ids (for a model without a tokenizer), its
    `times` the counts and timings."""

    def __init__(self, llm: LLM, prompt_ids: list[int], params: SamplingParams, stream: TokenStream | None = None):
        self.llm, self.params, self.prompt_ids = llm, params, prompt_ids
        self.stream: TokenStream = stream or llm.engine.generate(prompt_ids, params, llm.eos_ids)
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self.finish_reason: str | None = None
        tok = llm.tokenizer
        self._decoder = StreamDecoder(tok) if tok is not None else None
        self._stops, self._eos = StopMatcher(params.stop), set(llm.eos_ids)

    def __iter__(self) -> Iterator[str]:
        for token in self.stream.ids:
            text, stopped = self.feed(token)
            if text:
                yield text
            if stopped:
                return
        tail = self.finish()
        if tail:
            yield tail

    def feed(self, token: int) -> tuple[str, bool]:
        """One generated token in: (its text piece, possibly "", and whether a stop string ended the
        request). The pull loop above and a caller that drives the engine itself (the server's batch)
        both go through here."""
        self.token_ids.append(token)
        if self._decoder is None or token in self._eos:
            return "", False
        text, stopped = self._stops.push(self._decoder.push(token))
        if text:
            self.text_parts.append(text)
        if stopped:
            self.finish_reason = "stop"
        return text, stopped

    def finish(self) -> str:
        """The request ended without a stop string: its finish reason, and the text held back (a
        partial character, the start of a possible stop string)."""
        self.finish_reason = self.stream.finish_reason
        tail = self._stops.push(self._decoder.flush())[0] + self._stops.flush() if self._decoder is not None else ""
        if tail:
            self.text_parts.append(tail)
        return tail

    def close(self) -> None:
        """End the engine's loop now, not whenever this object is collected (a request left unfinished)."""
        self.stream.ids.close()

    def complete(self) -> Completion:
        for _ in self:
            pass
        return self.completion()

    def completion(self) -> Completion:
        """The Completion of what ran (final once the generation is exhausted)."""
        return Completion("".join(self.text_parts), self.token_ids, self.finish_reason or "length", self.stats())

    def stats(self) -> Stats:
        t = self.stream.times
        decode_n = max(t.generated_tokens - 1, 0)
        return Stats(
            prompt_tokens=t.prompt_tokens, generated_tokens=t.generated_tokens,
            prefill_tok_s=t.prompt_tokens / t.prefill_s if t.prefill_s else 0.0,
            decode_tok_s=decode_n / t.decode_s if t.decode_s and decode_n else 0.0,
            load_s=self.llm.load_s, finish_reason=self.finish_reason, max_context=self.llm.engine.max_context,
            experts=store.line() if (store := getattr(self.llm.model, "expert_store", None)) is not None else None,
        )


def expert_plan(slots: int | None, policy: str | None, home: str, host_memory: float | None, io_threads: int,
                profile: str | Path | None, verify: str, direct_io: bool = False,
                zero_copy: str = "auto") -> ExpertPlan | None:
    """The ExpertPlan the expert_* arguments ask for (None: the experts load resident)."""
    if slots is None and policy is None:
        if profile is not None or home != "auto" or host_memory is not None or direct_io or zero_copy != "auto":
            raise KilnError("--expert-home, --host-memory, --expert-profile, --direct-io and --zero-copy apply to "
                            "expert streaming: "
                            "give --expert-cache-slots N or --expert-policy P")
        return None
    counts = None
    if profile is not None:
        try:
            counts = json.loads(Path(profile).read_text())
        except (OSError, ValueError) as e:
            raise KilnError(f"--expert-profile {profile}: not a readable JSON routing profile ({e})") from None
    return ExpertPlan(policy or "lfu", EXPERT_SLOTS if slots is None else slots, home, host_memory, io_threads,
                      counts, verify, direct_io, zero_copy)


# -- the device memory budget (docs/streaming.md): sized before any weight reaches the device ----------

def memory_plan(ckpt, ops, dtype, limit: int, gpu_memory: float | None, slots: int | None = None,
                policy: str | None = None, free: int | None = None, batch: int = 1) -> MemoryPlan | None:
    """The plan a budget asks for: `gpu_memory` GB, or (automatic streaming) `free` device bytes when
    a resident load (weights, cache, workspace) does not fit in auto_budget(free) and the model has
    routed experts; None: load as asked. MemoryPlan.slots
    is the expert slots a layer that fit (None: every expert resident); KilnError when the core,
    cache and workspace do not fit, or not the `slots` asked for. With `gpu_memory` and `batch` > 1
    (--max-batch) the budget holds the batch state pool too (batch_pool)."""
    if gpu_memory is None and free is None:
        return None
    if gpu_memory is not None and gpu_memory <= 0:
        raise KilnError(f"--gpu-memory takes a positive number of GB, got {gpu_memory}")
    cls, cfg = model_config(ckpt.config)
    view = ckpt.for_model(cls.checkpoint_shapes(cfg), cls.norm_style == "offset")
    if not view.sanitized:
        view = cls.sanitize(view)
    names = [n for n in cls.weight_shapes(cfg) if n in view.shapes]
    stacks = [n for n in names if n.endswith(STACKS)]
    auto = gpu_memory is None
    if auto and (free is None or not stacks):
        return None
    chunk = min(ops.prefill_chunk, limit)
    graph_rows = min(chunk, PREFILL_GRAPH_ROWS) if getattr(ops, "graphs", False) else 0   # the prefill graphs' pool
    plan = MemoryPlan(auto_budget(free) if auto else int(gpu_memory * GB), core=0,
                      cache=state_bytes(cls, cfg, ops, dtype, limit, chunk),
                      workspace=workspace_bytes(cls, cfg, view.shapes, names, chunk + graph_rows),
                      policy=policy or "lfu", auto=auto, chunk=chunk)
    item = torch.empty((), dtype=dtype).element_size()
    if auto and plan.need + sum(_numel(view.shapes[n]) for n in names) * item <= plan.budget:
        return None         # fits with every weight at `dtype` (a quantised one takes less): no need to size them
    held = weight_bytes(view, names, dtype)
    plan.core = sum(b for n, b in held.items() if n not in stacks)
    if getattr(ops, "dense_routers", False):    # a quantised router or gate is kept dense too (MoeCuda._dense)
        plan.core += sum(_numel(view.shapes[n]) * item for n in names
                         if n.endswith(DENSE_ROUTERS) and held[n] < _numel(view.shapes[n]) * item)
    _expert_sizes(plan, view.shapes, held, stacks)
    staging = staging_bytes(cfg, view.shapes, held, stacks, min(max(batch, 1), getattr(ops, "mapped_rows", 0)))
    plan.workspace += staging
    if auto and plan.need + plan.experts <= plan.budget:
        return None         # a resident load fits: automatic streaming stays off
    if plan.count and (slots is not None or plan.need + plan.experts > plan.budget):
        def sized(rows: int, graphs: bool) -> tuple[int, int]:
            extra = min(rows, PREFILL_GRAPH_ROWS) if graphs and graph_rows else 0
            return (state_bytes(cls, cfg, ops, dtype, limit, rows),
                    workspace_bytes(cls, cfg, view.shapes, names, rows + extra) + staging)
        stream_chunk(plan, slots, sized)
    if not auto:
        batch_pool(plan, cls, cfg, ops, dtype, limit, batch, slots)
    return fit(plan, slots)


def stream_chunk(plan: MemoryPlan, slots: int | None, sized: Callable[[int, bool], tuple[int, int]]) -> None:
    """A streamed model's prefill chunk, cache and workspace. No prefill graph runs beside streamed
    experts (they read no host memory), so their rows leave the workspace; and while the slots a layer
    that fit fall short of `slots` (else EXPERT_SLOTS, at most a layer's experts) the chunk halves,
    down to STREAM_CHUNK_MIN: a smaller chunk reads the experts more often in a long prompt, but
    decode reads them every token. Where a chunk lets every expert fit with the graphs' rows, the
    model is resident at that chunk; where only without them, that chunk streams with them counted
    (else fit would call it resident). `sized(rows, graphs)`: (cache, workspace) at that chunk."""
    want = min(slots or EXPERT_SLOTS, plan.count)
    chunk, first = plan.chunk, True
    while first or chunk >= STREAM_CHUNK_MIN:
        with_graphs, alone = sized(chunk, True), sized(chunk, False)
        plan.chunk = chunk
        if slots is None and plan.core + plan.experts + sum(with_graphs) <= plan.budget:
            plan.cache, plan.workspace = with_graphs        # every expert resident, the graphs' rows too
            return
        between = slots is None and plan.core + plan.experts + sum(alone) <= plan.budget
        plan.cache, plan.workspace = with_graphs if between else alone
        if not between and plan.slots_in(plan.budget - plan.need) >= want:
            return
        chunk, first = 1 << (chunk - 1).bit_length() - 1, False     # a power of two, as the tuned chunks


def batch_pool(plan: MemoryPlan, cls, cfg, ops, dtype, limit: int, batch: int, slots: int | None) -> None:
    """The batch state pool inside an explicit budget (--max-batch > 1 on a backend that pools batched
    requests' state), after the core, cache and workspace and the experts (all of them where they
    fit beside a pool whose every request holds the max context (up to POOL_CONTEXT), else their
    slots: `slots`, or one a layer). Requests take KV pages as they grow (kiln.cache.SlotPool), so
    the pool is --max-batch slots of fixed state (GDN states, windowed rings), as many as fit beside
    one max-context request's pages, and the pages the rest of the budget holds (no more than every
    slot at the max context needs). Not one slot and its pages: a one-line KilnError."""
    if batch <= 1 or not getattr(ops, "pooled", False) or plan.budget < plan.need:
        return                      # (a budget below the core: fit's error says so)
    stand_in = cls.__new__(cls)     # make_state reads the config and the backend, no weight
    stand_in.cfg, stand_in.ops = cfg, ops
    template = stand_in.make_state(dtype, "cpu")
    if not SlotPool.poolable(template):
        return
    context = min(limit, POOL_CONTEXT)
    full = pages_for(context)
    span = full * PAGE                                          # a slot's positions: whole pages
    fixed = SlotPool.ring_bytes(template, span)                 # a lent slot's GDN states and rings
    page = SlotPool.page_bytes(template, span)
    one = fixed + full * page                                   # a lent slot at the max context
    spare = SlotPool.bytes_per_slot(template, span, rings=False)     # the scratch slot: one plain buffer
    room = plan.budget - plan.need
    if plan.count and plan.experts + batch * one + spare <= room:
        room -= plan.experts        # every expert resident beside the whole pool
    elif plan.count:                # streamed: their slots first (as asked, else the default's 16 a layer)
        keep = plan.slot_cost(slots or min(EXPERT_SLOTS, plan.count))
        if keep > room:
            return                  # (fit says what the experts lack)
        room -= keep
    left = room - spare             # the spare slot a captured batch step pads with, then the slots
    fits = 0 if left < one else min(batch, (left - full * page) // fixed) if fixed else batch
    if fits < 1:
        raise KilnError(f"--gpu-memory {plan.budget / GB:.2f} GB leaves {max(room, 0) / GB:.2f} GB after the core, "
                        f"cache, workspace{' and expert slots' if plan.count else ''}: not two batch slots of "
                        f"{context} tokens ({(one + spare) / GB:.2f} GB) for --max-batch {batch} (a lower "
                        f"--max-context shrinks them)")
    pages = min(fits * full, (left - fits * fixed) // page) if page else fits * full
    plan.batch, plan.batch_slot, plan.batch_context, plan.batch_spare = fits, fixed, context, spare
    plan.batch_pages, plan.batch_page, plan.batch_full = pages, page, pages // full


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _expert_sizes(plan: MemoryPlan, shapes: dict, held: dict, stacks: list[str]) -> None:
    """The plan's expert figures: one expert of every layer (a slot a layer), all of them, the most a layer has."""
    for n in stacks:
        count = shapes[n][0]
        plan.expert += held[n] // count
        plan.experts += held[n]
        plan.count = max(plan.count, count)


def staging_bytes(cfg, shapes: dict, held: dict, stacks: list[str], rows: int) -> int:
    """Zero-copy streaming's device scratch (kiln/ops/moe/staging.py): a decode call's misses, top_k
    experts a row for `rows` rows (the batch's, up to the backend's mapped_rows; 0 on a backend without
    the kernels), each the largest layer's gate|up and down."""
    top_k = getattr(cfg, "num_experts_per_tok", 1) or 1
    layer: dict[str, int] = {}
    for n in stacks:
        layer[layer_prefix(n)] = layer.get(layer_prefix(n), 0) + held[n] // shapes[n][0]
    return rows * top_k * max(layer.values(), default=0)


def state_bytes(cls, cfg, ops, dtype, limit: int, chunk: int) -> int:
    """The per-layer state's bytes at `limit` tokens, from the state the model makes (its own rule,
    its backend's choice of ring or plain cache): a KV cache at `limit` positions (the engine caps its
    doubling there; a graph's reserved bucket is never more), a ring its window and a prefill chunk,
    the recurrent state as made."""
    stand_in = cls.__new__(cls)     # make_state reads the config and the backend, no weight
    stand_in.cfg, stand_in.ops = cfg, ops
    seen, total = set(), 0
    for layer in stand_in.make_state(dtype, "cpu"):
        own = getattr(layer, "cache", layer)        # a KV producer's cache (a KV-shared layer holds none)
        if id(own) not in seen:
            seen.add(id(own))
            total += _layer_state_bytes(own, limit, chunk)
    return total


def _layer_state_bytes(state, limit: int, chunk: int) -> int:
    if isinstance(state, (KVCache, RingKVCache)):
        per = 2 * _numel(state.k.shape[1:]) * state.k.element_size()       # K and V of one position
        if isinstance(state, RingKVCache):
            return per * min(limit, state.window - 1 + chunk)
        if isinstance(state, WindowKVCache):     # its window and a chunk, in whole key blocks
            return per * WindowKVCache.rows_for(state.window, chunk, state.align, limit)
        return per * max(limit, state.capacity)      # the engine caps its growth at the max context
    return sum(t.numel() * t.element_size() for t in vars(state).values() if isinstance(t, torch.Tensor))


def workspace_bytes(cls, cfg, shapes: dict, names: list[str], chunk: int) -> int:
    """WORKSPACE_FIXED plus `chunk` rows of prefill activations (a chunk's, and on a backend with
    CUDA graphs the largest prefill graph's, held in the graphs' pool): each row 6 hidden-wide vectors (the
    residual, its normed copy, the attention output, the MoE sum, the shared expert's, a spare) and
    2 of the widest output a layer computes for one token (a merged projection, or top_k experts'
    gate|up rows), at 4 bytes (f32, the widest dtype an op keeps)."""
    top_k = getattr(cfg, "num_experts_per_tok", 1) or 1
    widths = [shapes[n][1] * top_k if n.endswith(STACKS) else shapes[n][0] for n in names
              if len(shapes[n]) >= 2 and "embed" not in n and not n.startswith("lm_head")]
    for parts in cls.packed_groups(cfg).values():
        widths.append(sum(shapes[n][0] for n in parts if n in shapes))
    return WORKSPACE_FIXED + chunk * 4 * (6 * cfg.hidden_size + 2 * max(widths, default=0))


def free_memory(device: torch.device) -> int | None:
    """The device's free bytes where automatic streaming may use them: CUDA's; None on the CPU."""
    if device.type != "cuda":
        return None
    return torch.cuda.mem_get_info(device)[0]


def load(model: str | Path | None = None, device: str | None = "auto", dtype: str | None = None,
         backend: str = "auto", max_context: int | None = None, quiet: bool = True,
         retune: bool = False, tune: dict[str, str] | None = None, enforce_eager: bool = False,
         check: Callable[[Tokenizer | None], None] | None = None, verify: str = "lazy",
         expert_cache_slots: int | None = None, expert_policy: str | None = None, expert_home: str = "auto",
         host_memory: float | None = None, io_threads: int = 8, expert_profile: str | Path | None = None,
         direct_io: bool = False, zero_copy: str = "auto", gpu_memory: float | None = None,
         max_batch: int = 1) -> LLM:
    """Load a model: a path (HF folder or GGUF file), a bundled model's name, or None (the default).
    A compiling backend tunes its kernels for the model here (`retune` measures again; `tune` pins
    op -> variant). Backend "auto" is cuda on a CUDA device, cpu for a GGUF file on the CPU (its quantised
    tensors kept as stored), reference otherwise; on cuda the decode
    step runs as one CUDA graph unless `enforce_eager`. `check(tokenizer)` (None for a model without
    one) runs before the weights load: the caller's chance to refuse, cheaply, what the model cannot do.
    `verify` (full, lazy, off): how a packed directory's files are checked against its manifest.
    Expert streaming (docs/streaming.md), on when `expert_cache_slots` or `expert_policy` is given: a MoE
    model's routed experts stay in their home (`expert_home` host or disk; auto: host unless they pass
    `host_memory` GB) and `expert_cache_slots` of each layer's (default 16) are cached on the device under
    `expert_policy` (lfu, lru, static with `expert_profile`'s routing counts, os), misses read by
    `io_threads` threads (`direct_io`: O_DIRECT reads past the page cache). Decode then runs eagerly,
    except with `zero_copy` (auto, on, off; auto: on a CUDA device): quantised experts homed in host
    memory are read in place by the decode kernels where not in a slot, no copy waited for, and the
    decode step runs as a CUDA graph.
    `gpu_memory` GB: the core, the KV cache and state for the max context, a workspace and the expert
    slots fit inside it (the slots a layer computed unless given; every expert resident if they all
    fit); KilnError if the core, cache and workspace do not. On CUDA with no expert argument, a MoE
    model whose weights pass the free memory (less a margin) streams with the slots that fit.
    `llm.memory` is the plan (None when no budget applied).
    `max_batch` > 1: the cuda backend also tunes its projections for batched decode steps of up to
    that many requests (kiln serve --max-batch; docs/batching.md)."""
    t0 = time.perf_counter()
    stages, mark = {}, [t0]

    def stage(name: str) -> None:      # seconds since the last stage, for load_stages
        now = time.perf_counter()
        stages[name], mark[0] = round(now - mark[0], 3), now
    if max_context is not None and max_context < 2:
        raise KilnError(f"max context must be at least 2 tokens, got {max_context}")
    path = resolve_model(model, quiet=quiet)
    dev = pick_device(device)
    dt = pick_dtype(dtype, dev)
    if backend == "auto":       # a GGUF file on the CPU: its quantised tensors run as stored (docs/cpu.md)
        backend = "cuda" if dev.type == "cuda" else "cpu" if _is_gguf(path) else "reference"
    # the cpu backend runs a GGUF file's quantised tensors as they are stored
    ckpt = open_checkpoint(path, verify=verify, keep=True if backend == "cpu" else None)
    ops = get_ops(backend, dev)
    if (retune or tune) and not hasattr(ops, "prepare"):
        raise KilnError(f"--retune and --tune apply to the cuda backend, not {backend!r}")
    stage("open")
    # The tokenizer comes before the weights (it is cheap), so `check` can refuse before the slow part.
    tokenizer = load_tokenizer(ckpt)
    if check is not None:
        check(tokenizer)
    stage("tokenizer")
    limit = model_config(ckpt.config)[1].max_position_embeddings
    if max_context is not None:
        limit = min(limit, max_context)
    flags = (expert_cache_slots, expert_policy, host_memory, expert_profile) != (None,) * 4
    free = None if flags or direct_io or expert_home != "auto" or gpu_memory is not None else free_memory(dev)
    if gpu_memory is not None and (room := free_memory(dev)) is not None and gpu_memory * GB > room:
        raise KilnError(f"--gpu-memory {gpu_memory:g} GB: the GPU has {room / GB:.1f} GB free "
                        f"(other processes and the CUDA context hold the rest); ask for at most that")
    memory = memory_plan(ckpt, ops, dt, limit, gpu_memory, expert_cache_slots, expert_policy, free, max_batch)
    if memory is not None and not quiet:
        print(memory.line(), file=sys.stderr)
    if memory is not None and memory.chunk and memory.chunk < min(ops.prefill_chunk, limit):
        ops.prefill_chunk = memory.chunk     # the engine's chunk, tuned for at load (the budget's choice)
    if memory is not None and memory.count and memory.slots is None:
        plan = None         # the budget holds every expert: resident, whatever the streaming flags
    else:
        slots = expert_cache_slots if memory is None else memory.slots
        plan = expert_plan(slots, expert_policy, expert_home, host_memory, io_threads, expert_profile, verify,
                           direct_io, zero_copy)
    if hasattr(ops, "precompile"):      # a cold start compiles its kernels while the weights load
        ops.precompile(*model_config(ckpt.config), dt, retune=retune, pins=tune, quiet=quiet, max_batch=max_batch)
    stage("budget")
    try:
        net = build_model(ckpt, ops, dt, dev, progress=not quiet, experts=plan)
    except BaseException:
        if hasattr(ops, "drop_precompile"):
            ops.drop_precompile()
        raise
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)     # the weights' copies are done: their time is theirs
    stage("weights")
    if hasattr(ops, "prepare"):
        ops.prepare(net, dt, retune=retune, pins=tune, quiet=quiet, max_batch=max_batch)
    stage("tune")
    eos = eos_ids(ckpt.config, ckpt.generation)
    if tokenizer is not None:
        eos += [i for i in tokenizer.eos_ids if i not in eos]
    store = getattr(net, "expert_store", None)      # streamed: graphs only where no step reads the host
    engine = Engine(net, dt, dev, limit, prefill_chunk=ops.prefill_chunk,
                    graphs=ops.graphs and not enforce_eager and (store is None or store.graph_safe),
                    batch_graphs=store is None, quiet=quiet)
    if memory is not None and memory.batch:
        engine.pool_limit = (memory.batch, memory.batch_context, memory.batch_pages)   # the budget's pool
    stage("engine")
    llm = LLM(path, net, tokenizer, engine, eos, time.perf_counter() - t0)
    llm.load_stages, llm.memory = stages, memory
    return llm
