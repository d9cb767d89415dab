"""The Python API: `kiln.load(...) -> LLM`; `LLM.generate / stream / chat / chat_stream`, and
`Generation`, one running request, for callers that need both its text pieces and its finish."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch

from . import hub
from .backends import get_ops
from .engine import Engine, TokenStream
from .errors import KilnError
from .models import build_model
from .models.base import eos_ids
from .sampling import SamplingParams, StopMatcher
from .tokenizer import StreamDecoder, Tokenizer
from .weights import open_checkpoint
from .weights.experts import ExpertPlan
from .weights.synth import parse_spec

DTYPES = {"f32": torch.float32, "bf16": torch.bfloat16, "f16": torch.float16}


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

    def generate(self, prompt: str | list[int], **sampling) -> Completion:
        return Generation(self, self.encode(prompt), SamplingParams(**sampling)).complete()

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

    def __init__(self, llm: LLM, prompt_ids: list[int], params: SamplingParams):
        self.llm, self.params, self.prompt_ids = llm, params, prompt_ids
        self.stream: TokenStream = llm.engine.generate(prompt_ids, params, llm.eos_ids)
        self.token_ids: list[int] = []
        self.text_parts: list[str] = []
        self.finish_reason: str | None = None

    def __iter__(self) -> Iterator[str]:
        tok = self.llm.tokenizer
        decoder = None
        if tok is not None:
            decoder = StreamDecoder(tok)
        stops = StopMatcher(self.params.stop)
        eos = set(self.llm.eos_ids)
        for token in self.stream.ids:
            self.token_ids.append(token)
            if decoder is None or token in eos:
                continue
            text, stopped = stops.push(decoder.push(token))
            if text:
                self.text_parts.append(text)
                yield text
            if stopped:
                self.finish_reason = "stop"
                return
        self.finish_reason = self.stream.finish_reason
        tail = stops.push(decoder.flush())[0] + stops.flush() if decoder is not None else ""
        if tail:
            self.text_parts.append(tail)
            yield tail

    def close(self) -> None:
        """End the engine's loop now, not whenever this object is collected (a request left unfinished)."""
        self.stream.ids.close()

    def complete(self) -> Completion:
        for _ in self:
            pass
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
                profile: str | Path | None, verify: str, direct_io: bool = False) -> ExpertPlan | None:
    """The ExpertPlan the expert_* arguments ask for (None: the experts load resident)."""
    if slots is None and policy is None:
        if profile is not None or home != "auto" or host_memory is not None or direct_io:
            raise KilnError("--expert-home, --host-memory, --expert-profile and --direct-io apply to expert streaming: "
                            "give --expert-cache-slots N or --expert-policy P")
        return None
    counts = None
    if profile is not None:
        try:
            counts = json.loads(Path(profile).read_text())
        except (OSError, ValueError) as e:
            raise KilnError(f"--expert-profile {profile}: not a readable JSON routing profile ({e})") from None
    return ExpertPlan(policy or "lfu", 16 if slots is None else slots, home, host_memory, io_threads, counts, verify,
                      direct_io)


def load(model: str | Path | None = None, device: str | None = "auto", dtype: str | None = None,
         backend: str = "auto", max_context: int | None = None, quiet: bool = True,
         retune: bool = False, tune: dict[str, str] | None = None, enforce_eager: bool = False,
         check: Callable[[Tokenizer | None], None] | None = None, verify: str = "lazy",
         expert_cache_slots: int | None = None, expert_policy: str | None = None, expert_home: str = "auto",
         host_memory: float | None = None, io_threads: int = 8, expert_profile: str | Path | None = None,
         direct_io: bool = False) -> LLM:
    """Load a model: a path (HF folder or GGUF file), a bundled model's name, or None (the default).
    A compiling backend tunes its kernels for the model here (`retune` measures again; `tune` pins
    op -> variant). Backend "auto" is cuda on a CUDA device, reference elsewhere; on cuda the decode
    step runs as one CUDA graph unless `enforce_eager`. `check(tokenizer)` (None for a model without
    one) runs before the weights load: the caller's chance to refuse, cheaply, what the model cannot do.
    `verify` (full, lazy, off): how a packed directory's files are checked against its manifest.
    Expert streaming (docs/streaming.md), on when `expert_cache_slots` or `expert_policy` is given: a MoE
    model's routed experts stay in their home (`expert_home` host or disk; auto: host unless they pass
    `host_memory` GB) and `expert_cache_slots` of each layer's (default 16) are cached on the device under
    `expert_policy` (lfu, lru, static with `expert_profile`'s routing counts, os), misses read by
    `io_threads` threads (`direct_io`: O_DIRECT reads past the page cache). Decode then runs eagerly
    (the misses are found on the host)."""
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
    ckpt = open_checkpoint(path, verify=verify)
    if backend == "auto":
        backend = "cuda" if dev.type == "cuda" else "reference"
    ops = get_ops(backend, dev)
    if (retune or tune) and not hasattr(ops, "prepare"):
        raise KilnError(f"--retune and --tune apply to the cuda backend, not {backend!r}")
    stage("open")
    # The tokenizer comes before the weights (it is cheap), so `check` can refuse before the slow part.
    tokenizer = load_tokenizer(ckpt)
    if check is not None:
        check(tokenizer)
    stage("tokenizer")
    plan = expert_plan(expert_cache_slots, expert_policy, expert_home, host_memory, io_threads, expert_profile,
                       verify, direct_io)
    net = build_model(ckpt, ops, dt, dev, progress=not quiet, experts=plan)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)     # the weights' copies are done: their time is theirs
    stage("weights")
    if hasattr(ops, "prepare"):
        ops.prepare(net, dt, retune=retune, pins=tune, quiet=quiet)
    stage("tune")
    limit = net.cfg.max_position_embeddings
    if max_context is not None:
        limit = min(limit, max_context)
    eos = eos_ids(ckpt.config, ckpt.generation)
    if tokenizer is not None:
        eos += [i for i in tokenizer.eos_ids if i not in eos]
    streamed = getattr(net, "expert_store", None) is not None
    engine = Engine(net, dt, dev, limit, prefill_chunk=ops.prefill_chunk,
                    graphs=ops.graphs and not enforce_eager and not streamed,
                    quiet=quiet)
    stage("engine")
    llm = LLM(path, net, tokenizer, engine, eos, time.perf_counter() - t0)
    llm.load_stages = stages
    return llm
