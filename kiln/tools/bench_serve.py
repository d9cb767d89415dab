"""`kiln bench-serve URL|MODEL`: N concurrent streaming clients against an OpenAI-compatible server.

Protocol: the target is a running server's base URL, or a model that `kiln serve` loads here in a
child process (a free loopback port; stopped at the end, on Ctrl-C and on errors). One unmeasured
warm-up request goes first. Then, per concurrency level, `--num-requests` requests are sent with at
most `concurrency` in flight: one client thread each, every client sending its next request as soon
as its last one ended. A request is a streamed /v1/completions call on `--prompt-length` seeded
random token ids (every request its own prompt) with max_tokens = --gen, temperature 0 (or
--temperature and --top-p, each request seeded: --seed plus its index) and ignore_eos where the
server takes it; or, with --requests-file, a streamed /v1/chat/completions
call on a line of the file.

Clocks (perf_counter, in the client): TTFT is from just before the connection opens to the first
streamed chunk that carries output; inter-token latency (ITL) is each gap between two such chunks
(a chunk is one token or one text piece); E2E latency runs to `data: [DONE]`. Output tokens come
from the usage the stream ends with (stream_options.include_usage), else one per chunk. Throughput
is the level's tokens over its wall time, first send to last answer.
"""

from __future__ import annotations

import http.client
import json
import math
import os
import platform
import random
import shlex
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit
from xml.sax.saxutils import escape

from ..api import pick_device
from ..cli.flags import at_least, finite, nonneg_int, positive_float, positive_int, positive_int_list
from ..errors import KilnError
from .benchutil import check_writable, command_line, environment, markdown_table, now_iso, write_atomic

DEFAULT_GEN = 128
# Token ids drawn below this when neither the server nor --vocab-size says the vocabulary: every
# byte-level BPE vocabulary has its 256 byte tokens, and SentencePiece ones their 256 byte-fallback
# pieces, so ids under 256 exist in any model's vocabulary.
SAFE_VOCAB = 256
PERCENTILES = (50, 90, 99)


