"""Token sampling and stop-string matching.

`SamplingParams` carries the user's decoding settings, `Sampler` turns one step's logits into a
token id, and `StopMatcher` watches the decoded text stream for stop strings.

Semantics follow Hugging Face transformers' `generate` logits processors, applied in the same
order: repetition penalty, temperature, top-k, top-p, min-p; then a draw with
`torch.multinomial` from a per-request `torch.Generator`. Everything runs on the device the
logits live on, and nothing reads a value back to the host except the final `.item()`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kiln.errors import KilnError

__all__ = [
    "SamplingParams",
    "Sampler",
    "StopMatcher",
    "apply_repetition_penalty",
    "apply_temperature",
    "apply_top_k",
    "apply_top_p",
    "apply_min_p",
]

_NEG_INF = float("-inf")
GREEDY_BELOW = 1e-5  # temperatures under this sample greedily
_MAX_SEED = 2**64 - 1  # torch.Generator.manual_seed accepts unsigned 64-bit seeds


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@dataclass
class SamplingParams:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 => greedy (argmax)
    top_k: int = 0  # 0 => off
    top_p: float = 1.0  # 1 => off
    min_p: float = 0.0  # 0 => off
    repetition_penalty: float = 1.0  # 1 => off
    seed: int | None = None  # None => a fresh random seed per Sampler
    stop: tuple[str, ...] = field(default_factory=tuple)  # stop strings
    ignore_eos: bool = False  # generate past end-of-sequence tokens (benchmarks: a fixed output length)

    def __post_init__(self) -> None:
        stop = self.stop
        if stop is None:
            stop = ()
        elif isinstance(stop, str):
            stop = (stop,)
        else:
            stop = tuple(stop)
        self.stop = stop

    @property
    def greedy(self) -> bool:
        # Below 1e-5 the scaled logits overflow f32 (0/0 at denormals): treat as greedy, as vLLM does.
        return self.temperature < GREEDY_BELOW

    def validate(self) -> None:
        """Raise KilnError (one line) on the first out-of-range setting."""
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise KilnError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise KilnError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise KilnError(f"top_k must be an integer >= 0 (0 = off), got {self.top_k!r}")
        if not _is_real(self.top_p) or not (0.0 < self.top_p <= 1.0):
            raise KilnError(f"top_p must be in (0, 1] (1 = off), got {self.top_p!r}")
        if not _is_real(self.min_p) or not (0.0 <= self.min_p <= 1.0):
            raise KilnError(f"min_p must be in [0, 1] (0 = off), got {self.min_p!r}")
        if (
            not _is_real(self.repetition_penalty)
            or not math.isfinite(self.repetition_penalty)
            or not (0.01 <= self.repetition_penalty <= 100)
        ):
            raise KilnError(
                f"repetition_penalty must be in [0.01, 100] (1 = off), got {self.repetition_penalty!r}"
            )
        if self.seed is not None and (not _is_int(self.seed) or not (0 <= self.seed <= _MAX_SEED)):
            raise KilnError(f"seed must be an integer in [0, 2**64 - 1], got {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise KilnError(f"ignore_eos must be True or False, got {self.ignore_eos!r}")
        for s in self.stop:
            if not isinstance(s, str):
                raise KilnError(f"stop strings must be strings, got {s!r}")
            if s == "":
                raise KilnError("stop strings must be non-empty")


# --------------------------------------------------------------------------------------------
# Logits processors. Each takes and returns a 1-D float32 tensor of scores; filtered entries
# become -inf. None of them synchronises with the device.
# --------------------------------------------------------------------------------------------


def apply_repetition_penalty(logits: torch.Tensor, history: torch.Tensor | None, penalty: float) -> torch.Tensor:
    """For every distinct id in `history`: positive logits are divided by `penalty`, the rest multiplied."""
    if history is None or penalty == 1.0 or history.numel() == 0:
        return logits
    history = history.to(device=logits.device, dtype=torch.long).reshape(-1)
    seen = torch.zeros(logits.shape[-1], dtype=torch.bool, device=logits.device)
    seen.scatter_(0, history, True)  # duplicates just set the same flag: the penalty applies once per id
    penalised = torch.where(logits > 0, logits / penalty, logits * penalty)
    return torch.where(seen, penalised, logits)


def apply_temperature(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Divide by the temperature. The maximum is subtracted first (softmax is shift-invariant), so a
    tiny temperature sends the losers to -inf instead of overflowing the winner to +inf."""
    if temperature == 1.0:
        return logits
    return (logits - logits.max()) / temperature


def apply_top_k(logits: torch.Tensor, k: int) -> torch.Tensor:
    """Keep the k largest scores (ties with the k-th largest are kept too)."""
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    kth = torch.topk(logits, k).values[-1]
    return logits.masked_fill(logits < kth, _NEG_INF)


