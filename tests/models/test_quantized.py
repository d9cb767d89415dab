"""Quantised checkpoints as mlx-lm writes them, kept quantised by kiln: tiny Llama, Qwen3, Qwen3.5,
Qwen3.5-MoE, Gemma 3, Qwen3-Next and Gemma 4 (dense and MoE) models, quantised by mlx-lm itself (4
or 8 bits; the MLP's down projection at 8 bits, or an MoE's own choice: its routers at 8), give
mlx-lm's own greedy tokens on kiln's reference backend, and on its cuda backend under the
interpreter for Llama and Qwen3 (the quantised GEMV and its dispatch serve every family; the others
take minutes there). The reference dequantises exactly as mx.dequantize (tests/ops/test_quant.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

import kiln
from kiln.models import model_config
from kiln.weights import open_checkpoint
from kiln.weights.quantized import QuantizedWeight
from kiln.weights.synth import CONFIGS, Synthesis, write_checkpoint

mx = pytest.importorskip("mlx.core")
mlx_utils = pytest.importorskip("mlx_lm.utils")
mlx_generate = pytest.importorskip("mlx_lm.generate")

PROMPT = [5, 17, 200, 33, 91, 4, 250, 12, 7, 301, 66, 2, 150, 88]
# dims multiples of 64 so mlx-lm quantises every projection; the vocabulary 320 = 5 x 64
SHAPES = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=320)
FAMILIES = {"llama": dict(CONFIGS["tiny-llama"], **SHAPES),
            "qwen3": dict(CONFIGS["tiny-qwen3"], **SHAPES, head_dim=32),
            # mlx-lm knows Qwen3.5 as "qwen3_5" (not "qwen3_5_text"): its sanitize moves conv1d's axes and
            # stores the (1 + w) norms as 1 + w, and kiln's reader undoes both
            "qwen3_5": dict(CONFIGS["tiny-qwen3.5"], **SHAPES, model_type="qwen3_5", num_hidden_layers=3, head_dim=32,
                            layer_types=["linear_attention", "linear_attention", "full_attention"],
                            linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                            linear_value_head_dim=32),
            # mlx-lm stacks the experts as switch_mlp.{gate,up,down}_proj and keeps the router gates at 8 bits
            "qwen3_5_moe": dict(CONFIGS["tiny-qwen3.5-moe"], **SHAPES, model_type="qwen3_5_moe", num_hidden_layers=3,
                                head_dim=32, layer_types=["linear_attention", "linear_attention", "full_attention"],
                                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                                linear_value_head_dim=32, num_experts=4, num_experts_per_tok=2,
                                moe_intermediate_size=64, shared_expert_intermediate_size=128),
            "gemma3": dict(CONFIGS["tiny-gemma3"], **SHAPES, head_dim=32, query_pre_attn_scalar=32,
                           sliding_window_pattern=4,   # mlx-lm places the full layer by this, HF by layer_types
                           layer_types=["sliding_attention"] * 3 + ["full_attention"]),
            # mlx-lm stacks Qwen3-Next's per-expert weights into switch_mlp and applies Qwen3.5's sanitize
            "qwen3_next": dict(CONFIGS["tiny-qwen3-next"], **SHAPES, num_hidden_layers=3, head_dim=32,
                               layer_types=["linear_attention", "linear_attention", "full_attention"],
                               full_attention_interval=3, linear_num_key_heads=2, linear_num_value_heads=4,
                               linear_key_head_dim=32, linear_value_head_dim=32, num_experts=4, num_experts_per_tok=2,
                               moe_intermediate_size=64, shared_expert_intermediate_size=128,
                               rope_theta=10_000_000.0, partial_rotary_factor=0.25),   # mlx-lm reads these keys
            # Gemma 4: sliding and full layers with their own head dims; the MoE one with mlx-lm's
            # experts.switch_glu stacks (HF's fused gate_up_proj split in two) and its routers at 8 bits
            "gemma4": dict(CONFIGS["tiny-gemma4"], **SHAPES, head_dim=32, global_head_dim=64),
            "gemma4_moe": dict(CONFIGS["tiny-gemma4-moe"], **SHAPES, head_dim=32, global_head_dim=64, num_experts=4,
                               top_k_experts=2, moe_intermediate_size=64)}


def hf_folder(config: dict, out: Path) -> Path:
    cls, cfg = model_config(config)
    drawn = Synthesis(config, cls.checkpoint_shapes(cfg), cls.norm_style == "offset", seed=3)
    path = write_checkpoint(drawn, out, "tiny", dtype="f32", quiet=True)
    if config["model_type"] == "qwen3_next":     # HF's Qwen3-Next stores experts one by one, as mlx-lm reads them
        per_expert(path)
    return path


def per_expert(path: Path) -> None:
    """The folder's fused experts (`experts.gate_up_proj` [E, 2I, H], `experts.down_proj`) rewritten as
    HF's per-expert tensors (`experts.{e}.{gate,up,down}_proj.weight`)."""
    files = sorted(path.glob("*.safetensors"))
    tensors = {k: v for f in files for k, v in load_file(f).items()}
    for name in [n for n in tensors if n.endswith("experts.gate_up_proj")]:
        prefix = name[: -len("gate_up_proj")]
        gate_up, down = tensors.pop(name), tensors.pop(prefix + "down_proj")
        for e in range(gate_up.shape[0]):
            gate, up = gate_up[e].chunk(2)
            tensors.update({f"{prefix}{e}.gate_proj.weight": gate.contiguous(),
                            f"{prefix}{e}.up_proj.weight": up.contiguous(), f"{prefix}{e}.down_proj.weight": down[e]})
    for f in files:
        f.unlink()
    (path / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, path / "model.safetensors")