# -- flags -------------------------------------------------------------------------------------------
def add_parser(sub) -> None:
    p = sub.add_parser("bench-serve", help="concurrent streaming clients against an OpenAI-compatible server: "
                                           "request and token throughput, TTFT, inter-token latency")
    p.add_argument("target", metavar="URL|MODEL",
                   help="a running server's base URL (http://host:port), or a model (a bundled name, a path or "
                        "a synth: spec) for kiln serve to load here")
    p.add_argument("--concurrency", type=positive_int_list, default=[1, 8, 32], metavar="N,N,...",
                   help="requests in flight, one level after another (default 1,8,32)")
    p.add_argument("--num-requests", type=positive_int, default=None, metavar="N",
                   help="requests per level (default max(4 x concurrency, 8))")
    p.add_argument("--prompt-length", type=positive_int, default=512, metavar="N",
                   help="random prompt tokens per request (default 512)")
    p.add_argument("--gen", type=positive_int, default=None, metavar="N",
                   help=f"max_tokens of each request (default {DEFAULT_GEN}; with --requests-file each line's own)")
    p.add_argument("--requests-file", default=None, metavar="FILE.jsonl",
                   help="chat requests instead of random prompts: one OpenAI chat body with messages a line, "
                        "sent in turn (cycled) to /v1/chat/completions")
    p.add_argument("--vocab-size", type=positive_int, default=None, metavar="N",
                   help=f"random token ids are drawn below N (default: the vocab_size /v1/models reports, "
                        f"else {SAFE_VOCAB})")
    p.add_argument("--seed", type=nonneg_int, default=0,
                   help="seed of the random prompts, and of sampled requests (plus their index; default 0)")
    p.add_argument("--temperature", type=finite, default=0.0,
                   help="each random-prompt request's temperature (default 0: greedy)")
    p.add_argument("--top-p", type=finite, default=1.0, help="each random-prompt request's top_p (default 1: off)")
    p.add_argument("--timeout", type=positive_float, default=600, metavar="S",
                   help="seconds a request may wait for its next byte (default 600)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="sent as 'Authorization: Bearer KEY' (default: $KILN_API_KEY)")
    p.add_argument("--json", dest="json_path", default=None, metavar="FILE", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="FILE.svg", help="plot output tok/s and TTFT over concurrency")
    p.add_argument("--quiet", action="store_true", help="print nothing on stderr")
    g = p.add_argument_group("the server a MODEL target starts (kiln serve's flags)")
    g.add_argument("--device", default=None, help="auto (default), cpu, cuda, cuda:N")
    g.add_argument("--dtype", choices=["f32", "bf16", "f16"], default=None,
                   help="weights and activations (default: bf16 on GPU, f32 on CPU)")
    g.add_argument("--backend", choices=["auto", "cuda", "cpu", "reference"], default=None, help="kernels")
    g.add_argument("--max-context", type=at_least(2), default=None, metavar="N",
                   help="cap on prompt + generated tokens")
    g.add_argument("--queue-limit", type=positive_int, default=None, metavar="N",
                   help="default: kiln serve's 64, or the highest concurrency if that is more (nothing rejected)")
    g.add_argument("--serve-args", default=None, metavar="'ARGS'",
                   help="more kiln serve flags as one string, written with '=': --serve-args='--gpu-memory 40'")
    g.add_argument("--ready-timeout", type=positive_float, default=1800, metavar="S",
                   help="seconds the server may take to load (default 1800)")
    p.set_defaults(main=main)


def is_url(target: str) -> bool:
    return target.startswith(("http://", "https://"))


def serve_flags(a) -> list[str]:
    """kiln serve's flags for a MODEL target; KilnError when they are given with a URL."""
    named = {"--device": a.device, "--dtype": a.dtype, "--backend": a.backend, "--max-context": a.max_context,
             "--queue-limit": a.queue_limit, "--serve-args": a.serve_args}
    if is_url(a.target):
        given = [name for name, v in named.items() if v is not None]
        if given:
            raise KilnError(f"{', '.join(given)} apply to a server bench-serve starts (a MODEL target), not to a URL")
        return []
    named["--queue-limit"] = a.queue_limit or max(64, max(a.concurrency))
    extra = shlex.split(named.pop("--serve-args") or "")
    return [s for name, v in named.items() if v is not None for s in (name, str(v))] + extra


# -- the server: a URL, or kiln serve started here -----------------------------------------------------
@dataclass
class Endpoint:
    scheme: str
    host: str
    port: int
    prefix: str                 # the path before /v1, "" for most servers
    api_key: str | None = None

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{self.scheme}://{host}:{self.port}{self.prefix}"

    def connect(self, timeout: float) -> http.client.HTTPConnection:
        kind = http.client.HTTPSConnection if self.scheme == "https" else http.client.HTTPConnection
        return kind(self.host, self.port, timeout=timeout)

    def headers(self, stream: bool = False) -> dict:
        auth = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        return {"Content-Type": "application/json", "Accept": "text/event-stream", **auth} if stream else auth

    def get(self, path: str, timeout: float = 10) -> tuple[int, bytes]:
        conn = self.connect(timeout)
        try:
            conn.request("GET", self.prefix + path, headers=self.headers())
            resp = conn.getresponse()
            return resp.status, resp.read()
        finally:
            conn.close()


def parse_url(url: str, api_key: str | None) -> Endpoint:
    """A base URL, with or without the /v1 that `kiln serve` prints."""
    parts = urlsplit(url)
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        port = None
    if not parts.hostname or port is None or parts.query or parts.fragment:
        raise KilnError(f"not a server URL: {url!r} (expected http://host:port)")
    prefix = parts.path.rstrip("/")
    prefix = prefix[:-3] if prefix.endswith("/v1") else prefix
    return Endpoint(parts.scheme, parts.hostname, port, prefix, api_key)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class StartedServer:
    """`kiln serve MODEL FLAGS` on a free loopback port in a child process, its stderr in a temp log."""

    def __init__(self, model: str, flags: list[str], api_key: str | None, env: dict | None = None):
        self.endpoint = Endpoint("http", "127.0.0.1", free_port(), "", api_key)
        self.log = tempfile.NamedTemporaryFile(prefix="kiln-bench-serve-", suffix=".log", delete=False)
        self.command = [sys.executable, "-m", "kiln.cli", "serve", model, *flags,
                        "--host", "127.0.0.1", "--port", str(self.endpoint.port)]
        self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=self.log, env=env)

    def start_lines(self, first: int = 20, last: int = 10) -> list[str]:
        """The server's own `[kiln] ...` lines (the memory plan, the batch state's slots and pages, the
        graphs captured, a fatal error): what a run measured depends on them. Past `first` + `last`
        lines, the first and the last ones with a line saying how many were left out between."""
        text = Path(self.log.name).read_text(errors="replace")
        lines = [s.strip()[:400] for s in text.splitlines() if s.startswith("[kiln]")]
        if len(lines) <= first + last:
            return lines
        return [*lines[:first], f"... {len(lines) - first - last} [kiln] lines left out ...", *lines[-last:]]

    def _last_log_line(self) -> str:
        lines = [s.strip() for s in Path(self.log.name).read_text(errors="replace").splitlines() if s.strip()]
        return lines[-1][:300] if lines else "no output"

    def wait_ready(self, timeout: float) -> None:
        """Until /health answers 200 (kiln serve listens only once the model is loaded)."""
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise KilnError(f"kiln serve exited with code {self.proc.returncode} before it was ready: "
                                f"{self._last_log_line()} (log: {self.log.name})")
            try:
                if self.endpoint.get("/health", timeout=5)[0] == 200:
                    return
            except (OSError, http.client.HTTPException):
                pass
            if time.monotonic() > deadline:
                raise KilnError(f"kiln serve did not answer within {timeout:g} s (log: {self.log.name})")
            time.sleep(0.25)

    def stop(self, keep_log: bool) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()        # uvicorn shuts down gracefully on SIGTERM
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()
        if not keep_log:
            os.unlink(self.log.name)


