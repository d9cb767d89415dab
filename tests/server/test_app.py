"""`kiln serve` on the bundled SmolLM2 through the official openai client: answers equal `kiln run` and
`kiln chat`, streaming equals non-streaming, stop strings, seeds, concurrency, malformed requests.

One server process serves the whole module; the CLI reference answers are computed by `kiln` child
processes started at the same time.
"""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import sys
import threading
import time

import openai
import pytest

from kiln import hub

from .support import ROOT, Server, assert_openai_error, request, wait_health

MODEL = "smollm2-135m"
PROMPT = "The capital of France is"
Q1, Q2 = "What is the capital of France?", "And of Germany?"
N = 10  # max new tokens of the compared answers


def _kiln(*args: str, stdin: str | None = None) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", *args], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdin_text = stdin
    return proc


def _stats(stderr: str) -> list[tuple[int, int]]:
    return [(int(p), int(g)) for p, g in re.findall(r"prompt (\d+) tok, generated (\d+) tok", stderr)]


@pytest.fixture(scope="module")
def cli_started():
    hub.ensure(MODEL)
    hub.ensure("gemma3-270m")
    return {
        "run": _kiln("run", MODEL, "--prompt", PROMPT, "--max-new", str(N), "--temperature", "0"),
        # Two turns of an interactive chat: the second prompt holds the first answer.
        "chat": _kiln("chat", MODEL, "--max-new", str(N), "--temperature", "0", stdin=f"{Q1}\n{Q2}\n/exit\n"),
    }


@pytest.fixture(scope="module")
def server(cli_started):
    srv = Server(MODEL, "--quiet")
    srv.gemma = Server("gemma3-270m", "--quiet", "--max-context", "64")  # waited for by its own test
    try:
        yield srv.wait()
    finally:
        srv.stop()
        srv.gemma.stop()


@pytest.fixture(scope="module")
def cli(cli_started):
    out = {}
    for name, proc in cli_started.items():
        stdout, stderr = proc.communicate(proc.stdin_text, timeout=600)
        assert proc.returncode == 0, stderr
        out[name] = (stdout, _stats(stderr))
    return out


@pytest.fixture(scope="module")
def client(server):
    return server.client()


def _chat(client, messages, **kw):
    return client.chat.completions.create(model=MODEL, messages=messages, **kw)


def _stream_text(stream) -> tuple[str, str, object]:
    """(text, finish_reason, usage) of a streamed chat or completion; checks the chunk order."""
    text, finish, usage = "", [], None
    for chunk in stream:
        if not chunk.choices:
            usage = chunk.usage
            continue
        c = chunk.choices[0]
        text += (c.delta.content or "") if hasattr(c, "delta") else c.text
        finish.append(c.finish_reason)
    assert finish[-1] is not None and not any(finish[:-1]), finish
    return text, finish[-1], usage


# ------------------------------------------------------------------------------------------------


def test_models(client):
    (card,) = client.models.list().data
    assert card.id == MODEL and card.object == "model"
    assert card.vocab_size == 49152 and card.max_model_len > 0     # kiln's extras: bench-serve's random prompts
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4o")
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert e.value.body["code"] == "model_not_found"


def test_greedy_completion_equals_kiln_run(client, cli):
    stdout, stats = cli["run"]
    out = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=N, temperature=0)
    assert out.choices[0].text + "\n" == stdout
    assert out.object == "text_completion" and out.choices[0].finish_reason == "length"
    assert [(out.usage.prompt_tokens, out.usage.completion_tokens)] == stats
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_greedy_chat_equals_kiln_chat_over_two_turns(client, cli):
    stdout, stats = cli["chat"]
    first = _chat(client, [{"role": "user", "content": Q1}], max_tokens=N, temperature=0)
    a1 = first.choices[0].message.content
    second = _chat(client, [{"role": "user", "content": Q1}, {"role": "assistant", "content": a1},
                            {"role": "user", "content": Q2}], max_tokens=N, temperature=0)
    a2 = second.choices[0].message.content
    assert stdout == f"{a1}\n{a2}\n"
    assert [(r.usage.prompt_tokens, r.usage.completion_tokens) for r in (first, second)] == stats
    assert first.choices[0].message.role == "assistant" and first.object == "chat.completion"
    # The second prompt extends the first: its state was reused, and the answer is still kiln chat's.
    assert second.usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens


