"""`kiln pack URL OUT`: a tiny MoE model served by a loopback HF-style server (tests/tools/hub_server.py)
packs to the same bytes as from its folder and gives its tokens; a dropped connection, a 500, a
truncated body are retried; a 200 to a range request is a one-line error that leaves OUT.partial
resumable; a rerun keeps the units already written (fewer ranges fetched); a changed commit refuses
to resume unless --discard-partial; a pack killed mid-range resumes to the same bytes."""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from kiln.cli import main as cli_main

from .hub_server import HubServer
from .test_pack import greedy, hf_folder

ROOT = Path(__file__).resolve().parents[2]
RANGE = 4096        # bytes a range request asks for: every tensor of the tiny model takes several


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return hf_folder("tiny-qwen3.5-moe", tmp_path_factory.mktemp("hub") / "hf")


@pytest.fixture(scope="module")
def reference(folder, tmp_path_factory):
    """The folder packed directly: what every pack from the server must equal byte for byte."""
    out = tmp_path_factory.mktemp("ref") / "packed"
    assert cli_main(["pack", str(folder), str(out), "--quiet"]) == 0
    return out


@pytest.fixture(autouse=True)
def small_ranges(monkeypatch):
    monkeypatch.setenv("KILN_PACK_RANGE_BYTES", str(RANGE))
    monkeypatch.setattr("kiln.weights.remote.BACKOFF_S", 0.01)


def same_bytes(a: Path, b: Path) -> bool:
    files = lambda d: sorted(p.relative_to(d).as_posix() for p in d.rglob("*") if p.is_file())  # noqa: E731
    skip = {"manifest.json", "manifest.sha256"}      # the source's identity differs (a URL, not a path)
    names = [n for n in files(a) if n not in skip]
    return names == [n for n in files(b) if n not in skip] and all(
        (a / n).read_bytes() == (b / n).read_bytes() for n in names)


def pack(url: str, out: Path, *flags) -> int:
    return cli_main(["pack", url, str(out), "--quiet", *flags])


def test_a_url_packs_to_the_folders_bytes_and_tokens(folder, reference, tmp_path):
    with HubServer(folder) as hub:
        assert pack(hub.url, tmp_path / "out") == 0
        manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
        assert manifest["source"]["commit"] == hub.commit and manifest["source"]["kind"] == "http"
        assert manifest["source"]["index_sha256"] == hashlib.sha256((folder / manifest["source"]["index"])
                                                                    .read_bytes()).hexdigest()
    assert same_bytes(tmp_path / "out", reference)
    assert greedy(tmp_path / "out") == greedy(folder)


def test_a_dense_model_packs_from_a_url_as_from_its_folder(tmp_path):
    src = hf_folder("tiny-llama", tmp_path / "hf")
    assert cli_main(["pack", str(src), str(tmp_path / "local"), "--quiet"]) == 0
    with HubServer(src) as hub:
        assert pack(hub.url, tmp_path / "out") == 0
    assert not (tmp_path / "out" / "experts").exists() and same_bytes(tmp_path / "out", tmp_path / "local")
    assert greedy(tmp_path / "out") == greedy(src)


@pytest.mark.parametrize("fault", ["drop", "500", "truncate"])
def test_a_failed_range_is_retried_and_no_wrong_byte_kept(folder, reference, tmp_path, fault):
    with HubServer(folder) as hub:
        hub.faults = [None] * 7 + [fault] + [None] * 5 + [fault]
        assert pack(hub.url, tmp_path / "out") == 0
        assert not hub.faults
    assert same_bytes(tmp_path / "out", reference)


def test_a_200_to_a_range_request_is_an_error_and_the_rerun_resumes(folder, reference, tmp_path, capsys):
    out = tmp_path / "out"
    with HubServer(folder) as hub:
        hub.faults = [None] * 40 + ["200"]
        assert pack(hub.url, out) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "answered 200 to a range request" in err[0]
        assert not out.exists() and (tmp_path / "out.partial" / ".pack-state.json").is_file()
        hub.ranges = 0
        assert pack(hub.url, out) == 0
        resumed = hub.ranges
        hub.ranges = 0
        assert pack(hub.url, tmp_path / "again") == 0
        assert 0 < resumed < hub.ranges      # the resumed pack fetched only what the first had not written
    assert same_bytes(out, reference)


def test_a_changed_commit_refuses_to_resume_unless_discarded(folder, reference, tmp_path, capsys):
    out = tmp_path / "out"
    with HubServer(folder) as hub:
        hub.faults = [None] * 30 + ["500"] * 4        # every attempt of one range fails (one in flight): it stops
        assert pack(hub.url, out, "--jobs", "1") == 2
        assert "failed 4 times" in capsys.readouterr().err
        hub.commit = "0" * 40                            # the repository moved on
        assert pack(hub.url, out) == 2
        assert "holds a pack of another source" in capsys.readouterr().err
        assert pack(hub.url, out, "--discard-partial") == 0
    assert same_bytes(out, reference)


def killed_pack(url: str, out: Path, **env) -> int:
    """`kiln pack URL OUT` in a process of its own; its exit status (-9: SIGKILLed)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), KILN_PACK_RANGE_BYTES=str(RANGE), **env)
    return subprocess.run([sys.executable, "-m", "kiln.cli", "pack", url, str(out), "--quiet"], env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=300).returncode


@pytest.mark.parametrize("when", ["a core tensor", "an expert file", "hashing"])
def test_a_pack_killed_between_units_or_while_hashing_resumes_to_the_same_bytes(folder, reference, tmp_path, when):
    """SIGKILL after the 3rd core tensor, after the first expert layer's file (the units after the core's),
    and in the final check: the rerun keeps what verifies, writes the rest, installs the same bytes."""
    core = len(json.loads((reference / "manifest.json").read_text())["tensors"])
    point = {"a core tensor": "unit:3", "an expert file": f"unit:{core + 1}", "hashing": "hashing"}[when]
    out = tmp_path / "out"
    with HubServer(folder) as hub:
        assert killed_pack(hub.url, out, KILN_PACK_KILL_AT=point) == -signal.SIGKILL
        assert not out.exists() and (tmp_path / "out.partial").is_dir()
        assert pack(hub.url, out) == 0
    assert same_bytes(out, reference)


def test_a_pack_killed_mid_range_resumes_to_the_same_bytes(folder, reference, tmp_path):
    out = tmp_path / "out"
    with HubServer(folder) as hub:
        hub.faults = [None] * 25 + ["hang"]
        env = dict(os.environ, PYTHONPATH=str(ROOT), KILN_PACK_RANGE_BYTES=str(RANGE))
        proc = subprocess.Popen([sys.executable, "-m", "kiln.cli", "pack", hub.url, str(out), "--quiet"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            assert hub.hanging.wait(60), "the pack never reached the hanging range"
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            proc.kill()
            hub.release.set()
        assert not out.exists()
        assert pack(hub.url, out) == 0
    assert same_bytes(out, reference)
    assert cli_main(["verify", str(out), "--quiet"]) == 0