def model_card(endpoint: Endpoint) -> dict:
    """The first model /v1/models lists (id, and max_model_len or vocab_size where the server says them)."""
    try:
        status, raw = endpoint.get("/v1/models")
    except (OSError, http.client.HTTPException) as e:
        raise KilnError(f"cannot reach {endpoint.url}: {getattr(e, 'strerror', None) or e}") from None
    if status == 401:
        raise KilnError(f"{endpoint.url} wants an API key: pass --api-key KEY or set KILN_API_KEY")
    try:
        card = json.loads(raw)["data"][0]
    except (ValueError, LookupError, TypeError):
        card = None
    if not isinstance(card, dict) or not isinstance(card.get("id"), str):
        raise KilnError(f"{endpoint.url}/v1/models answered HTTP {status} without a model list")
    return card


def server_counters(endpoint: Endpoint) -> dict[str, float]:
    """kiln's counters from the server's /metrics (kiln_*_total samples labelled with the model only),
    or {} where it has none (another server, or no /metrics)."""
    try:
        status, raw = endpoint.get("/metrics")
    except (OSError, http.client.HTTPException):
        return {}
    out = {}
    for line in raw.decode(errors="replace").splitlines() if status == 200 else ():
        sample, _, value = line.rpartition(" ")
        name = sample.split("{")[0]
        if name.startswith("kiln_") and name.endswith("_total") and "," not in sample:
            try:
                out[name] = float(value)
            except ValueError:
                pass
    return out


# -- requests ------------------------------------------------------------------------------------------
@dataclass
class Planned:
    path: str                       # /v1/completions or /v1/chat/completions
    body: dict
    prompt_tokens: int | None       # known before sending for token-id prompts


def random_prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`count` prompts of `length` token ids in [0, vocab), drawn one after another from one seeded
    generator: every request its own prompt, so kiln's server finds no prefix of the last one to reuse."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def completion_request(model: str, ids: list[int], gen: int, ignore_eos: bool,
                       sampling: dict | None = None) -> Planned:
    """A streamed /v1/completions body: greedy, or `sampling`'s temperature, top_p and seed."""
    body = {"model": model, "prompt": ids, "max_tokens": gen, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **(sampling or {})}
    if ignore_eos:
        body["ignore_eos"] = True
    return Planned("/v1/completions", body, len(ids))


def chat_request(model: str, line: dict, gen: int | None) -> Planned:
    """A line of --requests-file as sent: streamed with usage, to the served model, greedy unless the
    line says otherwise, max_tokens = --gen when given."""
    body = {**line, "model": model, "stream": True, "stream_options": {"include_usage": True}}
    body.setdefault("temperature", 0)
    if gen is not None:
        body.pop("max_completion_tokens", None)
        body["max_tokens"] = gen
    return Planned("/v1/chat/completions", body, None)


