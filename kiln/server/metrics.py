"""What `GET /metrics` reports, in Prometheus' text format (version 0.0.4): the worker counts as it
runs; a scrape reads the counts (plain ints and floats, updated by one thread: a scrape may see a
request's tokens a step late, never a torn value)."""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

RATE_WINDOW_S = 10.0     # output tok/s is measured over the last this many seconds


@dataclass
class ServeStats:
    running: int = 0
    waiting: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0         # prompt tokens whose state was reused, not prefilled
    generated_tokens: int = 0
    state_bytes: int = 0           # KV caches and recurrent states of the running requests
    prefill_graphs: int = 0        # prefill CUDA graphs captured (kiln.backends.graphs.PrefillGraphs)
    prefill_graph_replays: int = 0  # prompts or prompt parts prefilled by replaying one
    kv_pages_used: int = 0         # a batch pool's KV pages held (requests and kept prefixes), of kv_pages
    kv_pages: int = 0
    preemptions: int = 0           # running requests preempted for want of KV pages (prefilled again later)
    finished: dict = field(default_factory=dict)     # OpenAI finish reason (or error, cancelled) -> count
    _recent: deque = field(default_factory=deque)    # (time, tokens) of the last RATE_WINDOW_S

    def tokens(self, n: int) -> None:
        """n more tokens generated now."""
        now = time.monotonic()
        self.generated_tokens += n
        self._recent.append((now, n))
        while self._recent and self._recent[0][0] < now - RATE_WINDOW_S:
            self._recent.popleft()

    def done(self, reason: str, prompt_tokens: int = 0, cached_tokens: int = 0) -> None:
        self.finished[reason] = self.finished.get(reason, 0) + 1
        self.prompt_tokens += prompt_tokens
        self.cached_tokens += cached_tokens

    def output_tok_s(self) -> float:
        now = time.monotonic()
        return sum(n for t, n in list(self._recent) if t >= now - RATE_WINDOW_S) / RATE_WINDOW_S

    def text(self, model_id: str) -> str:
        """The exposition: HELP and TYPE lines, then the samples, each labelled with the model."""
        m = f'model="{model_id}"'
        hit = self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0
        rows = [
            ("kiln_requests_running", "gauge", "requests decoding now", [("", self.running)]),
            ("kiln_requests_waiting", "gauge", "requests queued for the engine", [("", self.waiting)]),
            ("kiln_requests_total", "counter", "requests ended, by finish reason",
             [(f',finish_reason="{k}"', v) for k, v in sorted(self.finished.items())]
             or [(',finish_reason="stop"', 0)]),
            ("kiln_prompt_tokens_total", "counter", "prompt tokens of ended requests", [("", self.prompt_tokens)]),
            ("kiln_prefix_cached_tokens_total", "counter", "prompt tokens served from a reused prefix",
             [("", self.cached_tokens)]),
            ("kiln_prefix_hit_rate", "gauge", "cached prompt tokens over prompt tokens", [("", round(hit, 6))]),
            ("kiln_generated_tokens_total", "counter", "tokens generated", [("", self.generated_tokens)]),
            ("kiln_output_tokens_per_second", "gauge", f"tokens generated over the last {RATE_WINDOW_S:g} s",
             [("", round(self.output_tok_s(), 3))]),
            ("kiln_state_bytes", "gauge", "bytes of KV cache and recurrent state the running requests hold",
             [("", self.state_bytes)]),
            ("kiln_kv_pages_used", "gauge", "KV pages of the batch pool held by requests and kept prefixes",
             [("", self.kv_pages_used)]),
            ("kiln_kv_pages", "gauge", "KV pages of the batch pool", [("", self.kv_pages)]),
            ("kiln_preemptions_total", "counter", "running requests preempted for want of KV pages",
             [("", self.preemptions)]),
            ("kiln_prefill_graphs", "gauge", "prefill CUDA graphs captured", [("", self.prefill_graphs)]),
            ("kiln_prefill_graph_replays_total", "counter", "prompt parts prefilled by replaying a CUDA graph",
             [("", self.prefill_graph_replays)]),
        ]
        out = []
        for name, kind, help_, samples in rows:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
            out += [f"{name}{{{m}{labels}}} {value}" for labels, value in samples]
        return "\n".join(out) + "\n"


def count_graphs(stats: ServeStats, engine) -> None:
    """Copy the engine's prefill-graph counts into the stats (none where the graphs are off)."""
    graphs = getattr(engine, "prefill_graphs", None)
    if graphs is not None:
        stats.prefill_graphs, stats.prefill_graph_replays = graphs.captures, graphs.replays


def count_pool(stats: ServeStats, batch) -> None:
    """The batch pool's page use and the batch's preemptions into the stats (none without a pool)."""
    pool = batch.pool
    if pool is not None:
        stats.kv_pages, stats.kv_pages_used = pool.pages, pool.pages - len(pool.free_pages)
    stats.preemptions = batch.preempted


def state_bytes(state) -> int:
    """Bytes of the tensors a request's per-layer state holds (KV caches, GDN states, and the caches
    a wrapper such as Gemma 4's KV producer holds); of a pool slot, its pages and its slot's states,
    not the pool's."""
    return sum(layer.held_bytes() if hasattr(layer, "held_bytes") else _tensor_bytes(layer, 2)
               for layer in state or ())


def _tensor_bytes(obj, depth: int) -> int:
    if hasattr(obj, "element_size") and hasattr(obj, "numel"):
        return obj.numel() * obj.element_size()
    if depth == 0 or not hasattr(obj, "__dict__"):
        return 0
    return sum(_tensor_bytes(v, depth - 1) for v in vars(obj).values())
