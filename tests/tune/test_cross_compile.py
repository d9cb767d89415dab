"""tools/cross_compile.py compiles kernels for sm_90 with no GPU (in a child process: it replaces
Triton's launch path). Here: the kernels that round a product to 16 bits before an add, whose PTX
must hold no 16-bit FMA (docs/compiler.md, "16-bit FMAs")."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Not imported here: the child process imports Triton, without TRITON_INTERPRET, to compile for a GPU.
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs triton")

ROOT = Path(__file__).resolve().parents[2]


def cross_compile(model: str, ops: str, tmp_path) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env |= {"TRITON_CACHE_DIR": str(tmp_path / "triton"), "KILN_CACHE_DIR": str(tmp_path / "kiln"),
            "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, str(ROOT / "tools" / "cross_compile.py"), model, "--ops", ops],
                          capture_output=True, text=True, env=env, timeout=600)


def test_rounding_kernels_have_no_16bit_fma(tmp_path):
    """qk_rope, the MoE router, shared-expert gate and gated combine, and the greedy pick at the
    35B-A3B's shapes (only its config is read): every candidate builds, none contracts a rounded
    product into an FMA."""
    out = cross_compile("synth:qwen3.5-35b-a3b", "qk_rope,router,shared_gate,gated_combine,greedy", tmp_path)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    summary = out.stdout.strip().splitlines()[-1]
    assert " 0 failed" in summary and "16-bit FMA" not in out.stdout, out.stdout[-2000:]
    assert int(summary.split(":")[1].split()[0]) >= 5, summary     # candidates actually compiled
