"""`kiln pack` and `kiln verify` (docs/format.md): tiny models packed from an HF folder (dense and MoE),
a GGUF file and with --bits give their source's greedy tokens; the experts lie in fixed-stride 4 KiB
blobs; a flipped byte is named by `kiln verify` (exit 1) and refused at load; a second pack into the
same OUT refuses while the first holds it. mlx-community folders: tests/models/test_quantized.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import kiln
from kiln.cli import main as cli_main
from kiln.errors import KilnError
from kiln.models import model_config
from kiln.ops.quant.reference import quantize
from kiln.tools.pack import exclusive
from kiln.weights import open_checkpoint
from kiln.weights.quantized import QuantizedWeight
from kiln.weights.synth import CONFIGS, Synthesis, write_checkpoint

PROMPT = [5, 17, 200, 33, 91, 4, 250, 12, 7, 30, 66, 2]


def hf_folder(name: str, out: Path, dtype: str = "bf16", **changes) -> Path:
    config = dict(CONFIGS[name], **changes)
    cls, cfg = model_config(config)
    drawn = Synthesis(config, cls.checkpoint_shapes(cfg), cls.norm_style == "offset", seed=5)
    return write_checkpoint(drawn, out, name, dtype=dtype, quiet=True)


def greedy(path: Path, n: int = 10) -> list[int]:
    llm = kiln.load(str(path), device="cpu", backend="reference", dtype="f32")
    return llm.generate(PROMPT, max_new_tokens=n, temperature=0).token_ids


def pack(src, out: Path, *flags) -> Path:
    assert cli_main(["pack", str(src), str(out), "--quiet", *flags]) == 0
    return out


@pytest.fixture(scope="module")
def moe(tmp_path_factory):
    root = tmp_path_factory.mktemp("pack-moe")
    src = hf_folder("tiny-qwen3.5-moe", root / "hf")
    return src, pack(src, root / "packed")


def test_a_packed_moe_model_gives_its_sources_tokens(moe):
    src, out = moe
    manifest = json.loads((out / "manifest.json").read_text())
    layers = manifest["experts"]["layers"]
    cfg = open_checkpoint(src).config
    assert len(layers) == cfg["num_hidden_layers"] and sorted(p.name for p in (out / "experts").iterdir()) == [
        f"layer_{i:03d}.bin" for i in range(len(layers))]
    for layer in layers:
        assert layer["stride"] % 4096 == 0 and layer["count"] == cfg["num_experts"]
        assert (out / layer["file"]).stat().st_size == layer["count"] * layer["stride"]
    assert not any("experts" in n for n in manifest["tensors"])       # the core holds no routed expert
    assert greedy(out) == greedy(src)
    assert cli_main(["verify", str(out), "--quiet"]) == 0


def test_a_flipped_byte_in_an_expert_file_is_named_and_refused(moe, tmp_path, capsys):
    import shutil

    out = Path(shutil.copytree(moe[1], tmp_path / "copy"))
    victim = out / "experts" / "layer_001.bin"
    data = bytearray(victim.read_bytes())
    data[len(data) // 3] ^= 0x10
    victim.write_bytes(bytes(data))
    capsys.readouterr()
    assert cli_main(["verify", str(out), "--quiet"]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "experts/layer_001.bin" in err[0] and "SHA-256" in err[0]
    with pytest.raises(KilnError, match="layer_001.bin"):
        greedy(out)
    assert cli_main(["run", str(out), "--prompt-ids", "1,2,3", "--max-new", "2", "--device", "cpu", "--quiet"]) == 2


def test_a_dense_model_packs_without_experts_and_with_bits(tmp_path):
    src = hf_folder("tiny-llama", tmp_path / "hf", dtype="f32", hidden_size=128, intermediate_size=256,
                    num_attention_heads=4, num_key_value_heads=2, vocab_size=320)
    plain = pack(src, tmp_path / "plain")
    assert not (plain / "experts").exists() and greedy(plain) == greedy(src)
    q4 = pack(src, tmp_path / "q4", "--bits", "4", "--group-size", "64")
    name = "model.layers.0.mlp.down_proj.weight"
    got, want = open_checkpoint(q4).load(name), quantize(open_checkpoint(src).load(name), 4, 64)
    assert isinstance(got, QuantizedWeight) and (got.bits, got.group_size) == (4, 64)
    assert all(torch.equal(a, b) for a, b in zip((got.packed, got.scales, got.biases),
                                                  (want.packed, want.scales, want.biases)))
    assert len(greedy(q4)) == 10


def test_a_synth_spec_packs_as_it_is_drawn(tmp_path):
    spec = "synth:tiny-qwen3.5-moe:seed=2"
    out = pack(spec, tmp_path / "packed")
    assert json.loads((out / "manifest.json").read_text())["tensors"]["model.embed_tokens.weight"]["parts"][
        "tensor"]["dtype"] == "f32"                 # drawn in f32, written as drawn
    assert greedy(out) == greedy(spec)


def test_a_gguf_file_packs_with_its_tokenizer(tmp_path):
    from tests.tools.test_quantize import FAMILIES, write_gguf
    from tests.tools.test_quantize import hf_folder as quantize_folder

    gguf_path = write_gguf(quantize_folder(FAMILIES["llama"], tmp_path / "hf", "f32"), tmp_path / "t.gguf",
                           FAMILIES["llama"])
    out = pack(gguf_path, tmp_path / "packed")
    assert (out / "tokenizer.json").is_file() and greedy(out) == greedy(gguf_path)
    a = kiln.load(str(out), device="cpu", backend="reference").tokenizer
    b = kiln.load(str(gguf_path), device="cpu", backend="reference").tokenizer
    assert a.encode("abc hello") == b.encode("abc hello")


def test_a_qwen35_moe_gguf_packs_with_its_experts_and_gives_its_sources_tokens(tmp_path):
    """llama.cpp's converter made tests/fixtures/tiny-qwen3.5-moe.gguf from a synth folder (its
    README); that folder, drawn again, the GGUF file and its pack give the same greedy tokens."""
    from tests.weights.test_gguf_qwen35 import FIXTURES, MOE, source

    gguf_path = FIXTURES / MOE
    out = pack(gguf_path, tmp_path / "packed")
    manifest = json.loads((out / "manifest.json").read_text())
    layers = manifest["experts"]["layers"]
    assert manifest["source"]["kind"] == "gguf" and len(layers) == manifest["config"]["num_hidden_layers"] == 3
    assert sorted(p.name for p in (out / "experts").iterdir()) == [f"layer_{i:03d}.bin" for i in range(3)]
    assert all(layer["count"] == 8 and (out / layer["file"]).stat().st_size == 8 * layer["stride"] for layer in layers)
    assert not any("experts" in n for n in manifest["tensors"])       # the core holds no routed expert
    want = greedy(source(MOE, tmp_path / "hf"))
    assert greedy(gguf_path) == want and greedy(out) == want


def test_a_second_pack_into_the_same_out_refuses(tmp_path, capsys):
    src = hf_folder("tiny-llama", tmp_path / "hf")
    out = tmp_path / "packed"
    with exclusive(out):
        assert cli_main(["pack", str(src), str(out), "--quiet"]) == 2
    assert "another kiln pack is writing" in capsys.readouterr().err
    assert not out.exists()
    pack(src, out)
    assert cli_main(["pack", str(src), str(out), "--quiet"]) == 2         # OUT exists: never overwritten


def test_packing_a_2gb_model_keeps_peak_memory_under_600mb(tmp_path):
    """Tensors copied as the source stores them go through in windows (never held whole): a 2 GB
    model's 1 GB embedding included, the pack's peak RSS (VmHWM, from /proc) stays near the process's
    own (torch imported: about 250 MB)."""
    import math
    import subprocess
    import sys

    from kiln.models import synthesis

    drawn = synthesis("qwen3.5-2b", 9)
    assert sum(math.prod(s) for s in drawn.shapes.values()) * 2 > 2e9
    src = write_checkpoint(drawn, tmp_path / "hf", "qwen3.5-2b", dtype="bf16", quiet=True)
    code = ("import sys; from kiln.cli import main; rc = main(['pack', sys.argv[1], sys.argv[2], '--quiet']); "
            "print([l.split()[1] for l in open('/proc/self/status') if l.startswith('VmHWM')][0]); sys.exit(rc)")
    run = subprocess.run([sys.executable, "-c", code, str(src), str(tmp_path / "packed")], capture_output=True,
                         text=True, env=dict(__import__("os").environ, PYTHONPATH=str(Path(__file__).parents[2])))
    assert run.returncode == 0, run.stderr
    peak_kb = int(run.stdout.strip().splitlines()[-1])
    assert peak_kb < 600 * 1024, f"peak RSS {peak_kb / 1024:.0f} MB"
    assert cli_main(["verify", str(tmp_path / "packed"), "--quiet"]) == 0
