"""bench/serve_pressure.py: a fresh server a run, its outcome read from its log, the batch's trace."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def sp():
    spec = importlib.util.spec_from_file_location("serve_pressure", ROOT / "bench" / "serve_pressure.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_a_log_with_a_device_assert_is_a_fault_with_its_last_lines(sp):
    log = ("[kiln] batch state: 64 slots\n[kiln] prefill of up to 64 tokens at position 448 captured\n"
           "/pytorch/aten/src/ATen/native/cuda/Indexing.cu:1515: indexSelectSmallIndex: block: [0,0,0] "
           "Assertion `srcIndex < srcSelectDimSize` failed.\nTraceback (most recent call last):\n"
           '  File "kiln/engine.py", line 671, in _prefill\ntorch.AcceleratorError: CUDA error: device-side '
           "assert triggered\n[kiln] fatal: the GPU failed (AcceleratorError)\n")
    got = sp.log_outcome(log)
    assert got["fault"] and "srcSelectDimSize" in got["first_fault_line"]
    assert got["last_kiln_lines"][-2:] == ["[kiln] prefill of up to 64 tokens at position 448 captured",
                                           "[kiln] fatal: the GPU failed (AcceleratorError)"]
    assert got["traceback_tail"][0].startswith('  File "kiln/engine.py"')
    assert not sp.log_outcome("[kiln] batch state: 64 slots\nINFO: shutting down\n")["fault"]


def test_env_pairs_must_name_a_value(sp):
    assert sp.parse_env(["KILN_INSIDE=none", "KILN_PDL=0"]) == {"KILN_INSIDE": "none", "KILN_PDL": "0"}
    with pytest.raises(SystemExit, match="NAME=VALUE"):
        sp.parse_env(["KILN_INSIDE"])


def test_one_run_on_a_tiny_model_completes_and_keeps_its_trace(sp, tmp_path):
    out = tmp_path / "pressure.json"
    assert sp.main([str(out), "--model", "synth:tiny-qwen3.5", "--dtype", "f32", "--max-context", "256",
                    "--max-batch", "3", "--prompt-length", "12", "--gen", "4", "--runs", "1", "--trace",
                    "--env", "KILN_INSIDE=none"]) == 0
    report = json.loads(out.read_text())
    run, = report["runs"]
    assert run["ready"] and not run["fault"] and run["env"] == "KILN_INSIDE=none"
    assert (run["completed"], run["failed"]) == (12, 0)       # bench-serve: 4 requests a concurrency slot
    events = [e["e"] for e in run["trace_tail"]]
    assert "prefill" in events and "launch" in events and "step" in events
    assert report["summary"][0]["completed"] == 12 and report["settings"]["gpu_memory"] is None
