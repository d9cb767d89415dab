"""`kiln quantize`: tiny HF folders (and a tiny GGUF file) quantised by kiln hold mlx-lm's own
quantisation of the same weights tensor for tensor, bit for bit, with the same `quantization` in
config.json (per-module overrides too); mlx-lm and kiln load the output and give mlx-lm's greedy tokens;
user mistakes are one `kiln: error:` line, exit 2, and nothing left behind."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open
from tokenizers import Tokenizer as Backend
from tokenizers import models

import kiln
from kiln.cli import main as cli_main
from kiln.models import model_config
from kiln.tokenizer import Tokenizer, _bytes_to_unicode
from kiln.tools import quantize
from kiln.weights import open_checkpoint
from kiln.weights.gguf_file import GGUFFile
from kiln.weights.synth import CONFIGS, Synthesis, write_checkpoint

mx = pytest.importorskip("mlx.core")
mlx_utils = pytest.importorskip("mlx_lm.utils")
mlx_generate = pytest.importorskip("mlx_lm.generate")

PROMPT = [5, 17, 200, 33, 91, 4, 250, 12, 7, 301, 66, 2, 150, 88]
# dims multiples of 128 so every projection is quantised at any group size; the vocabulary 320 = 5 x 64
SHAPES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=320)
FAMILIES = {"llama": dict(CONFIGS["tiny-llama"], **SHAPES),                       # tied embeddings
            "qwen3": dict(CONFIGS["tiny-qwen3"], **SHAPES, head_dim=32),           # an lm_head of its own
            # mlx-lm's Gemma 3 takes every 6th layer as the global one (sliding_window_pattern)
            "gemma3": dict(CONFIGS["tiny-gemma3"], **SHAPES, num_hidden_layers=6,  # o_proj's 96 inputs: kept
                           layer_types=["sliding_attention"] * 5 + ["full_attention"])}
# name -> (family, stored dtype, kiln quantize flags)
CASES = {
    "llama-4bit-embed8": ("llama", "f32", ["--bits", "4", "--group-size", "64", "--embedding-bits", "8"]),
    "qwen3-3bit-g128-embed6": ("qwen3", "f32", ["--bits", "3", "--group-size", "128", "--embedding-bits", "6"]),
    "gemma3-8bit": ("gemma3", "f32", ["--bits", "8", "--group-size", "64"]),
    "llama-bf16-5bit-g32": ("llama", "bf16", ["--bits", "5", "--group-size", "32", "--embedding-bits", "2"]),
}
TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}<|im_start|>"


def hf_folder(config: dict, out: Path, dtype: str) -> Path:
    cls, cfg = model_config(config)
    drawn = Synthesis(config, cls.checkpoint_shapes(cfg), cls.norm_style == "offset", seed=3)
    return write_checkpoint(drawn, out, "tiny", dtype=dtype, quiet=True)


def flag(flags: list[str], name: str) -> int | None:
    return int(flags[flags.index(name) + 1]) if name in flags else None


def mlx_quantised(src: Path, out: Path, flags: list[str]) -> Path:
    """mlx-lm's own quantisation of the folder at the flags' bits and group size, the embeddings
    (embed_tokens, lm_head) at --embedding-bits through a per-module predicate."""
    bits, group, embedding = flag(flags, "--bits"), flag(flags, "--group-size"), flag(flags, "--embedding-bits")
    model, config = mlx_utils.load_model(src)

    def predicate(path, module):
        return {"group_size": group, "bits": embedding} if embedding and path in quantize.EMBEDDINGS else True

    model, config = mlx_utils.quantize_model(model, config, group_size=group, bits=bits, quant_predicate=predicate)
    out.mkdir()
    mlx_utils.save_model(out, model)
    mlx_utils.save_config(config, out / "config.json")
    return out


def kiln_quantised(src: Path, out: Path, flags: list[str]) -> Path:
    assert cli_main(["quantize", str(src), str(out), "--quiet", *flags]) == 0
    return out


def tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("model*.safetensors")):
        out.update(mx.load(str(f)))
    return out


def mlx_greedy(path: Path, n: int = 16) -> list[int]:
    model, _ = mlx_utils.load_model(path)
    argmax = lambda logprobs: mx.argmax(logprobs, axis=-1)  # noqa: E731
    return [int(t) for t, _ in mlx_generate.generate_step(mx.array(PROMPT), model, max_tokens=n, sampler=argmax)]


def kiln_greedy(path: Path, n: int = 16) -> list[int]:
    llm = kiln.load(str(path), device="cpu", dtype="f32", backend="reference", quiet=True)
    return llm.generate(PROMPT, max_new_tokens=n, temperature=0).token_ids


def add_tokenizer(folder: Path) -> None:
    """Tokenizer files an HF folder carries (kiln quantize copies them)."""
    Backend(models.WordLevel({f"w{i}": i for i in range(320)}, unk_token="w0")).save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "w2", "bos_token": "w1"}))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2]}))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return hf_folder(FAMILIES["llama"], tmp_path_factory.mktemp("tiny") / "hf", "f32")


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    family, dtype, flags = CASES[request.param]
    root = tmp_path_factory.mktemp(request.param)
    src = hf_folder(FAMILIES[family], root / "hf", dtype)
    add_tokenizer(src)
    return dict(name=request.param, src=src, flags=flags, dtype=dtype, ours=kiln_quantised(src, root / "kiln", flags),
                theirs=mlx_quantised(src, root / "mlx", flags))


# -- the output is mlx-lm's --------------------------------------------------------------------------

def same_tensors(ours: Path, theirs: Path) -> dict:
    """Both folders' tensors, every one equal (names, dtypes, shapes, bits); ours."""
    got_all, want_all = tensors(ours), tensors(theirs)
    assert sorted(got_all) == sorted(want_all)
    for name, want in want_all.items():
        got = got_all[name]
        assert (got.dtype, got.shape) == (want.dtype, want.shape), name
        assert mx.array_equal(got, want).item(), name
    return got_all


