"""`kiln chat --messages` and the server check chat messages with one validator (kiln/messages.py):
what the server refuses with a 400 the CLI refuses with the same sentence (one line, exit 2, before
the model loads), and what the server accepts the CLI accepts. Run through the `kiln` entry point."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kiln import hub
from kiln.server import protocol

_SCRIPT = Path(sys.executable).parent / "kiln"
KILN = [str(_SCRIPT)] if _SCRIPT.exists() else [shutil.which("kiln") or "kiln"]


def kiln(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*KILN, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module", autouse=True)
def installed():
    hub.ensure("smollm2-135m")


USER = {"role": "user", "content": "hi"}
CALL = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{oops"}}

# Messages the server answers with a 400; each must fail `kiln chat --messages` the same way.
BAD = {
    "unknown role": [{"role": "wizard", "content": "hi"}],
    "no role": [{"content": "hi"}],
    "no content": [{"role": "user"}],
    "number content": [{"role": "user", "content": 42}],
    "image part": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
    "unknown field": [{"role": "user", "content": "hi", "mood": "happy"}],
    "tool without id": [USER, {"role": "tool", "content": "42"}],
    "bad call arguments": [USER, {"role": "assistant", "tool_calls": [CALL]}],
    "not an object": ["hi"],
    "empty": [],
    "not an array": {"role": "user", "content": "hi"},
}


def _server_error(messages) -> str:
    with pytest.raises(protocol.ApiError) as e:
        protocol.parse_chat({"messages": messages})
    assert e.value.status == 400
    return e.value.message


@pytest.mark.parametrize("case", BAD)
def test_messages_the_server_refuses_fail_the_cli_the_same_way(case, tmp_path):
    path = tmp_path / "m.json"
    path.write_text(json.dumps(BAD[case]))
    r = kiln("chat", "smollm2-135m", "--messages", str(path), "--temperature", "0", "--max-new", "4")
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    assert r.stdout == "" and "Traceback" not in r.stderr
    assert "kiln: loaded" not in r.stderr          # refused before the model loads
    lines = r.stderr.strip().splitlines()
    assert lines == [f"kiln: error: {_server_error(BAD[case])}"], r.stderr


def test_messages_the_server_accepts_the_cli_accepts(tmp_path):
    """Text parts and the developer role: the server takes them, so the CLI does (before, it refused
    any content that was not a string), and reads them as the server does: the same greedy answer as
    the plain form (a system message, string content)."""
    question = "What is the capital of France?"
    messages = [{"role": "developer", "content": "You are a geography teacher."},
                {"role": "user", "content": [{"type": "text", "text": question}]}]
    plain = [{"role": "system", "content": "You are a geography teacher."}, {"role": "user", "content": question}]
    protocol.parse_chat({"messages": messages})
    answers = []
    for i, m in enumerate((messages, plain)):
        path = tmp_path / f"m{i}.json"
        path.write_text(json.dumps(m))
        r = kiln("chat", "smollm2-135m", "--messages", str(path), "--temperature", "0", "--max-new", "24", "--quiet")
        assert r.returncode == 0, r.stderr
        answers.append(r.stdout)
    assert answers[0].strip() and answers[0] == answers[1], answers