def read_requests_file(path: str) -> list[dict]:
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise KilnError(f"--requests-file {path}: {getattr(e, 'strerror', None) or e}") from None
    lines = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            body = json.loads(line)
        except ValueError as e:
            raise KilnError(f"--requests-file {path}:{number}: not valid JSON ({e})") from None
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            raise KilnError(f'--requests-file {path}:{number}: expected a chat request, a JSON object with a '
                            f'non-empty "messages" list')
        lines.append(body)
    if not lines:
        raise KilnError(f"--requests-file {path}: no requests in the file")
    return lines


# -- one streamed request --------------------------------------------------------------------------------
@dataclass
class Result:
    ok: bool = False
    status: int | None = None               # HTTP status; None when no answer came
    error: str | None = None
    ttft: float | None = None               # seconds
    itl: list[float] = field(default_factory=list)
    latency: float | None = None
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int = 0


def sse_data(lines):
    """The data of each server-sent event, from the stream's lines (bytes); comments and other fields
    are skipped, a multi-line data field is joined with newlines."""
    data: list[str] = []
    for raw in lines:
        line = raw.decode("utf-8", errors="replace").rstrip("\r\n")
        if not line:
            if data:
                yield "\n".join(data)
            data = []
        elif line.startswith("data:"):
            value = line[5:]
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


def has_output(event: dict) -> bool:
    """Whether a chunk carries generated output: completion text, a chat delta's content or tool call,
    or token ids (some servers stream those for models without a tokenizer)."""
    for choice in event.get("choices") or []:
        if not isinstance(choice, dict):
            continue
        delta = choice.get("delta") if isinstance(choice.get("delta"), dict) else {}
        if choice.get("text") or choice.get("token_ids") or any(
                delta.get(k) for k in ("content", "reasoning_content", "tool_calls")):
            return True
    return False


def error_message(obj) -> str:
    err = obj.get("error") if isinstance(obj, dict) else None
    message = err.get("message") if isinstance(err, dict) else err
    return str(message or obj)[:300]


def read_stream(lines, t0: float, clock=time.perf_counter) -> Result:
    """A streamed answer's timings and token counts, read event by event as it arrives."""
    res, stamps, done = Result(status=200), [], False
    for data in sse_data(lines):
        if data.strip() == "[DONE]":
            done = True
            break
        try:
            event = json.loads(data)
        except ValueError:
            res.error = f"a stream event is not JSON: {data[:100]!r}"
            break
        if not isinstance(event, dict) or "error" in event:
            res.error = f"error event: {error_message(event)}"
            break
        if isinstance(event.get("usage"), dict):
            usage = event["usage"]
            res.output_tokens = usage.get("completion_tokens") or 0
            res.prompt_tokens = usage.get("prompt_tokens")
            res.cached_tokens = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        if has_output(event):
            stamps.append(clock())
    res.latency = clock() - t0
    if stamps:
        res.ttft = stamps[0] - t0
        res.itl = [b - a for a, b in zip(stamps, stamps[1:])]
    if not res.output_tokens:       # no usage from the server: one token a chunk, an estimate
        res.output_tokens = len(stamps)
    if res.error is None and not done:
        res.error = "the stream ended before data: [DONE]"
    res.ok = res.error is None
    return res


def send(endpoint: Endpoint, req: Planned, timeout: float) -> Result:
    """One request, streamed; every failure (refused, HTTP error, broken stream) is a Result, not a raise."""
    t0 = time.perf_counter()
    conn = endpoint.connect(timeout)
    try:
        conn.request("POST", endpoint.prefix + req.path, body=json.dumps(req.body).encode(),
                     headers=endpoint.headers(stream=True))
        resp = conn.getresponse()
        if resp.status != 200:
            raw = resp.read()
            try:
                message = error_message(json.loads(raw))
            except ValueError:
                message = raw.decode("utf-8", errors="replace")[:300]
            return Result(status=resp.status, error=f"HTTP {resp.status}: {message}")
        res = read_stream(iter(resp.readline, b""), t0)
    except (OSError, http.client.HTTPException) as e:
        return Result(error=f"{type(e).__name__}: {e}")
    finally:
        conn.close()
    res.prompt_tokens = res.prompt_tokens if res.prompt_tokens is not None else req.prompt_tokens
    return res