def test_streamed_chat_equals_non_streamed(client):
    messages = [{"role": "user", "content": "Name three colours."}]
    whole = _chat(client, messages, max_tokens=12, temperature=0)
    text, finish, usage = _stream_text(_chat(client, messages, max_tokens=12, temperature=0, stream=True,
                                             stream_options={"include_usage": True}))
    assert text == whole.choices[0].message.content and finish == whole.choices[0].finish_reason
    assert (usage.prompt_tokens, usage.completion_tokens) == (whole.usage.prompt_tokens, whole.usage.completion_tokens)
    # Without include_usage there is no usage chunk.
    assert _stream_text(_chat(client, messages, max_tokens=3, temperature=0, stream=True))[2] is None


def test_sse_on_the_wire_is_exact_and_every_chunk_is_utf8(server, client):
    body = {"messages": [{"role": "user", "content": "Écris une phrase sur le Japon et 日本料理."}],
            "max_tokens": 16, "temperature": 0.9, "seed": 3}
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=120)
    conn.request("POST", CHAT, json.dumps({**body, "stream": True, "stream_options": {"include_usage": True}}),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type").startswith("text/event-stream")
    raw = resp.read()
    conn.close()
    assert raw.endswith(b"\n\ndata: [DONE]\n\n")
    events = raw.split(b"\n\n")[:-2]
    assert all(e.startswith(b"data: ") for e in events)
    chunks = [json.loads(e[6:].decode("utf-8", errors="strict")) for e in events]
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == chunks[0]["id"] for c in chunks)
    assert all(c["usage"] is None for c in chunks[:-1]) and chunks[-1]["choices"] == []
    assert chunks[-2]["choices"][0]["delta"] == {} and chunks[-2]["choices"][0]["finish_reason"] == "length"
    pieces = [c["choices"][0]["delta"]["content"] for c in chunks[1:-2]]
    assert all(pieces) and not any("\ufffd" in p for p in pieces)
    whole = _chat(client, body["messages"], max_tokens=16, temperature=0.9, seed=3)
    assert "".join(pieces) == whole.choices[0].message.content
    assert chunks[-1]["usage"]["completion_tokens"] == whole.usage.completion_tokens == 16


def test_streamed_completion_equals_non_streamed(client):
    kw = dict(model=MODEL, prompt="def fibonacci(n):", max_tokens=12, temperature=0)
    whole = client.completions.create(**kw)
    text, finish, usage = _stream_text(client.completions.create(**kw, stream=True,
                                                                 stream_options={"include_usage": True}))
    assert text == whole.choices[0].text and finish == whole.choices[0].finish_reason
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_stop_strings_are_honoured_streamed_or_not(client):
    kw = dict(model=MODEL, prompt="The three primary colours are", max_tokens=16, temperature=0)
    free = client.completions.create(**kw).choices[0].text
    stop = free.split()[2]
    cut = free[:free.index(stop)]
    whole = client.completions.create(**kw, stop=[stop, "never appears"])
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (cut, "stop")
    assert whole.usage.completion_tokens < 16
    assert _stream_text(client.completions.create(**kw, stop=stop, stream=True))[:2] == (cut, "stop")


def test_same_seed_reproduces_and_another_seed_differs(client):
    kw = dict(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=1.0)
    a = client.completions.create(**kw, seed=1).choices[0].text
    b = client.completions.create(**kw, seed=1).choices[0].text
    c = client.completions.create(**kw, seed=2).choices[0].text
    streamed = _stream_text(client.completions.create(**kw, seed=1, stream=True))[0]
    assert a == b == streamed and a != c


def test_tiny_temperatures_are_greedy(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=3)
    greedy = client.completions.create(**kw, temperature=0).choices[0].text
    assert [client.completions.create(**kw, temperature=t).choices[0].text for t in (1e-320, 1e-6)] == [greedy] * 2


def test_token_id_prompts_and_text_parts(client):
    ids = client.completions.create(model=MODEL, prompt=[504, 3575, 282, 4649, 314], max_tokens=4, temperature=0)
    text = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0)
    assert ids.choices[0].text == text.choices[0].text and ids.usage.prompt_tokens == 5
    parts = _chat(client, [{"role": "user", "content": [{"type": "text", "text": Q1}]}], max_tokens=4, temperature=0)
    plain = _chat(client, [{"role": "user", "content": Q1}], max_tokens=4, temperature=0)
    assert parts.choices[0].message.content == plain.choices[0].message.content


