"""The generation loop: chunked prefill, then one token per decode step over the per-layer state.

Plain Python bookkeeping around the model runner; no token is re-run once its state is cached.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Iterator

import torch

from .errors import KilnError
from .sampling import Sampler, SamplingParams


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
    finish_reason: str | None = None


MIN_BUCKET = 2048   # smallest KV reservation when decode runs as a CUDA graph


class Engine:
    def __init__(self, model, dtype, device, max_context: int, prefill_chunk: int = 512,
                 graphs: bool = False, quiet: bool = True):
        self.model, self.dtype, self.device = model, dtype, torch.device(device)
        self.max_context, self.prefill_chunk = max_context, prefill_chunk
        self.quiet = quiet
        # Prefix reuse (off unless asked for): the state of the last reusing request and the ids it
        # has consumed, so a prompt that shares a prefix with them prefills only the rest.
        self.reuse_prefix = False
        self._kept: tuple[list[int], list] | None = None
        # CUDA-graph decode: one persistent state, reset per request (kiln.graphs).
        self.graph = None
        self._state = None
        self._owner = None
        if graphs and self.device.type == "cuda":   # dropped at the first state if it is not graphable
            from .graphs import DecodeGraph
            self.graph = DecodeGraph(model, self.device)

    def new_state(self, tokens: int) -> list:
        """Per-layer state for a request of up to `tokens` positions: fresh, or with CUDA graphs the
        persistent one, reset, its KV reserved for the context bucket holding `tokens`."""
        if self.graph is not None and self._state is None:
            # (not probed on the meta device at construction: meta tensors import torch._refs, ~2 s)
            from .graphs import graphable
            self._state = self.model.make_state(self.dtype, self.device)
            if not graphable(self._state):
                self.graph, self._state = None, None
        if self.graph is None:
            return self.model.make_state(self.dtype, self.device)
        for layer in self._state:
            layer.reset()
        self.reserve(self._state, tokens)
        return self._state

    def reserve(self, state: list, tokens: int) -> None:
        bucket = min(max(MIN_BUCKET, 1 << max(tokens - 1, 0).bit_length()), self.max_context)
        for layer in state:
            if hasattr(layer, "reserve"):
                layer.reserve(bucket)

    @property
    def launches_per_token(self) -> int | None:
        return None if self.graph is None else self.graph.launches

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def prefill(self, ids: list[int], state, offset: int = 0) -> torch.Tensor:
        """Run the prompt through the model in chunks, from position `offset` on (the state already
        holds the first `offset` tokens); logits of the last position."""
        logits = None
        for start in range(0, len(ids), self.prefill_chunk):
            chunk = torch.tensor(ids[start:start + self.prefill_chunk], device=self.device)
            pos = torch.arange(offset + start, offset + start + len(chunk), device=self.device)
            logits = self.model.forward(chunk, pos, state)
        return logits[-1]

    @torch.inference_mode()
    def decode_step(self, token: int, pos: int, state) -> torch.Tensor:
        if self.graph is not None and state is self._state:
            return self.graph.step(token, pos, state, self.quiet)
        ids = torch.tensor([token], device=self.device)
        return self.model.forward(ids, torch.tensor([pos], device=self.device), state)[-1]

    @torch.inference_mode()
    def greedy_tokens(self, token: int, pos: int, state, steps: int, fed: list | None = None, before=None):
        """The tokens of `steps` greedy decode steps after `token` fed at `pos`. On the CUDA-graph
        state the device picks each token and one step is queued ahead (DecodeGraph.greedy_tokens);
        `fed` gets the tokens the state was fed, `before(k)` runs before step k is queued."""
        fed = [] if fed is None else fed
        if self.graph is not None and state is self._state:
            yield from self.graph.greedy_tokens(token, pos, state, steps, fed, before, self.quiet)
            return
        for k in range(steps):
            if before is not None:
                before(k)
            logits = self.decode_step(token, pos + k, state)
            fed.append(token)
            token = int(torch.argmax(logits))
            yield token

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
        stream.ids = self._loop(prompt_ids, params, set(eos_ids), stream,
                                self.reuse_prefix if reuse is None else reuse)
        return stream

    def _reused_state(self, ids: list[int], max_new: int) -> tuple[list, int]:
        """The kept state rewound to the prefix it shares with `ids` (leaving at least one token to
        prefill, for the logits), or a fresh state when nothing is shared or a layer cannot rewind."""
        kept, self._kept = self._kept, None
        if kept is not None:
            old, state = kept
            n = min(_common_prefix(old, ids), len(ids) - 1)
            if n > 0 and all(layer.truncate(n) for layer in state):
                if self.graph is not None:
                    self.reserve(state, len(ids) + max_new)
                return state, n
        return self.new_state(len(ids) + max_new), 0

    def _loop(self, prompt_ids, params, eos, stream: TokenStream, reuse: bool):
        times, sampler = stream.times, Sampler(params, self.device)
        times.prompt_tokens = len(prompt_ids)
        if reuse:
            state, cached = self._reused_state(prompt_ids, params.max_new_tokens)
        else:
            state, cached = self.new_state(len(prompt_ids) + params.max_new_tokens), 0
        self._owner = stream
        times.cached_tokens = cached
        history = torch.tensor(prompt_ids, device=self.device)
        t0 = time.perf_counter()
        logits = self.prefill(prompt_ids[cached:], state, offset=cached)
        consumed = list(prompt_ids)  # the ids the state holds, grown as decode steps feed it
        kept = (consumed, state)
        if reuse:
            self._kept = kept
        pos, stream.finish_reason = len(prompt_ids), "length"
        if params.greedy and params.repetition_penalty == 1.0:
            yield from self._greedy_loop(logits, state, params, eos, stream, consumed, kept, reuse, t0)
            return
        for n in range(params.max_new_tokens):
            token = sampler(logits, history)
            now = time.perf_counter()
            if n == 0:
                times.prefill_s = now - t0  # includes sampling the first token
                t0 = now
            times.generated_tokens += 1
            times.decode_s = now - t0
            yield token
            if token in eos:
                stream.finish_reason = "stop"
                return
            if pos + 1 >= self.max_context or n == params.max_new_tokens - 1:
                break  # no decode step for a token nobody will read
            self._check_owner(stream, state, kept, reuse)
            history = torch.cat([history, history.new_tensor([token])])
            logits = self.decode_step(token, pos, state)
            consumed.append(token)
            pos += 1
        times.decode_s = time.perf_counter() - t0

    def _check_owner(self, stream, state, kept, reuse: bool) -> None:
        if (reuse and self._kept is not kept) or (state is self._state and self._owner is not stream):
            raise RuntimeError("this stream's state was taken over by a newer request")

    def _greedy_loop(self, logits, state, params, eos, stream: TokenStream, consumed: list, kept, reuse: bool,
                     t0: float):
        """Greedy without a repetition penalty: the same tokens as the sampler's argmax, from
        greedy_tokens (on a CUDA graph, chosen on the device with a step queued ahead). The state may
        run up to two steps past a stop: `consumed` still lists exactly what it was fed."""
        times = stream.times
        pos = len(consumed)
        token = int(torch.argmax(logits))
        times.prefill_s = time.perf_counter() - t0       # includes choosing the first token
        t0 = time.perf_counter()
        times.generated_tokens, times.decode_s = 1, 0.0
        yield token
        if token in eos:
            stream.finish_reason = "stop"
            return
        # step k feeds the k-th generated token at pos + k: none for a token nobody will read
        steps = max(0, min(params.max_new_tokens - 1, self.max_context - 1 - pos))
        tokens = self.greedy_tokens(token, pos, state, steps, consumed,
                                    lambda k: self._check_owner(stream, state, kept, reuse))
        try:
            for token in tokens:
                times.generated_tokens += 1
                times.decode_s = time.perf_counter() - t0
                yield token
                if token in eos:
                    stream.finish_reason = "stop"
                    return
        finally:
            tokens.close()      # completes `consumed` with the steps run past the consumer
        times.decode_s = time.perf_counter() - t0


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