# -- one concurrency level ----------------------------------------------------------------------------
def run_level(send_one, plans: list[Planned], concurrency: int) -> tuple[list[Result], float]:
    """Every plan sent, at most `concurrency` at a time; (results in plan order, wall seconds)."""
    results: list[Result | None] = [None] * len(plans)
    order = iter(range(len(plans)))
    lock = threading.Lock()

    def client() -> None:
        while True:
            with lock:
                i = next(order, None)
            if i is None:
                return
            try:
                results[i] = send_one(plans[i])
            except Exception as e:  # a bug in the client: that request fails with its message, the level goes on
                results[i] = Result(error=f"{type(e).__name__}: {e}")

    # Daemon threads: after Ctrl-C nothing waits for a request still streaming.
    threads = [threading.Thread(target=client, daemon=True) for _ in range(min(concurrency, len(plans)))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        while t.is_alive():
            t.join(0.5)     # a timed join, so that Ctrl-C reaches the main thread at once
    return results, time.perf_counter() - t0


def percentile(values: list[float], p: float) -> float | None:
    """The p-th percentile, linear between the two nearest ranks (numpy's default); None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    k = (len(xs) - 1) * p / 100
    lo = math.floor(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def _ms(values: list[float], ps=PERCENTILES) -> dict:
    return {f"p{p}": None if (v := percentile(values, p)) is None else round(v * 1000, 3) for p in ps}


def _rate(n: float, seconds: float) -> float | None:
    return round(n / seconds, 3) if seconds > 0 else None


def summarise(concurrency: int, results: list[Result], duration: float) -> dict:
    done = [r for r in results if r.ok]
    rejected = sum(r.status == 429 for r in results)
    output = sum(r.output_tokens for r in done)
    prompt = sum(r.prompt_tokens for r in done) if all(r.prompt_tokens is not None for r in done) else None
    errors: dict[str, int] = {}
    for r in results:
        if not r.ok:
            errors[r.error] = errors.get(r.error, 0) + 1
    return {
        "concurrency": concurrency, "requests": len(results), "completed": len(done),
        "failed": len(results) - len(done) - rejected, "rejected": rejected, "duration_s": round(duration, 6),
        "request_throughput": _rate(len(done), duration), "output_tok_s": _rate(output, duration),
        "total_tok_s": None if prompt is None else _rate(prompt + output, duration),
        "prompt_tokens": prompt, "output_tokens": output, "cached_tokens": sum(r.cached_tokens for r in done),
        "ttft_ms": _ms([r.ttft for r in done if r.ttft is not None]),
        "itl_ms": _ms([gap for r in done for gap in r.itl]),
        "e2e_ms": _ms([r.latency for r in done]),
        "errors": errors,
        "server_counters": None,        # Bench.run fills it from the server's /metrics
    }


# -- output --------------------------------------------------------------------------------------------
def _num(x, digits: int = 1) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _msec(x) -> str:
    """Milliseconds: two decimals under 10 ms (inter-token gaps on a fast model), one above."""
    return _num(x, 2 if x is not None and x < 10 else 1)


def table(levels: list[dict]) -> str:
    heads = ["concurrency", "completed", "failed", "rejected", "duration s", "req/s", "output tok/s", "total tok/s",
             "TTFT p50 ms", "TTFT p90 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p90 ms", "ITL p99 ms",
             "E2E p50 ms", "E2E p99 ms"]
    rows = []
    for r in levels:
        rows.append([str(r["concurrency"]), str(r["completed"]), str(r["failed"]), str(r["rejected"]),
                     _num(r["duration_s"], 2), _num(r["request_throughput"], 2), _num(r["output_tok_s"]),
                     _num(r["total_tok_s"]), *(_msec(r["ttft_ms"][f"p{p}"]) for p in PERCENTILES),
                     *(_msec(r["itl_ms"][f"p{p}"]) for p in PERCENTILES),
                     _msec(r["e2e_ms"]["p50"]), _msec(r["e2e_ms"]["p99"])])
    return markdown_table(heads, rows, right=set(range(len(heads))))


def _axis(vmax: float) -> tuple[float, float, int]:
    """(top, step, decimals) of a y axis from 0 that holds vmax: a step of 1, 2, 2.5 or 5 times a power
    of ten giving at most four intervals, so every tick label is a round number."""
    if vmax <= 0:
        return 1.0, 0.25, 2
    k = math.floor(math.log10(vmax / 4))
    m = next(m for m in (1, 2, 2.5, 5, 10) if m * 10 ** k * 4 >= vmax * (1 - 1e-9))
    step = m * 10 ** k
    decimals = next(d for d in range(12) if abs(round(step, d) - step) < 1e-9 * step)
    return step * math.ceil(vmax / step - 1e-9), step, decimals


def _panel(xs: list[float], labels: list[str], values: list, box: tuple, title: str, color: str) -> list[str]:
    """One line chart in box (x, y, width, height): values at positions xs in [0, 1], labels under them."""
    x0, y0, w, h = box
    out = [f'<text x="{x0}" y="{y0 - 10}" font-weight="bold">{escape(title)}</text>',
           f'<rect x="{x0}" y="{y0}" width="{w}" height="{h}" fill="none" stroke="#999"/>']
    for x, label in zip(xs, labels):
        px = x0 + x * w
        out.append(f'<text x="{px:.1f}" y="{y0 + h + 18}" text-anchor="middle">{escape(label)}</text>')
    known = [v for v in values if v is not None]
    if not known:
        return out + [f'<text x="{x0 + w / 2}" y="{y0 + h / 2}" text-anchor="middle" fill="#999">not measured</text>']
    top, step, decimals = _axis(max(known) * 1.1)      # room above the highest point for its label
    for i in range(round(top / step) + 1):
        py = y0 + h - h * i * step / top
        out.append(f'<line x1="{x0}" y1="{py:.1f}" x2="{x0 + w}" y2="{py:.1f}" stroke="#eee"/>')
        out.append(f'<text x="{x0 - 6}" y="{py + 4:.1f}" text-anchor="end">{_num(i * step, decimals)}</text>')
    points = [(x0 + x * w, y0 + h - h * v / top, v) for x, v in zip(xs, values) if v is not None]
    path = " ".join(f"{px:.1f},{py:.1f}" for px, py, _ in points)
    out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
    for px, py, v in points:
        out.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="4" fill="{color}"/>')
        out.append(f'<text x="{px:.1f}" y="{py - 8:.1f}" text-anchor="middle">{_num(v)}</text>')
    return out


def svg_plot(levels: list[dict], title: str) -> str:
    """Output tok/s and TTFT p50 over concurrency, two panels, concurrency on a log2 axis."""
    conc = [r["concurrency"] for r in levels]
    lo, hi = math.log2(min(conc)), math.log2(max(conc))
    # 6% of the width kept free at both ends, so the end points' labels clear the y axis' labels
    xs = [0.06 + 0.88 * (math.log2(c) - lo) / (hi - lo) if hi > lo else 0.5 for c in conc]
    labels = [str(c) for c in conc]
    width, left, panel_h = 760, 90, 220
    parts = [f'<text x="{width / 2}" y="24" text-anchor="middle" font-size="15">{escape(title)}</text>']
    parts += _panel(xs, labels, [r["output_tok_s"] for r in levels], (left, 70, width - left - 40, panel_h),
                    "output tok/s", "#1f77b4")
    parts += _panel(xs, labels, [r["ttft_ms"]["p50"] for r in levels], (left, 370, width - left - 40, panel_h),
                    "TTFT p50 (ms)", "#d62728")
    parts.append(f'<text x="{width / 2}" y="640" text-anchor="middle">concurrency (requests in flight)</text>')
    body = "\n".join(parts)
    return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="660" font-family="sans-serif" '
            f'font-size="12">\n<rect width="100%" height="100%" fill="white"/>\n{body}\n</svg>\n')


# -- the command ---------------------------------------------------------------------------------------
def _check_outputs(a) -> None:
    """Mistakes that would otherwise surface only after the run (or as every request refused)."""
    if a.temperature < 0:
        raise KilnError(f"--temperature must be >= 0 (0 = greedy), got {a.temperature}")
    if not 0 < a.top_p <= 1:
        raise KilnError(f"--top-p must be in (0, 1] (1 = off), got {a.top_p}")
    if a.requests_file and (a.temperature != 0 or a.top_p != 1):
        raise KilnError("--temperature and --top-p set the random-prompt requests; --requests-file lines set their own")
    if a.json_path:
        check_writable(a.json_path, "--json")
    if a.plot:
        if Path(a.plot).suffix.lower() != ".svg":
            raise KilnError(f"--plot writes an SVG: give a file name ending in .svg, got {a.plot!r}")
        check_writable(a.plot, "--plot")


def _vocab(a, card: dict) -> tuple[int, str]:
    if a.vocab_size:
        return a.vocab_size, "--vocab-size"
    if isinstance(card.get("vocab_size"), int) and card["vocab_size"] > 0:
        return card["vocab_size"], "server"
    return SAFE_VOCAB, "default"


def _check_length(a, card: dict, gen: int) -> None:
    limit = card.get("max_model_len")
    if a.requests_file is None and isinstance(limit, int) and a.prompt_length + gen > limit:
        raise KilnError(f"--prompt-length {a.prompt_length} + --gen {gen} exceed the server's max context of "
                        f"{limit} tokens")


class Bench:
    """The run against one endpoint: the warm-up, then the levels."""

    def __init__(self, a, endpoint: Endpoint, card: dict, chat_lines: list[dict] | None, say):
        self.a, self.endpoint, self.model, self.lines, self.say = a, endpoint, card["id"], chat_lines, say
        self.gen = a.gen if a.gen is not None or chat_lines else DEFAULT_GEN
        self.vocab, self.vocab_source = _vocab(a, card)
        self.counts = [a.num_requests or max(4 * c, 8) for c in a.concurrency]
        prompts = [] if chat_lines else random_prompts(1 + sum(self.counts), a.prompt_length, self.vocab, a.seed)
        self.prompts, self.ignore_eos = iter(prompts), chat_lines is None
        self.sent = 0               # random-prompt requests planned so far (a sampled one's seed follows it)

    def send(self, req: Planned) -> Result:
        return send(self.endpoint, req, self.a.timeout)

    def plans(self, n: int) -> list[Planned]:
        """The next n requests: fresh random prompts, or the file's lines from its first (every level
        sends the same chat requests)."""
        if self.lines is None:
            return [completion_request(self.model, next(self.prompts), self.gen, self.ignore_eos, self._sampling())
                    for _ in range(n)]
        return [chat_request(self.model, self.lines[i % len(self.lines)], self.gen) for i in range(n)]

    def _sampling(self) -> dict | None:
        """The next random-prompt request's sampling fields: None when greedy (--temperature 0)."""
        self.sent += 1
        if self.a.temperature == 0:
            return None
        out = {"temperature": self.a.temperature, "seed": self.a.seed + self.sent}
        if self.a.top_p != 1.0:
            out["top_p"] = self.a.top_p
        return out

    def warm_up(self) -> None:
        """One unmeasured request (first-request costs stay out of the numbers); it also finds out
        whether the server takes ignore_eos (kiln refuses fields it does not know)."""
        (req,) = self.plans(1)
        res = self.send(req)
        if not res.ok and res.status == 400 and "ignore_eos" in (res.error or ""):
            self.ignore_eos = False
            req.body.pop("ignore_eos")
            self.say("the server does not take ignore_eos: a request may end before --gen tokens")
            res = self.send(req)
        if not res.ok:
            raise KilnError(f"the warm-up request to {self.endpoint.url}{req.path} failed: {res.error}")

    def run(self) -> list[dict]:
        levels = []
        for c, n in zip(self.a.concurrency, self.counts):
            self.say(f"concurrency {c}: {n} requests")
            before = server_counters(self.endpoint)
            results, duration = run_level(self.send, self.plans(n), c)
            level = summarise(c, results, duration)
            after = server_counters(self.endpoint)
            # what the server counted over the level (prefix-cached tokens, prefill graph replays)
            level["server_counters"] = {k: v - before.get(k, 0) for k, v in after.items()} or None
            self.say(f"concurrency {c}: {level['completed']}/{n} completed in {duration:.2f} s, "
                     f"{_num(level['output_tok_s'])} output tok/s" + _trouble(level))
            levels.append(level)
        self._notes(levels)
        return levels

    def _notes(self, levels: list[dict]) -> None:
        if any(r["completed"] and r["ttft_ms"]["p50"] is None for r in levels):
            self.say("the server streamed no output chunks (kiln streams no text for a model without a tokenizer): "
                     "TTFT and ITL are not measured")
        short = [r["concurrency"] for r in levels if r["output_tokens"] < r["completed"] * self.gen]
        if short and self.lines is None:
            self.say(f"at concurrency {', '.join(map(str, short))} some requests ended before --gen {self.gen} tokens")


