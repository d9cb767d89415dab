"""The CLI as a user runs it: a real `kiln` process, stdout for text, stderr for stats and errors."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest

from kiln import hub, load
from kiln.weights.synth import random_prompt


def kiln(*args, stdin: str | None = None, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True,
                          input=stdin, timeout=timeout, env=env)


@pytest.fixture(scope="module", autouse=True)
def installed():
    hub.ensure("smollm2-135m")


def test_run_default_model_says_paris():
    r = kiln("run", "--prompt", "The capital of France is", "--max-new", "12", "--temperature", "0")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    stats = [line for line in r.stderr.splitlines() if "tok/s" in line]
    assert len(stats) == 1 and "prompt 5 tok" in stats[0] and "load" in stats[0]
    assert stats[0].endswith("| finish length"), stats


@pytest.mark.parametrize("args, ending", [
    (["run", "--prompt", "The capital of France is", "--max-new", "50", "--max-context", "20"],
     "generated 15 tok | finish context (max context 20 tokens)"),   # the command
    (["chat", "--messages", "M", "--temperature", "0", "--max-new", "100"], "finish eos"),
    (["run", "--prompt", "The capital of France is", "--max-new", "20", "--stop", "Paris"], "finish stop"),
])
def test_stats_line_says_why_generation_ended(args, ending, tmp_path):
    m = tmp_path / "m.json"
    m.write_text(json.dumps([{"role": "user", "content": "What is the capital of France?"}]))
    r = kiln(*[str(m) if x == "M" else x for x in args])
    assert r.returncode == 0, r.stderr
    stats = [line for line in r.stderr.splitlines() if "tok/s" in line]
    assert len(stats) == 1, r.stderr
    generated, _, finish = ending.rpartition(" | ")
    assert generated in stats[0] and stats[0].endswith(" | " + finish), stats


def test_output_cut_inside_a_character_ends_without_a_replacement_char():
    """The issue's command: the 12th token ends halfway through a katakana character."""
    r = kiln("run", "--prompt", "日本の首都は", "--max-new", "12")
    assert r.returncode == 0 and "generated 12 tok" in r.stderr, r.stderr
    assert r.stdout.strip() and "\ufffd" not in r.stdout, r.stdout


def test_quiet_prints_nothing_on_stderr():
    r = kiln("run", "smollm2-135m", "--prompt", "Hello", "--max-new", "3", "--quiet")
    assert r.returncode == 0 and r.stderr == "" and r.stdout.strip()


def test_chat_messages_file_answers_paris(tmp_path):
    m = tmp_path / "m.json"
    m.write_text(json.dumps([{"role": "user", "content": "What is the capital of France?"}]))
    r = kiln("chat", "smollm2-135m", "--messages", str(m), "--temperature", "0", "--max-new", "40")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_chat_interactive_reads_turns_from_stdin():
    r = kiln("chat", "--temperature", "0", "--max-new", "20", "--quiet",
             stdin="What is the capital of France?\n/exit\n")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout


def test_same_seed_same_text_other_seed_other_text():
    args = ["run", "--prompt", "Once upon a time", "--max-new", "20", "--temperature", "1.0", "--quiet"]
    a, b, c = kiln(*args, "--seed", "1"), kiln(*args, "--seed", "1"), kiln(*args, "--seed", "2")
    assert a.returncode == b.returncode == c.returncode == 0
    assert a.stdout == b.stdout and a.stdout != c.stdout


@pytest.mark.parametrize("args, says", [
    (["run", "no-such-model", "--prompt", "hi"], "no such model"),
    (["run", "--prompt", "hi", "--temperature", "abc"], "temperature"),
    (["run", "--prompt", "hi", "--top-p", "0"], "top_p"),
    (["run", "--prompt", "hi", "--max-new", "0"], "max-new"),
    (["run", "--prompt", ""], "empty prompt"),
    (["run", "--prompt", "hi", "--dtype", "f8"], "dtype"),
    (["run", "--prompt", "hi", "--device", "cuda:7"] if not __import__("torch").cuda.is_available()
     else ["run", "--prompt", "hi", "--device", "nonsense"], "device"),
    (["run", "--prompt", "one two three four five six", "--max-context", "3"], "max context"),
    (["chat", "gemma3-270m", "--messages", "-"], "valid JSON"),
    (["pull", "no-such-model"], "no bundled model"),
    (["frobnicate"], "invalid choice"),
])
def test_user_mistakes_get_one_line_and_exit_2(args, says):
    r = kiln(*args, stdin="not json")
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert "Traceback" not in r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("kiln: error:")]
    assert len(lines) == 1 and says in lines[0], r.stderr


def test_chat_without_template_is_a_clear_error(tmp_path):
    hub.ensure("gemma3-270m")
    m = tmp_path / "m.json"
    m.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    r = kiln("chat", "gemma3-270m", "--messages", str(m), "--quiet")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "chat template" in r.stderr


@pytest.mark.parametrize("content", [b"GGUF" + b"\x03\x00\x00\x00" + b"\xff" * 40, b"garbage bytes"])
def test_corrupt_model_file_is_a_clear_error(tmp_path, content):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(content)
    r = kiln("run", str(bad), "--prompt", "hi")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "kiln: error:" in r.stderr


