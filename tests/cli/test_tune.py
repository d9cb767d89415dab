"""`kiln tune` and `kiln kernels` as a user runs them on CPU: `TRITON_INTERPRET=1 kiln tune
synth:tiny-qwen3.5 --device cpu` prints the [autotune] lines and the [kiln] summary, and a second
run is a cache hit that measures nothing."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import pytest

# Only the subprocesses import Triton (with TRITON_INTERPRET set or not, as each test asks).
if importlib.util.find_spec("triton") is None:
    pytest.skip("needs triton", allow_module_level=True)

SUMMARY = re.compile(r"^\[kiln\] (\d+) kernels compiled in \d+\.\d s, tuned in \d+\.\d s "
                     r"\(cache (hit|miss): (\S+\.json)\)$")


def kiln(*args, cache, interpret=True, timeout=900):
    env = {**os.environ, "KILN_CACHE_DIR": str(cache)}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, "-m", "kiln.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    cache = tmp_path_factory.mktemp("kiln-cache")
    first = kiln("tune", "synth:tiny-qwen3.5", "--device", "cpu", cache=cache)
    second = kiln("tune", "synth:tiny-qwen3.5", "--device", "cpu", cache=cache)
    return cache, first, second


def test_tune_prints_autotune_lines_and_summary_then_hits_the_cache(tuned):
    cache, first, second = tuned
    assert first.returncode == 0, first.stderr
    lines = first.stderr.splitlines()
    for op in ("gemm", "rmsnorm", "rmsnorm_gemm"):
        assert any(re.match(rf"\[autotune\] {op} \S+: .* ms -> \S+$", line) for line in lines), op
    assert any(line.startswith("[autotune] gemm 512x396x96: ") for line in lines)     # GDN in_proj qkv|z|b|a, prefill
    assert any(line.startswith("[autotune] gemm 1x509x96: ") for line in lines)       # LM head, decode
    m = SUMMARY.match(lines[-1])
    assert m and m[2] == "miss" and m[3].startswith(str(cache)) and os.path.exists(m[3])
    assert second.returncode == 0, second.stderr
    assert not [line for line in second.stderr.splitlines() if line.startswith("[autotune]")]
    hit = SUMMARY.match(second.stderr.splitlines()[-1])
    assert hit and hit[2] == "hit" and hit[3] == m[3]
    table = [line for line in second.stdout.splitlines() if line.startswith("| ")]
    assert table[0] == "| op | shape | variant | ms | how |"
    assert {row.split("|")[5].strip() for row in table[1:]} == {"cached"}
    assert any("| gemm | 512x640x96 |" in row for row in table)                     # q_proj (with its gate) | k | v


def test_kernels_dump_writes_each_chosen_kernel_named_by_op_and_shape(tuned, tmp_path):
    cache, _, _ = tuned
    r = kiln("kernels", "synth:tiny-qwen3.5", "--device", "cpu", "--dump", str(tmp_path / "k"), cache=cache)
    assert r.returncode == 0, r.stderr
    assert not [line for line in r.stderr.splitlines() if line.startswith("[autotune]")]   # from the cache
    names = sorted(p.name for p in (tmp_path / "k").iterdir())
    assert any(re.fullmatch(r"gemm_512x396x96_\S+\.py", n) for n in names)
    assert any(re.fullmatch(r"rmsnorm_512x96_offset_\S+\.py", n) for n in names)
    src = next((tmp_path / "k").glob("gemm_512x396x96_*.py")).read_text()
    assert "def gemm_kernel(" in src or "def gemm_tma_kernel(" in src


def test_user_mistakes_are_one_line_errors(tmp_path):
    r = kiln("tune", "synth:tiny-qwen3.5", "--device", "cpu", cache=tmp_path, interpret=False)
    assert r.returncode == 2 and "TRITON_INTERPRET=1" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    r = kiln("tune", "synth:tiny-qwen3.5", "--device", "cpu", "--tune", "gemm=bm7_nope", "--m", "1",
             "--ops", "gemm", cache=tmp_path)
    assert r.returncode == 2 and "no such variant" in r.stderr
    r = kiln("tune", "synth:tiny-qwen3.5", "--device", "cpu", "--tune", "attn=x", cache=tmp_path)
    assert r.returncode == 2 and "unknown op" in r.stderr
    r = kiln("tune", "synth:tiny-qwen3.5", "--device", "cpu", "--ops", "gemm,nope", cache=tmp_path)
    assert r.returncode == 2 and "unknown op" in r.stderr


def test_a_quantised_checkpoint_is_known_before_its_weights_load():
    """`kiln tune` says that a quantised model's GEMV shapes come from its loaded weights (it tunes only
    the config's): a synthesized quantised draw and an mlx-lm style config are quantised, a 16-bit draw
    and a plain config are not."""
    from types import SimpleNamespace

    from kiln.cli.tune import quantised
    from kiln.weights import open_checkpoint

    assert quantised(open_checkpoint("synth:tiny-qwen3.5:bits=4"))
    assert not quantised(open_checkpoint("synth:tiny-qwen3.5"))
    mlx = SimpleNamespace(format="safetensors", config={"quantization": {"bits": 4, "group_size": 64}})
    assert quantised(mlx) and not quantised(SimpleNamespace(format="safetensors", config={"hidden_size": 8}))


def test_tune_by_default_tunes_the_shapes_a_load_tunes(monkeypatch):
    """Without --m, `kiln tune` measures every shape a load would (on a GPU: the 512- and 4,096-row
    prefill chunks, the routed experts' 1,024 and 2,048 rows, decode), so the run after it measures
    nothing; --m still picks the rows. (The CPU backend's chunk is 512: a GPU's is set here.)"""
    from argparse import Namespace

    from kiln.api import resolve_model
    from kiln.backends import cuda
    from kiln.cli.tune import setup
    from kiln.models import model_config
    from kiln.weights import open_checkpoint

    real = cuda.CudaOps.__init__

    def on_a_gpu(self, device="cuda"):
        real(self, device)
        self.prefill_chunk = 4096

    monkeypatch.setattr(cuda.CudaOps, "__init__", on_a_gpu)
    model = "synth:tiny-qwen3.5-moe"
    flags = dict(model=model, device="cpu", dtype="bf16", quiet=True, budget=None, ops=None, retune=False,
                 tune=[])
    _, _, got, _ = setup(Namespace(**flags, m=None))
    cls, cfg = model_config(open_checkpoint(resolve_model(model, quiet=True)).config)
    assert [w.label for w in got] == [w.label for w in cuda.CudaOps("cpu").dense_workloads(cls, cfg)]
    rows = lambda ws, op: {w.shape.rows for w in ws if w.op.name == op}     # noqa: E731
    assert rows(got, "gemm") == {1, 512, 4096} and rows(got, "moe") == {1, 512, 1024, 2048, 4096}
    _, _, only, _ = setup(Namespace(**flags, m=[1]))
    assert rows(only, "gemm") == rows(only, "moe") == {1}