def mlx_quantised(src: Path, out: Path, bits: int, own_predicate: bool = False) -> Path:
    """mlx-lm's own quantisation of the folder (group 64): the MLP's down projections at 8 bits, or
    with `own_predicate` the model's own choice (an MoE's router gates at 8 bits)."""
    model, config = mlx_utils.load_model(src)
    down_at_8 = lambda path, module: {"group_size": 64, "bits": 8} if path.endswith("down_proj") else True  # noqa: E731
    model, config = mlx_utils.quantize_model(model, config, group_size=64, bits=bits,
                                             quant_predicate=None if own_predicate else down_at_8)
    out.mkdir()
    mlx_utils.save_model(out, model)
    mlx_utils.save_config(config, out / "config.json")
    return out


def mlx_greedy(path: Path, n: int) -> list[int]:
    model, _ = mlx_utils.load_model(path)
    argmax = lambda logprobs: mx.argmax(logprobs, axis=-1)  # noqa: E731
    return [int(t) for t, _ in mlx_generate.generate_step(mx.array(PROMPT), model, max_tokens=n, sampler=argmax)]


@pytest.fixture(scope="module", params=[("llama", 4), ("qwen3", 8), ("qwen3_5", 4), ("qwen3_5_moe", 4), ("gemma3", 4),
                                        ("qwen3_next", 4), ("gemma4", 4), ("gemma4_moe", 4)],
                ids=lambda p: f"{p[0]}-{p[1]}bit")
def quantised(request, tmp_path_factory):
    family, bits = request.param
    root = tmp_path_factory.mktemp(f"{family}{bits}")
    moe = family in MOE
    path = mlx_quantised(hf_folder(FAMILIES[family], root / "hf"), root / "mlx", bits, own_predicate=moe)
    return path, mlx_greedy(path, 16), family


MOE = ("qwen3_5_moe", "qwen3_next", "gemma4_moe")
# the same quantised GEMV and dispatch serve every family; KILN_TEST_ALL_FAMILIES=1 runs them all (minutes each)
CUDA_FAMILIES = tuple(FAMILIES) if os.environ.get("KILN_TEST_ALL_FAMILIES") else ("llama", "qwen3")
# (a module at 8 bits, a module at the default bits, a merged weight the model keeps) per family
NAMES = {"moe": ("model.layers.0.mlp.gate.weight", "model.layers.0.mlp.switch_mlp.gate_proj.weight",
                 "model.layers.0.mlp.experts.gate_up_proj"),
         "dense": ("model.layers.0.mlp.down_proj.weight", "model.layers.0.mlp.gate_proj.weight",
                   "model.layers.0.mlp.gate_up_proj.weight"),
         "gemma4_moe": ("model.layers.0.router.proj.weight", "model.layers.0.experts.switch_glu.gate_proj.weight",
                        "model.layers.0.experts.gate_up_proj")}