def apply_top_p(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """Keep the smallest set of most probable tokens whose total probability reaches `top_p`.

    A token is dropped when the probability mass of the tokens at or below it (in the ascending
    order) is <= 1 - top_p, i.e. when the tokens above it already hold >= top_p. Summing from the
    small end keeps the tail sums accurate in float32. The most probable token is always kept.
    """
    if top_p >= 1.0:
        return logits
    ascending, order = torch.sort(logits, descending=False)
    tail_mass = torch.softmax(ascending, dim=-1).cumsum(dim=-1)
    drop_sorted = tail_mass <= (1.0 - top_p)
    drop_sorted[-1].fill_(False)  # never drop the top token (fill_ on a view: no host->device copy)
    drop = torch.empty_like(drop_sorted).scatter_(0, order, drop_sorted)
    return logits.masked_fill(drop, _NEG_INF)


def apply_min_p(logits: torch.Tensor, min_p: float) -> torch.Tensor:
    """Drop tokens whose probability is below `min_p` times the top token's probability."""
    if min_p <= 0.0:
        return logits
    probs = torch.softmax(logits, dim=-1)
    drop = probs < probs.max() * min_p  # the top token never satisfies this since min_p <= 1
    return logits.masked_fill(drop, _NEG_INF)


class Sampler:
    """Chooses the next token from one step's logits under a request's `SamplingParams`.

    Owns a `torch.Generator` on `device`, seeded from `params.seed` (or a fresh random seed, kept
    in `self.seed`), so the same seed and the same logits give the same tokens.
    """

    def __init__(self, params: SamplingParams, device: str | torch.device = "cpu"):
        params.validate()
        self.params = params
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if params.seed is None:
            self.seed = self.generator.seed()  # non-deterministic; recorded for reproduction
        else:
            self.seed = params.seed
            self.generator.manual_seed(params.seed)

    def process(self, logits: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 scores the draw is made from: -inf marks tokens that cannot be chosen.

        In greedy mode only the repetition penalty is applied (the filters cannot change the argmax).
        """
        p = self.params
        if logits.dim() == 2 and logits.shape[0] == 1:
            logits = logits[0]
        if logits.dim() != 1:
            raise ValueError(f"Sampler expects logits of shape [V], got {tuple(logits.shape)}")
        x = logits.to(device=self.device, dtype=torch.float32)
        if history is not None and not isinstance(history, torch.Tensor):
            history = torch.as_tensor(history, dtype=torch.long)
        x = apply_repetition_penalty(x, history, p.repetition_penalty)
        if p.greedy:
            return x
        x = apply_temperature(x, p.temperature)
        x = apply_top_k(x, p.top_k)
        x = apply_top_p(x, p.top_p)
        x = apply_min_p(x, p.min_p)
        return x

    def __call__(self, logits: torch.Tensor, history: torch.Tensor | None = None) -> int:
        return int(self.draw(logits, history).item())

    def draw(self, logits: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """The chosen token as a one-element tensor on the device, without waiting for it (a batch
        queues its rows' draws behind the decode step and reads them all at once)."""
        scores = self.process(logits, history)
        if self.params.greedy:
            return torch.argmax(scores).reshape(1)
        probs = torch.softmax(scores, dim=-1)
        return torch.multinomial(probs, 1, generator=self.generator)


# --------------------------------------------------------------------------------------------
# Stop strings
# --------------------------------------------------------------------------------------------


class StopMatcher:
    """Finds stop strings in a stream of decoded text pieces.

    `push(piece)` returns the text that is safe to show now and whether a stop string completed.
    Text that might be the beginning of a stop string is held back until the following pieces
    decide it; when a stop string completes, only the text before it is returned and the matcher
    stays stopped. With several stop strings, the one that starts earliest in the text wins.
    Everything returned (plus `flush()` at the end) concatenates to the full text cut just before
    the first stop-string occurrence.
    """

    def __init__(self, stops: tuple[str, ...] | list[str] | str = ()):
        if isinstance(stops, str):
            stops = (stops,)
        self.stops = tuple(stops)
        for s in self.stops:
            if not isinstance(s, str) or s == "":
                raise KilnError(f"stop strings must be non-empty strings, got {s!r}")
        self._held = ""
        self.stopped = False

    def _held_suffix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:k]):
                    best = k
                    break
        return best

    def push(self, piece: str) -> tuple[str, bool]:
        if self.stopped:
            return "", True
        if not self.stops:
            return piece, False
        text = self._held + piece
        # No stop occurrence starts before the held text (it would have been held or found
        # earlier), so the earliest match in `text` is the earliest in the whole stream.
        first = -1
        for s in self.stops:
            i = text.find(s)
            if i != -1 and (first == -1 or i < first):
                first = i
        if first != -1:
            self.stopped = True
            self._held = ""
            return text[:first], True
        keep = self._held_suffix_len(text)
        cut = len(text) - keep
        self._held = text[cut:]
        return text[:cut], False

    def flush(self) -> str:
        """End of generation: release the held-back text (empty once a stop matched)."""
        out, self._held = self._held, ""
        return out
