"""Qwen3.5 GGUF files as llama.cpp's converter writes them (tests/fixtures/README.md): the reader
gives the HF source's tensors under their HF names, each transformation the converter made undone,
and the model the HF source's config; the dense file gives the source's greedy tokens (the MoE one's
are checked with `kiln pack` in tests/tools/test_pack.py). An MTP head's blocks are left out, and a
file that lacks half an expert stack is one KilnError line.

The sources are drawn again here by kiln's synth from the spec, layers and seed the fixtures were
made from (tools/make_gguf_fixture.py): nothing expected is stored."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

import numpy as np
import pytest
import torch

import kiln
from kiln.errors import KilnError
from kiln.models import model_config
from kiln.weights import open_checkpoint
from kiln.weights.gguf import open_gguf
from kiln.weights.gguf_file import GGUFFile

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
MOE, DENSE = "tiny-qwen3.5-moe.gguf", "tiny-qwen3.5.gguf"
PROMPT = [5, 17, 200, 33, 91, 4, 250, 12, 7, 30, 66, 2]


def fixture_tool():
    spec = importlib.util.spec_from_file_location("make_gguf_fixture", ROOT / "tools" / "make_gguf_fixture.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def source(fixture: str, out: Path) -> Path:
    """The HF folder the fixture was converted from, drawn again."""
    return fixture_tool().write_source(fixture, out)


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen35-sources")
    return {f: source(f, root / f.removesuffix(".gguf")) for f in (MOE, DENSE)}


def greedy(path) -> list[int]:
    llm = kiln.load(str(path), device="cpu", backend="reference", dtype="f32")
    return llm.generate(PROMPT, max_new_tokens=10, temperature=0).token_ids


def raw(path, name: str) -> torch.Tensor:
    """A tensor as the file stores it (the fixtures are F32)."""
    f = GGUFFile(path)
    info = f.tensors[name]
    return torch.from_numpy(np.frombuffer(f.raw(name), dtype=np.float32).reshape(info.shape).copy())


def within_exp_log(got: torch.Tensor, want: torch.Tensor) -> bool:
    """got = log(-(-exp(want))) with the exp in f32 (the converter's): an f32 exp is within one ulp, a
    relative 2^-23, so the log is within 2^-23 absolute, plus the final rounding to f32 (one ulp of
    want). Near A_log = 0 (A near 1) that is several ulps of A_log (measured: 4 at 0.0203)."""
    ulp = torch.nextafter(want.abs(), torch.full_like(want, np.inf)) - want.abs()
    return bool(((got - want).abs() <= 2.0 ** -23 + ulp).all())


# HF tensor -> the GGUF tensor it was converted to, and what the converter did to it (checked below
# to have changed it: the equality after the reader is then an undoing, not a copy)
TRANSFORMED = {
    "model.layers.0.linear_attn.A_log": ("blk.0.ssm_a", "-exp"),
    "model.layers.0.linear_attn.dt_bias": ("blk.0.ssm_dt.bias", "value heads tiled"),
    "model.layers.0.linear_attn.conv1d.weight": ("blk.0.ssm_conv1d.weight", "squeezed, value rows tiled"),
    "model.layers.0.input_layernorm.weight": ("blk.0.attn_norm.weight", "1 + w"),
    "model.layers.2.self_attn.q_norm.weight": ("blk.2.attn_q_norm.weight", "1 + w"),
    "model.norm.weight": ("output_norm.weight", "1 + w"),
    "model.layers.0.linear_attn.in_proj_qkv.weight": ("blk.0.attn_qkv.weight", "value rows tiled"),
    "model.layers.0.linear_attn.in_proj_z.weight": ("blk.0.attn_gate.weight", "value heads tiled"),
    "model.layers.0.linear_attn.in_proj_a.weight": ("blk.0.ssm_alpha.weight", "value heads tiled"),
    "model.layers.1.linear_attn.out_proj.weight": ("blk.1.ssm_out.weight", "value columns tiled"),
    "model.layers.1.mlp.experts.gate_up_proj": ("blk.1.ffn_gate_exps.weight", "split into gate and up"),
}


@pytest.mark.parametrize("fixture", [MOE, DENSE])
def test_the_reader_gives_the_hf_sources_tensors_and_config(sources, fixture):
    hf, gguf = open_checkpoint(sources[fixture]), open_gguf(FIXTURES / fixture)
    assert set(gguf.shapes) == set(hf.shapes) and gguf.shapes == hf.shapes
    for name in hf.shapes:
        want, got = hf.load(name).float(), gguf.load(name)
        # -exp then log cannot give back every float: the reader's log (in f64) lands within exp's error
        assert (within_exp_log(got, want) if name.endswith("A_log") else torch.equal(got, want)), name
    want_cfg, got_cfg = model_config(hf.config)[1], model_config(gguf.config)[1]
    assert got_cfg.rms_norm_eps == float(np.float32(want_cfg.rms_norm_eps))     # GGUF stores it as f32
    assert dataclasses.replace(got_cfg, rms_norm_eps=want_cfg.rms_norm_eps, rope_parameters=None) == \
        dataclasses.replace(want_cfg, rope_parameters=None)


def test_each_transformation_was_made_and_is_undone(sources):
    hf, gguf = open_checkpoint(sources[MOE]), open_gguf(FIXTURES / MOE)
    for name, (stored, what) in TRANSFORMED.items():
        want, kept = hf.load(name).float(), raw(FIXTURES / MOE, stored)
        assert kept.shape != want.shape or not torch.equal(kept, want), f"{name} is stored as it is ({what})"
        got = gguf.load(name)
        assert (within_exp_log(got, want) if name.endswith("A_log") else torch.equal(got, want)), name
    a_log = hf.load("model.layers.0.linear_attn.A_log").float()      # the same values, heads in another order
    assert torch.equal(raw(FIXTURES / MOE, "blk.0.ssm_a").sort().values, (-torch.exp(a_log)).sort().values)
    gate_up = hf.load("model.layers.1.mlp.experts.gate_up_proj").float()
    assert torch.equal(torch.cat([raw(FIXTURES / MOE, f"blk.1.ffn_{p}_exps.weight") for p in ("gate", "up")], 1),
                       gate_up)


def test_the_dense_file_gives_its_sources_greedy_tokens(sources):
    assert greedy(FIXTURES / DENSE) == greedy(sources[DENSE])


# -- files the converter could also have written ------------------------------------------------

_VALUE_TYPES = {"u8": "UINT8", "i8": "INT8", "u16": "UINT16", "i16": "INT16", "u32": "UINT32", "i32": "INT32",
                "f32": "FLOAT32", "bool": "BOOL", "u64": "UINT64", "i64": "INT64", "f64": "FLOAT64", "str": "STRING"}


def rewrite(src: Path, out: Path, meta: dict | None = None, tensors: dict | None = None, drop=(),
            q8_0=()) -> Path:
    """A copy of a GGUF file with metadata changed (key -> (value, type name)), tensors added, some
    dropped and some quantised to Q8_0."""
    gguf = pytest.importorskip("gguf")
    f, meta = GGUFFile(src), meta or {}
    w = gguf.GGUFWriter(str(out), meta.get("general.architecture", (f.metadata["general.architecture"],))[0])
    for key, value in f.metadata.items():
        vtype = f.value_types[key]
        value, vtype = meta.get(key, (value, vtype))
        if key == "general.architecture":
            continue
        if vtype.startswith("array["):
            sub = gguf.GGUFValueType[_VALUE_TYPES[vtype[6:-1]]]
            w.add_key_value(key, list(value), gguf.GGUFValueType.ARRAY, sub_type=sub)
        else:
            w.add_key_value(key, value, gguf.GGUFValueType[_VALUE_TYPES[vtype]])
    for key, (value, vtype) in meta.items():
        if key not in f.metadata:
            w.add_key_value(key, value, gguf.GGUFValueType[_VALUE_TYPES[vtype]])
    for name in f.tensors:
        if name in q8_0:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(name, gguf.quants.quantize(raw(src, name).numpy(), q8), raw_dtype=q8)
        elif name not in drop:
            w.add_tensor(name, raw(src, name).numpy())
    for name, t in (tensors or {}).items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def test_an_mtp_heads_blocks_are_left_out(tmp_path):
    """The converter's default keeps Qwen3.5's multi-token-prediction head as one more block (its
    nextn.* tensors beside an ordinary layer's) and says so in nextn_predict_layers."""
    plain = open_gguf(FIXTURES / MOE)
    f = GGUFFile(FIXTURES / MOE)
    head = {n.replace("blk.2.", "blk.3."): raw(FIXTURES / MOE, n).numpy() for n in f.tensors if n.startswith("blk.2.")}
    hidden = f.metadata["qwen35moe.embedding_length"]
    head.update({"blk.3.nextn.eh_proj.weight": np.zeros((hidden, 2 * hidden), np.float32),
                 **{f"blk.3.nextn.{n}.weight": np.ones(hidden, np.float32) for n in ("enorm", "hnorm",
                                                                                   "shared_head_norm")}})
    path = rewrite(FIXTURES / MOE, tmp_path / "mtp.gguf", tensors=head,
                   meta={"qwen35moe.block_count": (4, "u32"), "qwen35moe.nextn_predict_layers": (1, "u32"),
                         "qwen35moe.attention.recurrent_layers": ([True, True, False, False], "array[bool]")})
    with_head = open_gguf(path)
    assert with_head.shapes == plain.shapes and with_head.config["num_hidden_layers"] == 3
    assert with_head.config["layer_types"] == plain.config["layer_types"]
    assert torch.equal(with_head.load("model.layers.2.mlp.experts.down_proj"),
                       plain.load("model.layers.2.mlp.experts.down_proj"))


def test_kept_quantised_projections_take_hf_row_order(tmp_path):
    """KILN_KEEP_QUANTIZED: a Q8_0 GDN input projection (value heads tiled) kept quantised has its rows
    in HF's order: it dequantises to the tensor the dequantise-at-load path gives."""
    from kiln.ops.quant.reference import dequantize
    from kiln.weights.quantized import QuantizedWeight

    f = GGUFFile(FIXTURES / DENSE)
    names = {n for n, info in f.tensors.items() if len(info.shape) == 2 and info.shape[1] % 32 == 0}
    assert {"blk.0.attn_qkv.weight", "blk.0.attn_gate.weight", "blk.0.ssm_beta.weight"} <= names
    path = rewrite(FIXTURES / DENSE, tmp_path / "q8.gguf", q8_0=names)
    loaded, kept = open_gguf(path, keep=False), open_gguf(path, keep=True)
    for leaf in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"):
        name = f"model.layers.0.linear_attn.{leaf}.weight"
        w = kept.load(name)
        assert isinstance(w, QuantizedWeight) and torch.equal(dequantize(w), loaded.load(name)), name


def test_half_an_expert_stack_is_a_clear_error(tmp_path):
    path = rewrite(FIXTURES / MOE, tmp_path / "half.gguf", drop={"blk.1.ffn_up_exps.weight"})
    with pytest.raises(KilnError, match=r"half.gguf: model.layers.1.mlp.experts.gate_up_proj is made of") as e:
        open_gguf(path)
    assert "\n" not in str(e.value)


def test_an_unknown_architecture_is_still_a_clear_error(tmp_path):
    path = rewrite(FIXTURES / DENSE, tmp_path / "next.gguf", meta={"general.architecture": ("qwen3next", "str")})
    with pytest.raises(KilnError, match=r"GGUF architecture 'qwen3next' is not supported \(supported: .*qwen35moe"):
        open_gguf(path)