def names(family: str) -> tuple:
    return NAMES.get(family) or NAMES["moe" if family in MOE else "dense"]


def test_the_reader_keeps_quantised_modules_quantised(quantised):
    path, _, family = quantised
    eight, default, _ = names(family)
    ckpt = open_checkpoint(path)
    assert not any(n.endswith((".scales", ".biases")) for n in ckpt.shapes)
    w8, w = ckpt.load(eight), ckpt.load(default)
    bits = json.loads((path / "config.json").read_text())["quantization"]["bits"]
    assert isinstance(w8, QuantizedWeight) and w8.bits == 8 and w8.shape == ckpt.shapes[eight]
    assert isinstance(w, QuantizedWeight) and w.bits == bits and w.shape == ckpt.shapes[default]


@pytest.mark.parametrize("backend", ["reference", "cuda"])
def test_greedy_tokens_are_mlx_lms(quantised, backend, monkeypatch):
    monkeypatch.setenv("KILN_TUNE_BUDGET_S", "0")    # each op's default variant: tuning is tested elsewhere
    path, want, family = quantised
    if backend == "cuda" and family not in CUDA_FAMILIES:     # CI's time: a minute or more each under the interpreter
        pytest.skip("the cuda backend's quantised path runs on llama and qwen3 in CI (KILN_TEST_ALL_FAMILIES=1: all)")
    llm = kiln.load(str(path), device="cpu", dtype="f32", backend=backend)
    kept = names(family)[2]
    assert isinstance(llm.model.w[kept], QuantizedWeight)   # kept quantised
    n = 16 if backend == "reference" else 8     # the interpreter runs every quantised GEMV: CI's time
    assert llm.generate(PROMPT, max_new_tokens=n, temperature=0).token_ids == want[:n]


def test_a_quantised_checkpoint_without_its_config_is_an_error(quantised, tmp_path):
    path, _, _ = quantised
    broken = tmp_path / "broken"
    broken.mkdir()
    for f in path.iterdir():
        (broken / f.name).write_bytes(f.read_bytes())
    config = json.loads((broken / "config.json").read_text())
    config.pop("quantization"), config.pop("quantization_config", None)
    (broken / "config.json").write_text(json.dumps(config))
    with pytest.raises(kiln.KilnError, match="no `quantization`"):
        open_checkpoint(broken)


def test_a_packed_mlx_folder_keeps_its_quantised_values_and_tokens(quantised, tmp_path):
    """`kiln pack` of the mlx-lm folder: the quantised words, scales and biases copied unchanged (the
    routed experts into their blobs), mlx-lm's greedy tokens on the reference backend."""
    from kiln.cli import main as cli_main

    path, want, family = quantised
    if family not in ("llama", "qwen3_5_moe", "gemma4_moe"):
        pytest.skip("one dense family and both MoE stack layouts (CI's time)")
    out = tmp_path / "packed"
    assert cli_main(["pack", str(path), str(out), "--quiet"]) == 0
    assert (out / "experts").is_dir() == (family in MOE)
    kept = names(family)[2]
    llm = kiln.load(str(out), device="cpu", dtype="f32", backend="reference")
    source = kiln.load(str(path), device="cpu", dtype="f32", backend="reference")
    a, b = llm.model.w[kept], source.model.w[kept]
    assert isinstance(a, QuantizedWeight) and (a.bits, a.group_size) == (b.bits, b.group_size)
    assert all(x.equal(y) for x, y in zip((a.packed, a.scales, a.biases), (b.packed, b.scales, b.biases)))
    assert llm.generate(PROMPT, max_new_tokens=16, temperature=0).token_ids == want