def test_every_tensor_is_mlx_lms_bit_for_bit(case):
    ours = same_tensors(case["ours"], case["theirs"])
    quantised = {n[: -len(".scales")] for n in ours if n.endswith(".scales")}
    assert "model.layers.0.mlp.down_proj" in quantised and "model.norm" not in quantised
    assert ("model.layers.0.self_attn.o_proj" in quantised) == (case["name"] != "gemma3-8bit")  # 96 inputs


def test_config_and_index_are_mlx_lms(case):
    ours = json.loads((case["ours"] / "config.json").read_text())
    theirs = json.loads((case["theirs"] / "config.json").read_text())
    assert ours["quantization"] == theirs["quantization"] == ours["quantization_config"]
    assert ours == theirs
    index = json.loads((case["ours"] / "model.safetensors.index.json").read_text())
    assert index == json.loads((case["theirs"] / "model.safetensors.index.json").read_text())


def test_tokenizer_files_are_copied(case):
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert (case["ours"] / name).read_bytes() == (case["src"] / name).read_bytes()


def test_greedy_tokens_match_mlx_lm_and_kiln(case):
    want = mlx_greedy(case["theirs"])
    assert mlx_greedy(case["ours"]) == want
    if case["dtype"] == "f32":     # kiln computes in f32; mlx-lm computes a bf16 model in bf16
        assert kiln_greedy(case["ours"]) == want


def test_kiln_reads_each_module_at_its_bits(case):
    ckpt = open_checkpoint(case["ours"])
    flags = case["flags"]
    embed = ckpt.load("model.embed_tokens.weight")
    assert embed.bits == (flag(flags, "--embedding-bits") or flag(flags, "--bits"))
    assert ckpt.load("model.layers.0.mlp.up_proj.weight").bits == flag(flags, "--bits")


# -- shards, routers --------------------------------------------------------------------------------