def _trouble(level: dict) -> str:
    if not level["errors"]:
        return ""
    first = next(iter(level["errors"]))
    return f"; {level['failed']} failed, {level['rejected']} rejected (e.g. {first})"


def _report(a, bench: Bench, card: dict, server: StartedServer | None, levels: list[dict]) -> dict:
    # The environment is read after the run: on a GPU it opens a CUDA context, which should not sit
    # beside the server while it is measured. For a URL target the server's machine is unknown here.
    env = environment(pick_device(a.device)) if server else None
    return {
        "target": a.target, "url": bench.endpoint.url, "model": bench.model, "max_model_len": card.get("max_model_len"),
        "server_command": shlex.join(["kiln", *server.command[3:]]) if server else None,
        "environment": env, "client_host": platform.node(), "date": now_iso(), "command": command_line(),
        "settings": {"prompt_length": None if bench.lines else a.prompt_length, "gen": bench.gen,
                     "requests_file": a.requests_file, "num_requests": bench.counts, "seed": a.seed,
                     "vocab": None if bench.lines else bench.vocab,
                     "vocab_source": None if bench.lines else bench.vocab_source, "ignore_eos": bench.ignore_eos,
                     "temperature": None if bench.lines else a.temperature,
                     "top_p": None if bench.lines else a.top_p, "timeout_s": a.timeout, "warmup_requests": 1},
        "results": levels,
    }