def test_a_list_of_prompts_is_answered_in_order_with_its_index(client):
    """OpenAI's batch form of /v1/completions: a list of strings or of token-id lists, one choice each."""
    prompts = [PROMPT, "def fibonacci(n):", "Once upon a time"]
    kw = dict(model=MODEL, max_tokens=6, temperature=0)
    single = [client.completions.create(prompt=p, **kw) for p in prompts]
    batch = client.completions.create(prompt=prompts, **kw)
    assert batch.object == "text_completion" and [c.index for c in batch.choices] == [0, 1, 2]
    assert [(c.text, c.finish_reason) for c in batch.choices] == \
        [(s.choices[0].text, s.choices[0].finish_reason) for s in single]
    for key in ("prompt_tokens", "completion_tokens", "total_tokens"):
        assert getattr(batch.usage, key) == sum(getattr(s.usage, key) for s in single), key

    ids = client.completions.create(prompt=[[504, 3575, 282, 4649, 314], [504, 3575]], **kw)
    assert [c.index for c in ids.choices] == [0, 1] and ids.choices[0].text == single[0].choices[0].text
    assert ids.usage.prompt_tokens == 7

    # Streamed: each chunk's choice carries its prompt's index; the prompts are answered in order.
    chunks = list(client.completions.create(prompt=prompts, stream=True, stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == batch.usage.completion_tokens
    order = [c.index for chunk in chunks[:-1] for c in chunk.choices]
    assert order == sorted(order) and set(order) == {0, 1, 2}
    texts, finish = ["", "", ""], [None, None, None]
    for chunk in chunks[:-1]:
        (c,) = chunk.choices
        assert finish[c.index] is None  # nothing of a prompt follows its finish_reason
        texts[c.index] += c.text
        finish[c.index] = c.finish_reason
    assert [(t, f) for t, f in zip(texts, finish)] == [(c.text, c.finish_reason) for c in batch.choices]


def test_sixteen_concurrent_streams_equal_their_sequential_answers(client):
    prompts = [f"{i} plus {i} is" for i in range(16)]
    kw = dict(model=MODEL, max_tokens=3, temperature=0, stream=True)
    sequential = [_stream_text(client.completions.create(prompt=p, **kw))[0] for p in prompts]
    results: dict[int, str] = {}
    errors: list[BaseException] = []

    def one(i):
        try:
            results[i] = _stream_text(client.completions.create(prompt=prompts[i], **kw))[0]
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert [results.get(i) for i in range(16)] == sequential
    assert len(set(sequential)) > 1


def test_a_closed_stream_stops_its_generation(server, client):
    stream = client.completions.create(model=MODEL, prompt="Write a very long story:", max_tokens=5000,
                                       temperature=0, stream=True)
    next(iter(stream))
    assert wait_health(server.port, lambda h: h["running"])["running"]
    stream.close()
    # Had it run on, 5000 tokens would keep the engine busy for minutes.
    assert not wait_health(server.port, lambda h: not h["running"] and h["queued"] == 0, timeout=30)["running"]
    t0 = time.monotonic()
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=2, temperature=0)
    assert time.monotonic() - t0 < 30


def test_a_model_without_chat_template_cannot_chat(server):
    gemma = server.gemma.wait()
    c = gemma.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": "hi"}])
    assert e.value.body["code"] == "no_chat_template" and "/v1/completions" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:  # tools too: the generic tool format needs a template
        c.chat.completions.create(model="gemma3-270m", messages=[{"role": "user", "content": "hi"}],
                                  tools=[{"type": "function", "function": {"name": "f"}}])
    assert e.value.body["code"] == "no_chat_template"
    out = c.completions.create(model="gemma3-270m", prompt="The capital of France is", max_tokens=3, temperature=0)
    assert out.usage.completion_tokens == 3 and out.choices[0].text


# ------------------------------------------------------------------------------------------------
# Malformed requests: each gets its status and an OpenAI-shaped error; the server keeps serving.

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
USER = [{"role": "user", "content": "hi"}]


def _c(**kw):
    return {"messages": USER, "max_tokens": 2, **kw}


MALFORMED = [
    # (path, body, status, param)
    (CHAT, b"{not json", 400, None),
    (CHAT, b"[1, 2]", 400, None),
    (CHAT, b"", 400, None),
    (CHAT, b'{"messages": "\xff\xfe"}', 400, None),
    (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, None),
    (CHAT, {"max_tokens": 2}, 400, "messages"),
    (CHAT, _c(messages=[]), 400, "messages"),
    (CHAT, _c(messages="hi"), 400, "messages"),
    (CHAT, _c(messages=["hi"]), 400, "messages[0]"),
    (CHAT, _c(messages=[{"role": "wizard", "content": "hi"}]), 400, "messages[0].role"),
    (CHAT, _c(messages=[{"content": "hi"}]), 400, "messages[0].role"),
    (CHAT, _c(messages=[{"role": "user"}]), 400, "messages[0].content"),
    (CHAT, _c(messages=[{"role": "user", "content": 42}]), 400, "messages[0].content"),
    (CHAT, _c(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]), 400,
     "messages[0].content[0]"),
    (CHAT, _c(messages=[{"role": "user", "content": "hi", "mood": "happy"}]), 400, "messages[0].mood"),
    (CHAT, _c(messages=[{"role": "tool", "content": "42"}]), 400, "messages[0].tool_call_id"),
    (CHAT, _c(messages=USER + [{"role": "assistant", "tool_calls": [
        {"id": "a", "type": "function", "function": {"name": "f", "arguments": "{oops"}}]}]), 400,
     "messages[1].tool_calls[0].function.arguments"),
    (CHAT, _c(temperature=-0.5), 400, "temperature"),
    (CHAT, _c(temperature="hot"), 400, "temperature"),
    (CHAT, _c(top_p=0), 400, "top_p"),
    (CHAT, _c(top_p=1.5), 400, "top_p"),
    (CHAT, _c(top_k=-1), 400, "top_k"),
    (CHAT, _c(top_k=2.5), 400, "top_k"),
    (CHAT, _c(min_p=2), 400, "min_p"),
    (CHAT, _c(repetition_penalty=0), 400, "repetition_penalty"),
    (CHAT, _c(repetition_penalty=1e-300, temperature=1), 400, "repetition_penalty"),
    (CHAT, _c(seed=-1), 400, "seed"),
    (CHAT, _c(ignore_eos="yes"), 400, "ignore_eos"),
    (CHAT, _c(seed=True), 400, "seed"),
    (CHAT, _c(max_tokens=0), 400, "max_tokens"),
    (CHAT, _c(max_tokens="ten"), 400, "max_tokens"),
    (CHAT, _c(max_tokens=10**9), 400, "max_tokens"),
    (CHAT, _c(max_tokens=4, max_completion_tokens=5), 400, "max_completion_tokens"),
    (CHAT, _c(stop=7), 400, "stop"),
    (CHAT, _c(stop=["ok", ""]), 400, "stop"),
    (CHAT, _c(n=2), 400, "n"),
    (CHAT, _c(logprobs=True), 400, "logprobs"),
    (CHAT, _c(frequency_penalty=0.5), 400, "frequency_penalty"),
    (CHAT, _c(response_format={"type": "json_object"}), 400, "response_format"),
    (CHAT, _c(guided_json={"type": "object"}), 400, "guided_json"),
    (CHAT, _c(stream="yes"), 400, "stream"),
    (CHAT, _c(stream_options={"include_usage": True}), 400, "stream_options"),
    (CHAT, _c(tools={"f": 1}), 400, "tools"),
    (CHAT, _c(tool_choice="required"), 400, "tool_choice"),
    (CHAT, _c(model=5), 400, "model"),
    (CHAT, _c(model="gpt-4o"), 404, "model"),
    (COMPLETIONS, {"max_tokens": 2}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ""}, 400, "prompt"),
    (COMPLETIONS, {"prompt": []}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ["a", ""]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [[1, 2], "a"]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [[1, 2], []]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [[1, 2], [True]]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [[1, 2], [10**9]]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ["hi", " hi" * 9000]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": ["hi"] * 10_000}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [1, "two"]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": [10**9]}, 400, "prompt"),
    (COMPLETIONS, {"prompt": " hi" * 9000}, 400, "prompt"),
    (COMPLETIONS, {"prompt": "hi", "echo": True}, 400, "echo"),
    (COMPLETIONS, b'{"prompt": "\\ud800 lone surrogate"}', 400, None),
    (COMPLETIONS, b'{"prompt": "hi", "max_tokens": 1e999}', 400, "max_tokens"),
    (COMPLETIONS, b'[' * 100000 + b']' * 100000, 400, None),
    (COMPLETIONS, {"prompt": "hi", "messages": USER}, 400, "messages"),
    ("/v1/embeddings", {"input": "hi"}, 404, None),
    ("/nope", None, 404, None),
]


def test_malformed_requests_get_openai_errors_and_the_server_keeps_serving(server):
    assert len(MALFORMED) >= 25
    for path, body, status, param in MALFORMED:
        got, reply = request(server.port, "POST" if body is not None else "GET", path, body)
        assert got == status, (path, body, got, reply)
        err = assert_openai_error(reply)
        if param is not None:
            assert err["param"] == param, (body, err)
        assert err["type"] == "invalid_request_error"
    got, reply = request(server.port, "GET", CHAT)
    assert got == 405 and assert_openai_error(reply)["code"] == "method_not_allowed"
    got, reply = request(server.port, "POST", CHAT, b"{}", headers={"Content-Length": str(64 * 2**20)})
    assert got == 413 and assert_openai_error(reply)
    assert request(server.port, "GET", "/health")[0] == 200
    got, reply = request(server.port, "POST", CHAT, _c(temperature=0))
    assert got == 200 and reply["choices"][0]["message"]["content"]