def test_small_shards_hold_the_same_tensors(tiny, tmp_path):
    single = kiln_quantised(tiny, tmp_path / "single", [])
    out = kiln_quantised(tiny, tmp_path / "sharded", ["--shard-mb", "0.05"])
    files = sorted(p.name for p in out.glob("model*.safetensors"))
    assert len(files) > 3 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(files)
    ours, want = tensors(out), tensors(single)
    assert sorted(ours) == sorted(want) and all(mx.array_equal(ours[n], want[n]).item() for n in want)
    assert mlx_greedy(out, 4) == mlx_greedy(single, 4) == kiln_greedy(out, 4)


def test_router_and_embedding_bits_pick_their_modules():
    a = argparse.Namespace(bits=4, group_size=64, router_bits=8, embedding_bits=6)
    fmt = lambda name, shape=(16, 128): quantize.module_format(name, shape, a)  # noqa: E731
    assert fmt("model.layers.3.mlp.gate.weight") == (8, 64)
    assert fmt("model.layers.3.mlp.shared_expert_gate.weight", (1, 128)) == (8, 64)
    assert fmt("model.layers.3.mlp.gate_proj.weight") == (4, 64)
    assert fmt("model.embed_tokens.weight") == fmt("lm_head.weight") == (6, 64)
    assert fmt("model.layers.3.mlp.gate.weight", (16, 96)) is None          # 96 inputs: no whole groups
    assert fmt("model.norm.weight", (128,)) is None and fmt("model.layers.0.mlp.experts.gate_up_proj") is None


# -- from a GGUF file ------------------------------------------------------------------------------

GGUF_LEAVES = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
               "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate",
               "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down", "post_attention_layernorm": "ffn_norm"}
GGUF_GLOBALS = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}


def gguf_name(name: str) -> str:
    if name in GGUF_GLOBALS:
        return GGUF_GLOBALS[name]
    _, _, layer, rest = name.split(".", 3)
    return f"blk.{layer}.{GGUF_LEAVES[rest.removesuffix('.weight')]}.weight"


