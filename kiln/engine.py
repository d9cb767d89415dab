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


@dataclass
class TokenStream:
    """Iterates generated token ids; `finish_reason` and `times` are final once exhausted."""
    ids: Iterator[int]
    times: StepTimes = field(default_factory=StepTimes)
    finish_reason: str | None = None


class Engine:
    def __init__(self, model, dtype, device, max_context: int, prefill_chunk: int = 512):
        self.model, self.dtype, self.device = model, dtype, torch.device(device)
        self.max_context, self.prefill_chunk = max_context, prefill_chunk

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def prefill(self, ids: list[int], state) -> torch.Tensor:
        """Run the prompt through the model in chunks; logits of the last position."""
        logits = None
        for start in range(0, len(ids), self.prefill_chunk):
            chunk = torch.tensor(ids[start:start + self.prefill_chunk], device=self.device)
            pos = torch.arange(start, start + len(chunk), device=self.device)
            logits = self.model.forward(chunk, pos, state)
        return logits[-1]

    @torch.inference_mode()
    def decode_step(self, token: int, pos: int, state) -> torch.Tensor:
        ids = torch.tensor([token], device=self.device)
        return self.model.forward(ids, torch.tensor([pos], device=self.device), state)[-1]

    def check_prompt(self, ids: list[int]) -> None:
        if not ids:
            raise KilnError("empty prompt")
        if len(ids) >= self.max_context:
            raise KilnError(f"prompt has {len(ids)} tokens, which does not fit the max context of "
                            f"{self.max_context} tokens (raise --max-context or shorten the prompt)")

    def generate(self, prompt_ids: list[int], params: SamplingParams, eos_ids) -> TokenStream:
        self.check_prompt(prompt_ids)
        params.validate()
        stream = TokenStream(iter(()))
        stream.ids = self._loop(prompt_ids, params, set(eos_ids), stream)
        return stream

    def _loop(self, prompt_ids, params, eos, stream: TokenStream):
        times, sampler = stream.times, Sampler(params, self.device)
        times.prompt_tokens = len(prompt_ids)
        state = self.model.make_state(self.dtype, self.device)
        history = torch.tensor(prompt_ids, device=self.device)
        t0 = time.perf_counter()
        logits = self.prefill(prompt_ids, state)
        pos, stream.finish_reason = len(prompt_ids), "length"
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
            if pos + 1 >= self.max_context:
                return
            history = torch.cat([history, history.new_tensor([token])])
            logits = self.decode_step(token, pos, state)
            pos += 1
        times.decode_s = time.perf_counter() - t0
