"""Token sampling and stop-string matching.

`SamplingParams` carries the user's decoding settings, `Sampler` turns one step's logits into a
token id, `sample_rows` does it for several requests' rows at once (a batch's decode step), and
`StopMatcher` watches the decoded text stream for stop strings.

Semantics follow Hugging Face transformers' `generate` logits processors, applied in the same
order: repetition penalty, temperature, top-k, top-p, min-p; then a draw from a per-request
`torch.Generator` by torch.multinomial's own one-sample algorithm (argmax of p / q, q ~ Exp(1))
without its checks of p (half a dozen more launches a row in torch 2.x, a host read in older
versions; scores here are softmaxes of finite or -inf values). Everything runs on the device the
logits live on, and nothing reads a value back to the host except the final `.item()`.

One request alone and the same request among others get the same scores and the same draws: a
Sampler is `sample_rows` on one row, and every step of it is computed row by row (see
`process_rows` for the one place where that needs care)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kiln.errors import KilnError

__all__ = [
    "SamplingParams",
    "Sampler",
    "sample_rows",
    "process_rows",
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
        return process_rows(self._row(logits), [self.params], [history])[0]

    def __call__(self, logits: torch.Tensor, history: torch.Tensor | None = None) -> int:
        return int(self.draw(logits, history).item())

    def draw(self, logits: torch.Tensor, history: torch.Tensor | None = None) -> torch.Tensor:
        """The chosen token as a one-element tensor on the device, without waiting for it (a batch
        queues its rows' draws behind the decode step and reads them all at once)."""
        return sample_rows(self._row(logits), [self], [history])

    def _row(self, logits: torch.Tensor) -> torch.Tensor:
        if logits.dim() == 1:
            logits = logits[None]
        if logits.dim() != 2 or logits.shape[0] != 1:
            raise ValueError(f"Sampler expects logits of shape [V], got {tuple(logits.shape)}")
        return logits.to(device=self.device)


class _Rows:
    """Each row's settings, the filters a row does not use made neutral (a greedy row uses none),
    as host lists and as one float32 [B, 7] tensor uploaded once (through pinned memory on a GPU:
    a pageable copy would wait for the decode step queued before it). `inv` is the temperature's
    float32 reciprocal: torch divides a CUDA tensor by a Python number as a * (1 / b), so one row
    alone (the old form, and transformers' warper) and every row here round the same."""

    def __init__(self, params: list[SamplingParams], vocab: int, like: torch.Tensor):
        self.greedy = [p.greedy for p in params]
        sampled = [p for p, g in zip(params, self.greedy) if not g]
        self.temp = [1.0 if g else p.temperature for p, g in zip(params, self.greedy)]
        self.k = [0 if g or not 0 < p.top_k < vocab else p.top_k for p, g in zip(params, self.greedy)]
        self.p = [1.0 if g else p.top_p for p, g in zip(params, self.greedy)]
        self.min_p = [0.0 if g else p.min_p for p, g in zip(params, self.greedy)]
        self.any_sampled = bool(sampled)
        if not sampled:                 # greedy rows only (a repetition penalty brought them here)
            return
        inv = torch.tensor(self.temp, dtype=torch.float32).reciprocal().tolist()
        table = torch.tensor([[t, i, max(k - 1, 0), float(k > 0), 1.0 - p if p < 1.0 else -1.0, m, float(g)]
                              for t, i, k, p, m, g in zip(self.temp, inv, self.k, self.p, self.min_p, self.greedy)],
                             dtype=torch.float32)
        if like.is_cuda:
            table = table.pin_memory().to(like.device, non_blocking=True)
        else:
            table = table.to(like.device)
        (self.t_col, self.inv_col, self.k_idx, self.k_on, self.p_thr, self.min_col,
         self.greedy_col) = (table[:, c:c + 1] for c in range(7))


def process_rows(logits: torch.Tensor, params: list[SamplingParams], histories: list) -> torch.Tensor:
    """`Sampler.process` for several rows at once: logits [B, V], row j under params[j] with the ids
    histories[j] (None: no history) for its repetition penalty; float32 scores [B, V].

    Row by row, each filter is the one above (apply_*), with the settings of the rows it does not
    concern made neutral (temperature 1, no k, p 1, min-p 0). Every op computes a row as it would
    alone except CUDA's cumsum, whose summing order depends on how many rows it scans
    (`_row_cumsum` keeps it fixed), so a request keeps the same tokens alone and in any batch."""
    return _process(logits, params, histories)[0]


def _process(logits: torch.Tensor, params: list[SamplingParams], histories: list):
    x = logits.to(torch.float32)
    penalised = [j for j, (p, h) in enumerate(zip(params, histories)) if p.repetition_penalty != 1.0 and h is not None]
    if penalised and x is logits:
        x = x.clone()                           # the caller's logits stay as they were
    for j in penalised:                         # rare: row by row, in place
        h = histories[j] if isinstance(histories[j], torch.Tensor) else torch.as_tensor(histories[j], dtype=torch.long)
        x[j] = apply_repetition_penalty(x[j], h, params[j].repetition_penalty)
    rows = _Rows(params, x.shape[-1], x)
    if not rows.any_sampled:
        return x, rows
    if any(t != 1.0 for t in rows.temp):
        shifted = x - x.amax(dim=-1, keepdim=True)
        scaled = shifted * rows.inv_col if x.is_cuda else shifted / rows.t_col
        x = torch.where(rows.t_col == 1.0, x, scaled)
    if any(rows.k):
        top = torch.topk(x, max(rows.k), dim=-1).values
        kth = torch.where(rows.k_on > 0, top.gather(-1, rows.k_idx.long()), _NEG_INF)
        x = x.masked_fill(x < kth, _NEG_INF)
    if any(p < 1.0 for p in rows.p):
        x = _top_p_rows(x, rows.p_thr)
    if any(m > 0.0 for m in rows.min_p):
        probs = torch.softmax(x, dim=-1)
        x = x.masked_fill(probs < probs.amax(dim=-1, keepdim=True) * rows.min_col, _NEG_INF)
    return x, rows


def _top_p_rows(x: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """apply_top_p with row j's tail-mass threshold (1 - p; -1 where top-p is off), the sort stable
    so that tied scores fall in one order whatever the sort's algorithm (the kept count is as
    before; which of tied tokens at the cut are kept may differ from an unstable sort's)."""
    ascending, order = torch.sort(x, dim=-1, descending=False, stable=True)
    tail = _row_cumsum(torch.softmax(ascending, dim=-1))
    drop_sorted = tail <= threshold
    drop_sorted[:, -1:].fill_(False)        # never drop the top token
    drop = torch.empty_like(drop_sorted).scatter_(-1, order, drop_sorted)
    return x.masked_fill(drop, _NEG_INF)


def _row_cumsum(probs: torch.Tensor) -> torch.Tensor:
    """cumsum along rows, each row summed in an order that does not depend on the others. On CUDA,
    torch scans a tensor of one row with CUB (another order) and several rows with a kernel whose
    threads a row, and so its chunking, follow log2(rows) against log2(V) (ATen's
    get_log_num_threads_x_inner_scan: min(9, max(4, (9 + log2 V - log2 rows) // 2)), logs rounded
    up). Scanned in groups of 2 to 2^(log2 V - 9) rows (exactly 2 when V <= 512), a lone row beside
    a copy of itself, every row gets the same threads: the same sums alone and in any batch."""
    if not probs.is_cuda:
        return probs.cumsum(dim=-1)          # (a sequential loop a row)
    parts = []
    for a, b in scan_groups(*probs.shape):
        part = probs[a:b]
        if b - a == 1:
            parts.append(torch.cat([part, part]).cumsum(dim=-1)[:1])
        else:
            parts.append(part.cumsum(dim=-1))
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def scan_groups(rows: int, vocab: int) -> list[tuple[int, int]]:
    """The row ranges _row_cumsum scans apart on CUDA (a range of one row is scanned beside a copy)."""
    group = 1 << max(1, (vocab - 1).bit_length() - 9)
    return [(a, min(a + group, rows)) for a in range(0, rows, group)]


def sample_rows(logits: torch.Tensor, samplers: list[Sampler], histories: list) -> torch.Tensor:
    """Row j's token under samplers[j] (its settings and its generator), [B] on the logits' device,
    without waiting for them. A greedy row takes the argmax of its scores; a sampled row draws as
    torch.multinomial(softmax(scores), 1) does, q ~ Exp(1) from its own generator then the argmax
    of p / q, but without multinomial's checks of p (more launches a row, or a host read in older
    torch), and with one division and one argmax for all the rows. A row of NaN logits (a broken
    model) gives a token where multinomial raised."""
    scores, rows = _process(logits, [s.params for s in samplers], histories)
    if not rows.any_sampled:
        return torch.argmax(scores, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    q = torch.empty_like(probs)
    for j, s in enumerate(samplers):
        if not rows.greedy[j]:
            q[j].exponential_(1.0, generator=s.generator)
    drawn = torch.argmax(probs / q, dim=-1)
    if any(rows.greedy):
        drawn = torch.where(rows.greedy_col[:, 0] > 0, torch.argmax(scores, dim=-1), drawn)
    return drawn


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
