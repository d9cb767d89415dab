"""`kiln bench-serve`: its helpers on hand-made input, then real runs against `kiln serve` on the CPU.

The runs use the hand-built model of tests/server/support.py (a tokenizer, so every token is a
streamed text chunk; after a random byte prompt it writes "!" until max_tokens) through a URL, and
synth:tiny-qwen3.5 (no tokenizer: nothing is streamed but the end) started by bench-serve itself.
"""

from __future__ import annotations

import http.client
import json
import random
import xml.etree.ElementTree as ET
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest

from kiln.cli import main
from kiln.tools import bench_serve
from kiln.tools.bench_serve import (
    Bench,
    Result,
    _axis,
    parse_url,
    percentile,
    read_requests_file,
    read_stream,
    server_counters,
    sse_data,
    summarise,
    svg_plot,
)

from ..server.support import Server, build_tool_model, free_port

RESULT_KEYS = {"concurrency", "requests", "completed", "failed", "rejected", "duration_s", "request_throughput",
               "output_tok_s", "total_tok_s", "prompt_tokens", "output_tokens", "cached_tokens", "ttft_ms", "itl_ms",
               "e2e_ms", "errors", "server_counters"}


# -- helpers on hand-made input ------------------------------------------------------------------------
def test_percentile_interpolates_between_ranks_as_numpy():
    assert percentile([], 50) is None
    assert percentile([7.0], 99) == 7.0
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile([1, 2, 3, 4], 0) == 1 and percentile([1, 2, 3, 4], 100) == 4
    assert percentile(list(range(1, 11)), 90) == pytest.approx(9.1)
    xs = [random.Random(3).random() for _ in range(37)]
    for p in (50, 90, 99):
        assert percentile(xs, p) == pytest.approx(float(np.percentile(xs, p)))


def test_sse_data_joins_lines_and_skips_the_rest():
    raw = [b": a comment\n", b"event: message\n", b"data: {\"a\": 1}\r\n", b"\r\n", b"\n",
           b"data:first\n", b"data: second\n", b"id: 7\n", b"\n", b"data: [DONE]\n"]
    assert list(sse_data(raw)) == ['{"a": 1}', "first\nsecond", "[DONE]"]


def clock(*times):
    """A fake perf_counter that returns `times` one after another."""
    it = iter(times)
    return lambda: next(it)