def _write(a, report: dict, say) -> None:
    if a.json_path:
        data = json.dumps(report, indent=2).encode() + b"\n"
        write_atomic(a.json_path, lambda f: f.write(data))
        say(f"wrote {a.json_path}")
    if a.plot:
        settings = report["settings"]
        what = (f"{settings['requests_file']}" if settings["requests_file"]
                else f"prompt {settings['prompt_length']} tok, gen {settings['gen']} tok")
        svg = svg_plot(report["results"], f"kiln bench-serve: {report['model']}, {what}").encode()
        write_atomic(a.plot, lambda f: f.write(svg))
        say(f"wrote {a.plot}")


def main(a) -> int:
    say = (lambda msg: None) if a.quiet else (lambda msg: print(f"[bench-serve] {msg}", file=sys.stderr, flush=True))
    _check_outputs(a)
    flags = serve_flags(a)
    lines = read_requests_file(a.requests_file) if a.requests_file else None
    key = a.api_key if a.api_key is not None else os.environ.get("KILN_API_KEY") or None
    server = None
    try:
        if is_url(a.target):
            endpoint = parse_url(a.target, key)
        else:
            server = StartedServer(a.target, flags, key)
            say(f"starting {shlex.join(['kiln', *server.command[3:]])} (log: {server.log.name})")
            server.wait_ready(a.ready_timeout)
            for line in server.start_lines():
                say(f"server: {line}")
            endpoint = server.endpoint
        card = model_card(endpoint)
        bench = Bench(a, endpoint, card, lines, say)
        _check_length(a, card, bench.gen)
        bench.warm_up()
        levels = bench.run()
    except BaseException as e:
        if server is not None:
            keep = not isinstance(e, KeyboardInterrupt)     # the log may explain a failure, not a Ctrl-C
            server.stop(keep_log=keep)
            if keep:
                say(f"kept kiln serve's log: {server.log.name}")
        raise
    if server is not None:
        started = server.start_lines()
        server.stop(keep_log=False)
    report = _report(a, bench, card, server, levels)
    if server is not None:
        report["server_lines"] = started
    print(table(levels), flush=True)
    _write(a, report, say)
    return 0
