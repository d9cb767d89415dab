"""What keeps `kiln serve` safe: the API key, the bind refusal, the queue limit (429 at once), and
generations that stop when their client goes away. One server on the tiny tool model (its "!!!!"
answer to plain text never ends by itself, so a generation that is not stopped would be noticed),
bound to 0.0.0.0 with its key taken from KILN_API_KEY."""

from __future__ import annotations

import http.client
import json
import subprocess
import sys
import time

import openai
import pytest

from .support import ROOT, Server, assert_openai_error, build_tool_model, request, wait_health

KEY = "s3cret-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
ENDLESS = dict(model="tool-model", prompt="hi", max_tokens=60000, temperature=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = build_tool_model(tmp_path_factory.mktemp("toolmodel"))
    srv = Server(str(path), "--quiet", "--model-id", "tool-model", "--queue-limit", "2",
                 host="0.0.0.0", env={"KILN_API_KEY": KEY}).wait()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def client(server):
    return server.client(api_key=KEY)


def _idle(server):
    health = wait_health(server.port, lambda h: not h["running"] and h["queued"] == 0, timeout=30)
    assert not health["running"] and health["queued"] == 0, health


def test_the_api_key_is_enforced(server, client):
    with pytest.raises(openai.AuthenticationError) as e:
        server.client(api_key="wrong").models.list()
    assert e.value.status_code == 401 and e.value.body["code"] == "invalid_api_key"
    for headers in ({}, {"Authorization": KEY}, {"Authorization": f"Basic {KEY}"}, {"Authorization": f"Bearer {KEY}x"}):
        status, body = request(server.port, "POST", "/v1/completions", {"prompt": "hi", "max_tokens": 1}, headers)
        assert status == 401, headers
        assert_openai_error(body)
    assert request(server.port, "GET", "/health")[0] == 200  # health needs no key
    assert client.models.list().data[0].id == "tool-model"
    out = client.completions.create(model="tool-model", prompt="hi", max_tokens=3, temperature=0)
    assert out.choices[0].text == "!!!"


def test_a_non_loopback_bind_needs_a_key_or_insecure(monkeypatch, capsys):
    import os

    from kiln.cli import main
    from kiln.cli.serve import is_loopback

    env = {k: v for k, v in os.environ.items() if k != "KILN_API_KEY"}
    refused = subprocess.run([sys.executable, "-m", "kiln.cli", "serve", "--host", "0.0.0.0"], capture_output=True,
                             text=True, cwd=ROOT, timeout=120, env=env)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "not a loopback address" in refused.stderr and "--api-key" in refused.stderr
    # With a key (flag or environment) or --insecure it goes on, here to fail on the model instead.
    monkeypatch.delenv("KILN_API_KEY", raising=False)
    for extra, key in ((["--api-key", "k"], None), (["--insecure"], None), ([], "k")):
        if key:
            monkeypatch.setenv("KILN_API_KEY", key)
        assert main(["serve", "no-such-model", "--host", "0.0.0.0", "--port", "0", *extra]) == 2
        assert "no such model" in capsys.readouterr().err, extra
    assert main(["serve", "--host", "0.0.0.0", "--port", "0", "--api-key", " "]) == 2
    assert "must not be empty" in capsys.readouterr().err
    assert is_loopback("127.0.0.1") and is_loopback("localhost") and is_loopback("::1")
    assert not is_loopback("0.0.0.0") and not is_loopback("192.0.2.1")


def test_requests_beyond_the_queue_limit_get_429_at_once(server, client):
    _idle(server)
    endless = client.completions.create(**ENDLESS, stream=True)
    next(iter(endless))
    assert wait_health(server.port, lambda h: h["running"] and h["queued"] == 0)["running"]
    waiting = [client.completions.create(model="tool-model", prompt="hi", max_tokens=3, temperature=0, stream=True)
               for _ in range(2)]
    assert wait_health(server.port, lambda h: h["queued"] == 2)["queued"] == 2
    for call in (lambda: client.completions.create(model="tool-model", prompt="hi", max_tokens=1),
                 lambda: client.chat.completions.create(model="tool-model", messages=[{"role": "user", "content": "x"}],
                                                        stream=True)):
        t0 = time.monotonic()
        with pytest.raises(openai.RateLimitError) as e:
            call()
        assert time.monotonic() - t0 < 5 and e.value.body["code"] == "queue_full"
    endless.close()  # the waiting two now run
    assert ["".join(c.choices[0].text for c in s) for s in waiting] == ["!!!", "!!!"]
    _idle(server)


def test_a_closed_stream_stops_its_generation(server, client):
    _idle(server)
    stream = client.chat.completions.create(model="tool-model", messages=[{"role": "user", "content": "x"}],
                                            max_tokens=60000, temperature=0, stream=True)
    chunks = iter(stream)
    next(chunks)
    next(chunks)  # a content chunk: it is generating
    stream.close()
    _idle(server)


def test_a_client_that_leaves_a_non_streamed_request_stops_its_generation(server):
    _idle(server)
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    conn.request("POST", "/v1/completions", json.dumps(ENDLESS), {**AUTH, "Content-Type": "application/json"})
    assert wait_health(server.port, lambda h: h["running"])["running"]
    conn.close()
    _idle(server)