def events(*objs) -> list[bytes]:
    lines = []
    for obj in objs:
        lines += [b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n", b"\n"]
    return lines


def test_read_stream_times_completion_chunks_and_takes_usage():
    text = lambda t, finish=None: {"choices": [{"index": 0, "text": t, "finish_reason": finish}]}  # noqa: E731
    usage = {"choices": [], "usage": {"prompt_tokens": 8, "completion_tokens": 3,
                                      "prompt_tokens_details": {"cached_tokens": 2}}}
    lines = events(text("a"), text("b"), text(""), text("c"), text("", "length"), usage, b"[DONE]")
    res = read_stream(lines, 10.0, clock(10.5, 10.7, 11.0, 11.2))   # three chunks with text, then the end
    assert res.ok and res.error is None
    assert res.ttft == pytest.approx(0.5) and res.itl == pytest.approx([0.2, 0.3])
    assert res.latency == pytest.approx(1.2)
    assert (res.output_tokens, res.prompt_tokens, res.cached_tokens) == (3, 8, 2)


def test_read_stream_counts_chat_chunks_without_usage():
    delta = lambda d, finish=None: {"choices": [{"index": 0, "delta": d, "finish_reason": finish}]}  # noqa: E731
    call = {"tool_calls": [{"index": 0, "function": {"name": "f", "arguments": "{}"}}]}
    lines = events(delta({"role": "assistant", "content": ""}), delta({"content": "Hi"}), delta(call),
                   delta({}, "stop"), b"[DONE]")
    res = read_stream(lines, 0.0, clock(1.0, 1.5, 2.0))
    assert res.ok and res.ttft == 1.0 and res.itl == [0.5]
    assert res.output_tokens == 2 and res.prompt_tokens is None    # one token a chunk: no usage came


@pytest.mark.parametrize("lines,why", [
    (events({"choices": [{"text": "a"}]}, {"error": {"message": "generation failed: boom"}}), "boom"),
    (events({"choices": [{"text": "a"}]}), "ended before data: [DONE]"),
    (events(b"{not json"), "not JSON"),
])
def test_read_stream_failures(lines, why):
    res = read_stream(lines, 0.0, clock(1.0, 2.0, 3.0))
    assert not res.ok and why in res.error


def test_summarise_counts_429_as_rejected_and_keeps_the_errors():
    good = Result(ok=True, status=200, ttft=0.1, itl=[0.01, 0.03], latency=0.2, output_tokens=3, prompt_tokens=8)
    busy = Result(status=429, error="HTTP 429: the server is busy")
    broken = Result(error="ConnectionResetError: reset")
    level = summarise(4, [good, good, busy, broken], 2.0)
    assert set(level) == RESULT_KEYS
    assert (level["completed"], level["failed"], level["rejected"]) == (2, 1, 1)
    assert level["request_throughput"] == 1.0 and level["output_tok_s"] == 3.0 and level["total_tok_s"] == 11.0
    assert level["ttft_ms"] == {"p50": 100.0, "p90": 100.0, "p99": 100.0}
    assert level["itl_ms"]["p50"] == pytest.approx(20.0)
    assert level["errors"] == {"HTTP 429: the server is busy": 1, "ConnectionResetError: reset": 1}


def test_server_counters_reads_kilns_totals_from_metrics():
    """The *_total samples labelled with the model only (not by finish reason), and nothing from a
    server without /metrics."""
    from kiln.server.metrics import ServeStats

    stats = ServeStats(prompt_tokens=40, cached_tokens=32, prefill_graphs=3, prefill_graph_replays=7)
    stats.done("stop")

    class Fake:
        def __init__(self, status, body):
            self.answer = (status, body)

        def get(self, path):
            assert path == "/metrics"
            return self.answer

    got = server_counters(Fake(200, stats.text("m").encode()))
    assert got["kiln_prompt_tokens_total"] == 40 and got["kiln_prefix_cached_tokens_total"] == 32
    assert got["kiln_prefill_graph_replays_total"] == 7 and "kiln_prefill_graphs" not in got
    assert not any("requests_total" in k for k in got)
    assert server_counters(Fake(404, b"kiln_x_total 3\n")) == {}


def test_parse_url_takes_the_base_with_or_without_v1():
    e = parse_url("http://127.0.0.1:8080/v1/", None)
    assert (e.host, e.port, e.prefix, e.url) == ("127.0.0.1", 8080, "", "http://127.0.0.1:8080")
    assert parse_url("https://example.com/api", "k").port == 443
    assert parse_url("https://example.com/api", "k").prefix == "/api"
    for bad in ("http://", "http://host:99999", "http://host:8080/?x=1"):
        with pytest.raises(Exception, match="not a server URL"):
            parse_url(bad, None)


def test_y_axes_have_round_ticks():
    assert _axis(923.3) == (1000, 250, 0) and _axis(29.7) == (30, 10, 0) and _axis(3.8) == (4, 1, 0)
    assert _axis(1) == (1, 0.25, 2) and _axis(0.03) == pytest.approx((0.03, 0.01, 2))


def test_svg_plot_is_xml_with_both_panels():
    levels = [{"concurrency": c, "output_tok_s": tok, "ttft_ms": {"p50": ttft}}
              for c, tok, ttft in ((1, 12.5, 40.0), (8, 80.0, None), (32, 150.25, 900.0))]
    root = ET.fromstring(svg_plot(levels, "a <model> & co"))
    texts = [t.text for t in root.iter("{http://www.w3.org/2000/svg}text")]
    assert "a <model> & co" in texts and "output tok/s" in texts and "TTFT p50 (ms)" in texts
    assert len(list(root.iter("{http://www.w3.org/2000/svg}polyline"))) == 2
    one = ET.fromstring(svg_plot([{"concurrency": 1, "output_tok_s": None, "ttft_ms": {"p50": None}}], "t"))
    assert "not measured" in [t.text for t in one.iter("{http://www.w3.org/2000/svg}text")]


def test_warm_up_drops_ignore_eos_when_the_server_refuses_it(monkeypatch):
    sent = []

    def fake_send(endpoint, req, timeout):
        sent.append(dict(req.body))
        if "ignore_eos" in req.body and refuse:
            return Result(status=400, error="HTTP 400: unsupported field 'ignore_eos'")
        return Result(ok=True, status=200)

    monkeypatch.setattr(bench_serve, "send", fake_send)
    a = Namespace(gen=4, num_requests=2, concurrency=[1], prompt_length=5, vocab_size=None, seed=0, timeout=1,
                  temperature=0.0, top_p=1.0)
    for refuse in (False, True):
        sent.clear()
        bench = Bench(a, parse_url("http://127.0.0.1:1", None), {"id": "m", "vocab_size": 50}, None, lambda m: None)
        bench.warm_up()
        assert bench.ignore_eos is not refuse and bench.vocab == 50 and bench.vocab_source == "server"
        assert [("ignore_eos" in b) for b in sent] == ([True, False] if refuse else [True])
        assert all(b["prompt"] == sent[0]["prompt"] and max(b["prompt"]) < 50 for b in sent)
        plans = bench.plans(2)
        assert [("ignore_eos" in p.body) for p in plans] == [not refuse] * 2
        assert plans[0].body["prompt"] != plans[1].body["prompt"] != sent[0]["prompt"]
        assert all(p.body["temperature"] == 0 and "seed" not in p.body and "top_p" not in p.body for p in plans)


def test_sampled_requests_carry_the_settings_and_a_seed_each():
    """--temperature and --top-p: every random-prompt request sampled, seeded --seed plus its index
    (a rerun sends the same requests)."""
    a = Namespace(gen=4, num_requests=3, concurrency=[1], prompt_length=5, vocab_size=None, seed=7, timeout=1,
                  temperature=0.8, top_p=0.9)
    runs = []
    for _ in range(2):
        bench = Bench(a, parse_url("http://127.0.0.1:1", None), {"id": "m", "vocab_size": 50}, None, lambda m: None)
        runs.append([p.body for p in bench.plans(3)])
    assert runs[0] == runs[1]
    assert [(b["temperature"], b["top_p"], b["seed"]) for b in runs[0]] == [(0.8, 0.9, s) for s in (8, 9, 10)]
    a.top_p = 1.0
    bench = Bench(a, parse_url("http://127.0.0.1:1", None), {"id": "m", "vocab_size": 50}, None, lambda m: None)
    assert "top_p" not in bench.plans(1)[0].body


# -- bad input: one line, exit code 2 ------------------------------------------------------------------
def error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert err and err[-1].startswith("kiln: error: ") and "Traceback" not in "\n".join(err), err
    return err[-1]


@pytest.mark.parametrize("value", ["0", "1,x", "", "-4"])
def test_a_bad_concurrency_list_is_refused(value, capsys):
    assert main(["bench-serve", "http://127.0.0.1:1", "--concurrency", value]) == 2
    assert "--concurrency" in error_line(capsys)


def test_bad_files_and_flags_are_refused_before_anything_runs(tmp_path, capsys):
    url = "http://127.0.0.1:1"
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n\n{"messages": [}\n')
    good = tmp_path / "good.jsonl"
    good.write_text('{"messages": [{"role": "user", "content": "hi"}]}\n')
    cases = [
        (["--requests-file", str(tmp_path / "missing.jsonl")], "missing.jsonl: No such file"),
        (["--requests-file", str(bad)], "bad.jsonl:3: not valid JSON"),
        (["--plot", str(tmp_path / "p.png")], "ending in .svg"),
        (["--json", str(tmp_path / "no" / "r.json")], "does not exist"),
        (["--device", "cpu"], "--device apply to a server bench-serve starts"),
        (["--temperature", "-0.5"], "--temperature must be >= 0"),
        (["--top-p", "0"], "--top-p must be in (0, 1]"),
        (["--top-p", "1.5"], "--top-p must be in (0, 1]"),
        (["--requests-file", str(good), "--temperature", "0.7"], "--requests-file lines set their own"),
    ]
    for extra, message in cases:
        assert main(["bench-serve", url, *extra]) == 2
        assert message in error_line(capsys), extra
    bad.write_text('{"messages": []}\n')
    with pytest.raises(Exception, match=r"bad.jsonl:1: expected a chat request"):
        read_requests_file(str(bad))


def test_an_unreachable_url_is_one_line(capsys):
    assert main(["bench-serve", f"http://127.0.0.1:{free_port()}", "--quiet"]) == 2
    assert "cannot reach http://127.0.0.1:" in error_line(capsys)


def test_a_server_that_dies_before_it_is_ready_names_its_log(capsys):
    assert main(["bench-serve", "no-such-model", "--device", "cpu"]) == 2
    line = error_line(capsys)
    assert "kiln serve exited with code 2 before it was ready" in line and "no such model" in line
    log = line.rsplit("(log: ", 1)[1].rstrip(")")
    assert "no such model" in Path(log).read_text()
    Path(log).unlink()


# -- real runs ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """kiln serve on the hand-built model, for the URL-target runs."""
    model_dir = build_tool_model(tmp_path_factory.mktemp("toolmodel"))
    srv = Server(str(model_dir), "--device", "cpu", "--quiet").wait()
    srv.model_dir = model_dir
    yield srv
    srv.stop()


def table_rows(stdout: str) -> list[list[str]]:
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in stdout.splitlines() if line.startswith("|")]
    return [rows[0], *rows[2:]]     # the header, then the rows (the alignment rule dropped)


def ordered(ms: dict) -> bool:
    return ms["p50"] is not None and 0 <= ms["p50"] <= ms["p90"] <= ms["p99"]


def test_random_prompts_against_a_url(served, tmp_path, capsys):
    out, svg = tmp_path / "r.json", tmp_path / "r.svg"
    assert main(["bench-serve", served.url + "/v1", "--concurrency", "2,1", "--num-requests", "3",
                 "--prompt-length", "8", "--gen", "4", "--json", str(out), "--plot", str(svg),
                 "--vocab-size", "256"]) == 0      # byte tokens: the hand-built model's specials end answers
    std = capsys.readouterr()
    report = json.loads(out.read_text())
    assert report["url"] == served.url and report["model"] == served.model_dir.name
    assert report["target"] == served.url + "/v1" and report["environment"] is None
    assert report["server_command"] is None and report["max_model_len"] > 12
    assert report["settings"]["vocab_source"] == "--vocab-size" and report["settings"]["vocab"] == 256
    # kiln serve refuses ignore_eos today; the hand-built model never ends by itself here either way
    assert report["settings"]["ignore_eos"] is ("does not take ignore_eos" not in std.err)
    assert [r["concurrency"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        assert set(r) == RESULT_KEYS
        assert (r["requests"], r["completed"], r["failed"], r["rejected"], r["errors"]) == (3, 3, 0, 0, {})
        assert r["output_tokens"] == 3 * 4 and r["prompt_tokens"] == 3 * 8
        assert r["request_throughput"] > 0 and r["output_tok_s"] > 0 and r["total_tok_s"] > r["output_tok_s"]
        assert r["output_tok_s"] == pytest.approx(r["output_tokens"] / r["duration_s"], rel=1e-3)
        assert ordered(r["ttft_ms"]) and ordered(r["itl_ms"]) and ordered(r["e2e_ms"])
        assert r["ttft_ms"]["p50"] <= r["e2e_ms"]["p50"]
        grew = r["server_counters"]        # the server's own counts over the level agree with the client's
        assert grew["kiln_generated_tokens_total"] == 12 and grew["kiln_prompt_tokens_total"] == 24, grew
    head, *rows = table_rows(std.out)
    assert head[:3] == ["concurrency", "completed", "failed"] and "TTFT p50 ms" in head and len(rows) == 2
    assert [row[0] for row in rows] == ["1", "2"] and all(float(row[6].replace(",", "")) > 0 for row in rows)
    root = ET.parse(svg).getroot()
    assert root.tag == "{http://www.w3.org/2000/svg}svg"
    assert not list(tmp_path.glob(".*.tmp"))          # written under a temporary name, then renamed


def test_chat_requests_file_against_a_url(served, tmp_path, capsys):
    lines = [{"model": "someone-else", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 50},
             {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]}]
    reqs = tmp_path / "chat.jsonl"
    reqs.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "c.json"
    assert main(["bench-serve", served.url, "--requests-file", str(reqs), "--concurrency", "2", "--num-requests", "3",
                 "--gen", "3", "--json", str(out), "--quiet"]) == 0
    assert capsys.readouterr().err == ""
    report = json.loads(out.read_text())
    (r,) = report["results"]
    assert report["settings"]["requests_file"] == str(reqs) and report["settings"]["prompt_length"] is None
    assert (r["completed"], r["failed"], r["output_tokens"]) == (3, 0, 3 * 3)    # max_tokens overridden by --gen
    assert r["prompt_tokens"] > 0 and ordered(r["ttft_ms"])


def test_a_request_the_server_refuses_fails_at_the_warm_up(served, capsys):
    assert main(["bench-serve", served.url, "--vocab-size", "100000", "--prompt-length", "4", "--gen", "2"]) == 2
    line = error_line(capsys)
    assert "warm-up request" in line and "HTTP 400" in line and "token ids must be" in line


def test_a_model_target_starts_and_stops_its_server(tmp_path, capsys):
    """synth:tiny-qwen3.5 served with one waiting slot: at concurrency 4 some requests get 429,
    counted as rejected; the model has no tokenizer, so its tokens are streamed as token_ids."""
    out = tmp_path / "m.json"
    assert main(["bench-serve", "synth:tiny-qwen3.5", "--device", "cpu", "--queue-limit", "1", "--concurrency", "1,4",
                 "--num-requests", "4", "--prompt-length", "8", "--gen", "32", "--json", str(out)]) == 0
    err = capsys.readouterr().err
    report = json.loads(out.read_text())
    assert "--device cpu --queue-limit 1" in report["server_command"] and report["model"] == "synth:tiny-qwen3.5"
    assert report["environment"]["torch"] and report["environment"]["gpu"]
    assert report["server_lines"] == []         # the cpu backend's tiny serve says nothing at start
    one, four = report["results"]
    assert (one["completed"], one["failed"], one["rejected"]) == (4, 0, 0)
    assert four["failed"] == 0 and four["rejected"] >= 1 and four["completed"] + four["rejected"] == 4
    assert all(e.startswith("HTTP 429") for e in four["errors"])
    assert ordered(one["ttft_ms"]) and ordered(one["itl_ms"]) and one["e2e_ms"]["p50"] > 0
    assert one["output_tokens"] > 0 and "TTFT and ITL are not measured" not in err
    port = report["url"].rsplit(":", 1)[1]
    conn = http.client.HTTPConnection("127.0.0.1", int(port), timeout=2)
    with pytest.raises(OSError):            # the server is gone
        conn.request("GET", "/health")


def test_the_servers_start_lines_are_its_own_kiln_lines(tmp_path):
    """What a run measured depends on the server's plan (slots, pages): its `[kiln]` lines go in the JSON."""
    from kiln.tools.bench_serve import StartedServer
    log = tmp_path / "serve.log"
    log.write_text("INFO: Started server process\n[kiln] batch state: 64 slots of up to 4096 tokens each\n"
                   "[autotune] gemv 1x4096x4096: 9.1 us\n  [kiln] indented: not a start line\n"
                   "[kiln] decode step captured as one CUDA graph: 700 launches per token\n")
    server = StartedServer.__new__(StartedServer)
    server.log = type("Log", (), {"name": str(log)})()
    assert server.start_lines() == ["[kiln] batch state: 64 slots of up to 4096 tokens each",
                                    "[kiln] decode step captured as one CUDA graph: 700 launches per token"]


def test_a_long_server_log_keeps_its_first_and_last_kiln_lines(tmp_path):
    """A run that captures many graphs, then fails: the plan at the start and the fatal line at the
    end both reach the JSON, with a line counting those left out between."""
    from kiln.tools.bench_serve import StartedServer
    log = tmp_path / "serve.log"
    log.write_text("".join(f"[kiln] line {i}\n" for i in range(40)) + "[kiln] fatal: the GPU failed\n")
    server = StartedServer.__new__(StartedServer)
    server.log = type("Log", (), {"name": str(log)})()
    lines = server.start_lines()
    assert lines[:20] == [f"[kiln] line {i}" for i in range(20)]
    assert lines[20] == "... 11 [kiln] lines left out ..."
    assert lines[21:] == [f"[kiln] line {i}" for i in range(31, 40)] + ["[kiln] fatal: the GPU failed"]
    assert server.start_lines(first=50) == [f"[kiln] line {i}" for i in range(40)] + ["[kiln] fatal: the GPU failed"]
