"""`kiln serve --max-batch 16`: concurrent requests decoded together give each the answer it gets
alone, mixed sampling settings included; a client that leaves frees its row; a list of prompts in
one request comes back in order."""

from __future__ import annotations

import json
import re
import threading
import time

import pytest

import kiln

from .support import Server, wait_health

MODEL = "smollm2-135m"


@pytest.fixture(scope="module")
def server():
    srv = Server(MODEL, "--quiet", "--max-batch", "16", "--max-context", "512")
    try:
        yield srv.wait()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client()


@pytest.fixture(scope="module")
def alone():
    return kiln.load(MODEL, device="cpu", max_context=512)


def _text(stream) -> str:
    return "".join(c.choices[0].text for c in stream if c.choices)


def _concurrently(fn, n: int) -> list:
    results, errors = [None] * n, []

    def one(i):
        try:
            results[i] = fn(i)
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    return results


def test_sixteen_concurrent_greedy_streams_equal_each_request_alone(client, alone):
    prompts = [f"{i} plus {i} is" for i in range(16)]
    want = [alone.generate(p, max_new_tokens=6).text for p in prompts]
    got = _concurrently(lambda i: _text(client.completions.create(
        model=MODEL, prompt=prompts[i], max_tokens=6, temperature=0, stream=True)), 16)
    assert got == want and len(set(want)) > 1


def test_mixed_sampling_settings_in_one_batch_match_each_request_alone(client, alone):
    settings = [dict(temperature=0), dict(temperature=0.9, seed=1), dict(temperature=1.2, top_p=0.9, seed=2),
                dict(temperature=0.7, seed=3, stop=["."]), dict(temperature=0, max_tokens=3)]
    prompts = ["Once upon a time", "The best food is", "My favourite city", "Water is", "Hello"]
    want = [alone.generate(p, **{"max_new_tokens": 8, **{("max_new_tokens" if k == "max_tokens" else k): v
                                                          for k, v in s.items()}}).text
            for p, s in zip(prompts, settings)]
    got = _concurrently(lambda i: client.completions.create(
        model=MODEL, prompt=prompts[i], **{"max_tokens": 8, **settings[i]}).choices[0].text, len(prompts))
    assert got == want


def test_a_list_of_prompts_comes_back_in_order(client, alone):
    prompts = ["The capital of France is", "1, 2, 3,", "def add(a, b):"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, temperature=0)
    assert [c.index for c in r.choices] == [0, 1, 2]
    assert [c.text for c in r.choices] == [alone.generate(p, max_new_tokens=5).text for p in prompts]


def test_clients_that_leave_free_their_rows_for_the_next_requests(server, client):
    streams = [client.completions.create(model=MODEL, prompt=f"Story number {i}:", max_tokens=400,
                                         temperature=0, stream=True) for i in range(16)]
    for s in streams:
        next(iter(s))
    for s in streams:
        s.close()
    # had the 16 run on, 400 tokens each would keep the batch busy for minutes
    health = wait_health(server.port, lambda h: not h["running"] and h["queued"] == 0, timeout=60)
    assert not health["running"]
    t0 = time.monotonic()
    done = _concurrently(lambda i: client.completions.create(
        model=MODEL, prompt=f"{i} times 2 is", max_tokens=3, temperature=0).choices[0].finish_reason, 16)
    assert done == ["length"] * 16 and time.monotonic() - t0 < 60


@pytest.mark.parametrize("max_batch", ["1", "4"])
def test_a_model_without_a_tokenizer_streams_its_token_ids(max_batch):
    from .support import request
    spec = "synth:tiny-qwen3.5"
    srv = Server(spec, "--quiet", "--device", "cpu", "--max-batch", max_batch)
    try:
        srv.wait()
        (card,) = request(srv.port, "GET", "/v1/models")[1]["data"]
        status, body = request(srv.port, "POST", "/v1/completions", {
            "model": card["id"], "prompt": [5, 9, 2, 7], "max_tokens": 6, "temperature": 0, "stream": True})
    finally:
        srv.stop()
    assert status == 200
    chunks = [json.loads(line[6:]) for line in body.splitlines() if line.startswith("data: {")]
    ids = [i for c in chunks for ch in c["choices"] for i in ch.get("token_ids", [])]
    assert ids == kiln.load(spec, device="cpu").generate([5, 9, 2, 7], max_new_tokens=6).token_ids
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert sum("token_ids" in c["choices"][0] for c in chunks) == 6       # one chunk a token: TTFT and ITL


def _metrics(port: int) -> dict[str, float]:
    """GET /metrics as {name{labels}: value} (HELP and TYPE lines checked, then dropped)."""
    from .support import request
    status, text = request(port, "GET", "/metrics")
    assert status == 200 and isinstance(text, str)
    lines = text.strip().splitlines()
    names = {ln.split()[2] for ln in lines if ln.startswith("# TYPE")}
    assert names >= {"kiln_requests_running", "kiln_requests_waiting", "kiln_generated_tokens_total",
                     "kiln_prefix_hit_rate", "kiln_state_bytes", "kiln_output_tokens_per_second",
                     "kiln_kv_pages_used", "kiln_kv_pages", "kiln_preemptions_total"}
    samples = [ln.rsplit(" ", 1) for ln in lines if not ln.startswith("#")]
    return {re.sub(r'model="[^"]*",?', "", k).replace("{}", ""): float(v) for k, v in samples}