def test_garbled_gguf_is_a_clear_error(tmp_path):
    """The issue's file: 3,000 bytes overwritten at offset 200 of SmolLM2 (was: internal error, KeyError)."""
    src = hub.ensure("smollm2-135m")
    bad = tmp_path / "garbled.gguf"
    data = bytearray(src.read_bytes())
    data[200:3200] = random.Random(0).randbytes(3000)
    bad.write_bytes(data)
    r = kiln("run", str(bad), "--prompt", "hi")
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kiln: error:") and "not a valid GGUF file (" in lines[0], lines


def test_truncated_gguf_is_a_clear_error(tmp_path):
    src = hub.ensure("smollm2-135m")
    bad = tmp_path / "truncated.gguf"
    with open(src, "rb") as f:
        bad.write_bytes(f.read(5_000_000))
    r = kiln("run", str(bad), "--prompt", "hi")
    assert r.returncode == 2 and "Traceback" not in r.stderr and "kiln: error:" in r.stderr


def test_models_lists_bundled_names():
    r = kiln("models")
    assert r.returncode == 0
    assert "smollm2-135m (default)" in r.stdout and "gemma3-270m" in r.stdout
    assert str(hub.model_path("smollm2-135m")) in r.stdout


# -- token-id prompts on `kiln run` ----------------------------------------------------------------

def test_run_takes_prompt_ids_and_prints_token_ids():
    r = kiln("run", "synth:tiny-llama", "--prompt-ids", "1,2,3", "--max-new", "6", "--device", "cpu", "--quiet")
    assert r.returncode == 0, r.stderr
    expected = load("synth:tiny-llama", device="cpu").generate([1, 2, 3], max_new_tokens=6).token_ids
    assert r.stdout.strip() == ",".join(map(str, expected))


def test_run_random_prompt_is_seeded():
    args = ["run", "synth:tiny-llama", "--random-prompt", "9", "--max-new", "5", "--device", "cpu", "--quiet"]
    a, b = kiln(*args, "--seed", "3"), kiln(*args, "--seed", "4")
    assert a.returncode == b.returncode == 0
    prompt = random_prompt(9, 331, seed=3)
    expected = load("synth:tiny-llama", device="cpu").generate(prompt, max_new_tokens=5).token_ids
    assert a.stdout.strip() == ",".join(map(str, expected)) != b.stdout.strip()


@pytest.mark.parametrize("args, says", [
    (["--prompt", "hello"], "no tokenizer"),
    (["--prompt-ids", "1,x"], "token ids"),
    (["--prompt-ids", "1,331"], "[0, 331)"),
    (["--prompt-ids", "1", "--random-prompt", "3"], "not allowed with"),
    ([], "one of the arguments"),
])
def test_run_prompt_mistakes_exit_2(args, says):
    r = kiln("run", "synth:tiny-llama", "--device", "cpu", *args)
    assert r.returncode == 2 and "Traceback" not in r.stderr and says in r.stderr, r.stderr


# -- checks made before the model loads (issue 25, item 2) --------------------------------------------

def _no_template_messages(tmp_path) -> str:
    m = tmp_path / "m.json"
    m.write_text(json.dumps([{"role": "user", "content": "hi"}]))
    return str(m)


EARLY_MISTAKES = [
    (["run", "--prompt", "Hello", "--temperature", "-1"], "temperature"),
    (["run", "--prompt", "Hello", "--top-p", "1.5"], "top_p"),
    (["run", "--prompt", "Hello", "--min-p", "2"], "min_p"),
    (["run", "--prompt", "Hello", "--repetition-penalty", "0"], "repetition_penalty"),
    (["chat", "--messages", "M", "--temperature", "-1"], "temperature"),
    (["run", "--prompt", "Hello", "--max-context", "1"], "max-context"),
    (["chat", "gemma3-270m", "--messages", "M"], "no chat template"),
]


@pytest.mark.parametrize("args, says", EARLY_MISTAKES)
def test_mistakes_are_refused_before_the_model_loads(args, says, tmp_path):
    """The error is all stderr says: no weight-loading progress and no "kiln: loaded" line came first."""
    hub.ensure("gemma3-270m")
    args = [_no_template_messages(tmp_path) if x == "M" else x for x in args]
    r = kiln(*args)
    assert r.returncode == 2, (r.returncode, r.stderr)
    lines = r.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("kiln: error:") and says in lines[0], lines[-3:]


@pytest.mark.parametrize("args, says", EARLY_MISTAKES)
def test_mistakes_are_refused_without_reading_weights(args, says, tmp_path, monkeypatch, capsys):
    """In process, with the weights' loader replaced by one that fails the test if it is called."""
    import kiln.api
    from kiln.cli import main as kiln_main

    def no_weights(*a, **k):
        raise AssertionError("a mistake must be refused before the weights load")

    hub.ensure("gemma3-270m")
    monkeypatch.setattr(kiln.api, "build_model", no_weights)
    args = [_no_template_messages(tmp_path) if x == "M" else x for x in args]
    assert kiln_main([*args, "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kiln: error:") and says in err, err