def permute_qk(w: torch.Tensor, heads: int) -> torch.Tensor:
    """llama.cpp's Q/K row order (kiln's GGUF reader undoes it)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, w.shape[1]).transpose(1, 2).reshape(w.shape)


def write_gguf(src: Path, path: Path, config: dict) -> Path:
    """The tiny llama folder as llama.cpp would write it in F32, with a byte-level BPE tokenizer of
    320 tokens and a chat template."""
    gguf = pytest.importorskip("gguf")
    pairs = [x + y for x in "abcdefgh" for y in "abcdefgh"][:61]
    tokens = [_bytes_to_unicode()[b] for b in range(256)] + ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + pairs
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(config["num_hidden_layers"])
    w.add_context_length(config["max_position_embeddings"])
    w.add_embedding_length(config["hidden_size"])
    w.add_feed_forward_length(config["intermediate_size"])
    w.add_head_count(config["num_attention_heads"])
    w.add_head_count_kv(config["num_key_value_heads"])
    w.add_layer_norm_rms_eps(config["rms_norm_eps"])
    w.add_rope_freq_base(config["rope_theta"])
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_token_list(tokens)
    w.add_token_types([1] * 256 + [3, 3, 3] + [1] * len(pairs))
    w.add_token_merges([f"{p[0]} {p[1]}" for p in pairs])
    w.add_bos_token_id(256)
    w.add_eos_token_id(258)
    w.add_chat_template(TEMPLATE)
    with safe_open(str(src / "model-00001-of-00001.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_tensor(name)
            if name.endswith("q_proj.weight"):
                t = permute_qk(t, config["num_attention_heads"])
            elif name.endswith("k_proj.weight"):
                t = permute_qk(t, config["num_key_value_heads"])
            w.add_tensor(gguf_name(name), t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_gguf_file_quantises_as_its_hf_folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    src = hf_folder(FAMILIES["llama"], root / "hf", "f32")
    gguf_path = write_gguf(src, root / "tiny.gguf", FAMILIES["llama"])
    flags = CASES["llama-4bit-embed8"][2]
    from_hf = kiln_quantised(src, root / "from-hf", flags)
    out = kiln_quantised(gguf_path, root / "from-gguf", [*flags, "--dtype", "f32"])
    ours, want = tensors(out), tensors(from_hf)
    assert sorted(ours) == sorted(want) and all(mx.array_equal(ours[n], want[n]).item() for n in want)
    config = json.loads((out / "config.json").read_text())
    assert config["quantization"] == json.loads((from_hf / "config.json").read_text())["quantization"]
    assert config["model_type"] == "llama" and config["tie_word_embeddings"] is True

    # the tokenizer comes along as HF files: kiln reads back the one it builds from the GGUF metadata
    llm = kiln.load(str(out), device="cpu", dtype="f32", backend="reference", quiet=True)
    tok = Tokenizer.from_gguf(GGUFFile(gguf_path).metadata)
    for text in ["abcab hgf", "<|im_start|>ab<|im_end|>", " é\n"]:
        assert llm.tokenizer.encode(text) == tok.encode(text), text
    assert llm.tokenizer.chat_template == TEMPLATE and llm.tokenizer.eos_ids == tok.eos_ids
    assert llm.tokenizer.bos_id == tok.bos_id and llm.tokenizer.add_bos == tok.add_bos
    assert llm.generate(PROMPT, max_new_tokens=16, temperature=0).token_ids == mlx_greedy(out) == mlx_greedy(from_hf)


# -- user mistakes -----------------------------------------------------------------------------------

def kiln_cli(*args):
    return subprocess.run([sys.executable, "-m", "kiln.cli", "quantize", *map(str, args)], capture_output=True,
                          text=True, timeout=300)


def no_partials(folder: Path) -> bool:
    return not list(folder.glob(".*partial*"))


@pytest.mark.parametrize("mistake, message", [
    ("missing", "no such model file or folder"),
    ("bits", "argument --bits: invalid choice: 7"),
    ("group", "argument --group-size: invalid choice: 48"),
    ("full", "already exists and is not an empty folder"),
])
def test_a_mistake_is_one_line_and_exit_2(tiny, tmp_path, mistake, message):
    out = tmp_path / "out"
    src, flags = tiny, []
    if mistake == "missing":
        src = tmp_path / "nope"
    elif mistake == "bits":
        flags = ["--bits", "7"]
    elif mistake == "group":
        flags = ["--group-size", "48"]
    else:
        out.mkdir()
        (out / "keep.txt").write_text("mine")
    r = kiln_cli(src, out, *flags)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("kiln: error: ") and message in r.stderr, r.stderr
    assert (sorted(p.name for p in out.iterdir()) == ["keep.txt"]) if mistake == "full" else not out.exists()
    assert no_partials(tmp_path)


def test_an_empty_out_folder_is_filled(tiny, tmp_path):
    (tmp_path / "out").mkdir()
    r = kiln_cli(tiny, tmp_path / "out")
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == str(tmp_path / "out") and (tmp_path / "out" / "model.safetensors").exists()
    summary = [line for line in r.stderr.splitlines() if line.startswith("kiln: quantised")]
    assert len(summary) == 1 and "modules: 22 at 4 bits; 7 tensors kept" in summary[0], r.stderr
    assert no_partials(tmp_path)


def test_a_bundled_models_name_is_a_source(tmp_path):
    """`kiln quantize smollm2-135m OUT` as `kiln run smollm2-135m` takes the name: its GGUF file."""
    r = kiln_cli("smollm2-135m", tmp_path / "out", "--bits", "8")
    assert r.returncode == 0, r.stderr
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert config["quantization"]["bits"] == 8 and config["model_type"] == "llama"


def rewrite_config(src: Path, dst: Path, **changes) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    config = json.loads((src / "config.json").read_text())
    (dst / "config.json").write_text(json.dumps(dict(config, **changes)))
    return dst


@pytest.mark.parametrize("mistake, message", [
    ("family", "does not support model type 'phi3' yet"),
    ("quantised", "is already quantised"),
    ("synth", "reads an HF folder or a GGUF file"),
])
def test_sources_it_cannot_convert(tiny, tmp_path, capsys, mistake, message):
    if mistake == "family":
        src = rewrite_config(tiny, tmp_path / "src", model_type="phi3")
    elif mistake == "quantised":
        src = kiln_quantised(tiny, tmp_path / "src", [])
    else:
        src = "synth:tiny-llama"
    capsys.readouterr()
    assert cli_main(["quantize", str(src), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "out").exists() and no_partials(tmp_path)


def test_a_failure_midway_leaves_nothing(tiny, tmp_path, monkeypatch, capsys):
    real, calls = quantize.quantize, []

    def quantize_or_fail(w, bits, group_size):
        calls.append(w.shape)
        if len(calls) > 3:
            raise RuntimeError("disk full")
        return real(w, bits, group_size)

    monkeypatch.setattr(quantize, "quantize", quantize_or_fail)
    assert cli_main(["quantize", str(tiny), str(tmp_path / "out"), "--quiet"]) == 1
    assert "disk full" in capsys.readouterr().err and len(calls) == 4
    assert not (tmp_path / "out").exists() and no_partials(tmp_path)


# -- Qwen3.5 (dense and MoE), Qwen3-Next, Gemma 4: mlx-lm's sanitize applied as it applies it -------

ROUTED = ["--router-bits", "8"]
SANITIZED = {   # name -> (family in tests/models/test_quantized.py, stored dtype, flags)
    "qwen3_5-f32-4bit-embed8": ("qwen3_5", "f32", ["--bits", "4", "--group-size", "64", "--embedding-bits", "8"]),
    "qwen3_5_moe-bf16-3bit-g32-router8": ("qwen3_5_moe", "bf16", ["--bits", "3", "--group-size", "32", *ROUTED]),
    # no --router-bits: a model with routed experts takes mlx-lm's own choice for its routers (8 bits)
    "qwen3_next-f32-4bit-router8": ("qwen3_next", "f32", ["--bits", "4", "--group-size", "64"]),
    "gemma4-f32-4bit": ("gemma4", "f32", ["--bits", "4", "--group-size", "64"]),
    "gemma4_moe-bf16-3bit-g32-router8": ("gemma4_moe", "bf16", ["--bits", "3", "--group-size", "32", *ROUTED]),
}


def sanitized_source(family: str, out: Path, dtype: str) -> tuple[Path, dict]:
    """An HF folder mlx-lm loads (its configs; Qwen3-Next's experts one by one, as HF stores them)."""
    from tests.models.test_quantized import FAMILIES as READ_FAMILIES
    from tests.models.test_quantized import per_expert

    config = READ_FAMILIES[family]
    src = hf_folder(config, out, dtype)
    if config["model_type"] == "qwen3_next":
        per_expert(src)
    return src, config


def mlx_own(src: Path, out: Path, flags: list[str]) -> Path:
    """mlx-lm's quantisation with the model's own predicate (an MoE's routers at 8 bits, group 64) and
    the embeddings at --embedding-bits."""
    bits, group, embedding = flag(flags, "--bits"), flag(flags, "--group-size"), flag(flags, "--embedding-bits")
    model, config = mlx_utils.load_model(src)
    own = getattr(model, "quant_predicate", None)

    def predicate(path, module):
        if embedding and path.removeprefix("language_model.") in quantize.EMBEDDINGS:
            return {"group_size": group, "bits": embedding}
        return own(path, module) if own else True

    model, config = mlx_utils.quantize_model(model, config, group_size=group, bits=bits, quant_predicate=predicate)
    out.mkdir()
    mlx_utils.save_model(out, model)
    mlx_utils.save_config(config, out / "config.json")
    return out


@pytest.fixture(scope="module", params=list(SANITIZED))
def qwen35(request, tmp_path_factory):
    family, dtype, flags = SANITIZED[request.param]
    root = tmp_path_factory.mktemp(request.param)
    src, config = sanitized_source(family, root / "hf", dtype)
    return dict(name=request.param, src=src, flags=flags, dtype=dtype, ours=kiln_quantised(src, root / "kiln", flags),
                theirs=mlx_own(src, root / "mlx", flags), config=config)


def test_sanitized_families_are_mlx_lms_bit_for_bit(qwen35):
    """Qwen3.5 under language_model.; Qwen3.5 and Qwen3-Next with conv1d as [C, K, 1], the (1 + w)
    norms stored as 1 + w (in the stored dtype: bf16 rounds as mlx-lm's does), their experts (fused,
    or one by one) as switch_mlp's gate, up and down stacks; Gemma 4's as switch_glu stacks, its
    KV-shared layers' K/V projections dropped; the routers at 8 bits, group 64 (mlx-lm's own choice,
    whatever the group): every tensor, the config and the index as mlx-lm writes them."""
    ours = same_tensors(qwen35["ours"], qwen35["theirs"])
    prefix = "language_model." if qwen35["name"].startswith("qwen3_5") else ""
    if not qwen35["name"].startswith("gemma4"):
        assert prefix + "model.layers.0.linear_attn.conv1d.weight" in ours
    if "router8" in qwen35["name"]:
        gemma = qwen35["name"].startswith("gemma4")
        stack = "experts.switch_glu" if gemma else "mlp.switch_mlp"
        assert f"{prefix}model.layers.0.{stack}.up_proj.scales" in ours
        router = ours[f"{prefix}model.layers.0.{'router.proj' if gemma else 'mlp.gate'}.scales"]
        assert router.shape[-1] == 128 // 64        # group 64 at any --group-size
    for f in ("config.json", "model.safetensors.index.json"):
        assert json.loads((qwen35["ours"] / f).read_text()) == json.loads((qwen35["theirs"] / f).read_text())


def test_sanitized_families_give_mlx_lms_greedy_tokens_in_mlx_lm_and_kiln(qwen35):
    want = mlx_greedy(qwen35["theirs"])
    assert mlx_greedy(qwen35["ours"]) == want
    if qwen35["dtype"] == "f32":
        assert kiln_greedy(qwen35["ours"]) == want


def test_a_qwen35_text_folder_is_written_as_mlx_lms_qwen3_5(qwen35, tmp_path):
    """kiln's own synthesized Qwen3.5 folders say qwen3_5_text (HF's text-only model), which mlx-lm
    does not know: the output says qwen3_5 (or qwen3_5_moe) and holds the same tensors."""
    if not qwen35["name"].startswith("qwen3_5"):
        pytest.skip("Qwen3.5 only")
    config = dict(qwen35["config"], model_type=qwen35["config"]["model_type"] + "_text")
    src = hf_folder(config, tmp_path / "hf", qwen35["dtype"])
    out = kiln_quantised(src, tmp_path / "kiln", qwen35["flags"])
    assert json.loads((out / "config.json").read_text())["model_type"] == qwen35["config"]["model_type"]
    ours, want = tensors(out), tensors(qwen35["ours"])
    assert sorted(ours) == sorted(want) and all(mx.array_equal(ours[n], want[n]).item() for n in want)


def test_a_gemma4_config_without_kv_sharing_says_none_to_mlx_lm(tmp_path):
    """HF's Gemma 4 takes a config without num_kv_shared_layers as no shared layers (as kiln does);
    mlx-lm would take 20. The output says 0, so mlx-lm loads it with every layer's K/V projections
    and gives the tokens of the folder that says so itself."""
    src, _ = sanitized_source("gemma4", tmp_path / "hf", "f32")
    flags = SANITIZED["gemma4-f32-4bit"][2]
    want = mlx_greedy(kiln_quantised(src, tmp_path / "with", flags))
    config = json.loads((src / "config.json").read_text())
    assert config.pop("num_kv_shared_layers") == 0
    (src / "config.json").write_text(json.dumps(config))
    out = kiln_quantised(src, tmp_path / "without", flags)
    assert json.loads((out / "config.json").read_text())["num_kv_shared_layers"] == 0
    assert mlx_greedy(out) == want