def test_metrics_count_the_batched_requests(server, client):
    before = _metrics(server.port)
    rs = _concurrently(lambda i: client.completions.create(model=MODEL, prompt=f"{i} and {i} make", max_tokens=4,
                                                           temperature=0), 4)
    after = _metrics(server.port)
    made = sum(r.usage.completion_tokens for r in rs)
    assert after["kiln_generated_tokens_total"] - before["kiln_generated_tokens_total"] == made
    assert after["kiln_prompt_tokens_total"] - before["kiln_prompt_tokens_total"] == sum(
        r.usage.prompt_tokens for r in rs)
    ended = lambda m: sum(v for k, v in m.items() if k.startswith("kiln_requests_total"))   # noqa: E731
    assert ended(after) - ended(before) == 4
    assert after["kiln_requests_running"] == 0 and after["kiln_requests_waiting"] == 0
    assert after["kiln_output_tokens_per_second"] > 0


def test_metrics_show_the_prefix_reused_by_the_default_server():
    srv = Server(MODEL, "--quiet", "--max-context", "256")
    try:
        client = srv.wait().client()
        system = "You are a helpful assistant who answers in one short sentence. " * 3
        for q in ("What is 2 + 2?", "What is 3 + 3?"):
            client.completions.create(model=MODEL, prompt=system + q, max_tokens=2, temperature=0)
        m = _metrics(srv.port)
    finally:
        srv.stop()
    assert m["kiln_prefix_cached_tokens_total"] > 20 and 0.2 < m["kiln_prefix_hit_rate"] < 1
    assert m["kiln_state_bytes"] > 0, m
    assert sum(v for k, v in m.items() if k.startswith("kiln_requests_total")) == 2, m


def test_a_shared_system_prompt_is_prefilled_once_in_the_batch(server, client, alone):
    """The batched server keeps the state of prompt prefixes (at multiples of 64 tokens): a request
    sharing one copies it and prefills only the rest, with the answer it gets alone."""
    system = "You are a careful assistant. Answer each question in one short sentence, and never guess. " * 4
    questions = ("What is the capital of France?", "Name a primary colour.", "How many legs has a cat?")
    before = _metrics(server.port)
    rs = [client.completions.create(model=MODEL, prompt=system + q, max_tokens=4, temperature=0) for q in questions]
    after = _metrics(server.port)
    cached = [r.usage.prompt_tokens_details.cached_tokens for r in rs]
    shared = len(alone.tokenizer.encode(system))
    assert shared > 64 and cached[0] == 0 and all(64 <= c <= shared for c in cached[1:]), (cached, shared)
    assert after["kiln_prefix_cached_tokens_total"] - before["kiln_prefix_cached_tokens_total"] == sum(cached)
    assert after["kiln_prefix_hit_rate"] > before["kiln_prefix_hit_rate"]
    assert [r.choices[0].text for r in rs] == [_kept_alone(alone, system + q, 4) for q in questions]


def _kept_alone(llm, prompt: str, n: int) -> str:
    """A prompt's greedy answer in a batch of its own with a prefix cache: its prefill stops where the
    server's does (the kept boundary), so the two sum in one order."""
    from kiln.api import Generation
    from kiln.engine import Batch
    from kiln.sampling import SamplingParams

    ids, params = llm.encode(prompt), SamplingParams(max_new_tokens=n)
    r = Batch(llm.engine, set(llm.eos_ids), prefix_cache=True).add(ids, params)
    return Generation(llm, ids, params, stream=r.stream).complete().text


@pytest.mark.parametrize("interleave", ["", "1"])
def test_sixteen_concurrent_streams_on_a_tiny_hybrid_model_equal_sixteen_sequential_runs(interleave):
    """Also with decode steps run (and their tokens streamed) between the layers of each prefill, as
    on a GPU (KILN_INTERLEAVE=1)."""
    from .support import request
    spec = "synth:tiny-qwen3.5"
    llm = kiln.load(spec, device="cpu")
    prompts = [[(7 * i + j) % 500 + 1 for j in range(3 + i)] for i in range(16)]
    want = [llm.generate(p, max_new_tokens=8).token_ids for p in prompts]
    srv = Server(spec, "--quiet", "--device", "cpu", "--max-batch", "16", env={"KILN_INTERLEAVE": interleave})
    try:
        srv.wait()
        model = request(srv.port, "GET", "/v1/models")[1]["data"][0]["id"]

        def ids(i):
            status, body = request(srv.port, "POST", "/v1/completions", {
                "model": model, "prompt": prompts[i], "max_tokens": 8, "temperature": 0, "stream": True})
            assert status == 200
            chunks = [json.loads(ln[6:]) for ln in body.splitlines() if ln.startswith("data: {")]
            return [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids", [])]

        got = _concurrently(ids, 16)
        peak = _metrics(srv.port)
    finally:
        srv.stop()
    assert got == want and len({tuple(w) for w in want}) > 1
    assert peak["kiln_generated_tokens_total"] == 16 * 8
