"""GGUF's block types kept quantised (KILN_KEEP_QUANTIZED=1): Q4_0, Q4_1, Q5_0, Q8_0, Q4_K and Q5_K
map exactly onto MLX affine groups of 32, so dequantising the kept weight gives, bit for bit, the
tensor the dequantise-at-load path gives (llama's permuted Q/K rows included); both bundled models
then give the same greedy tokens both ways."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kiln
from kiln import hub
from kiln.ops.quant.reference import dequantize
from kiln.weights.dequant import AFFINE, Q4_0, Q4_K, Q5_K, affine_parts
from kiln.weights.dequant import dequantize as gguf_dequantize
from kiln.weights.gguf import hf_name, open_gguf
from kiln.weights.gguf_file import GGUFFile
from kiln.weights.quantized import QuantizedWeight


def sample(path, per_type: int = 3) -> list[str]:
    """A few tensors of each kept type, and every Q/K projection of the first layer (not gemma's
    262k-row embedding: minutes of int64 unpacking for one more Q8_0 tensor)."""
    f, seen, out = GGUFFile(path), {}, []
    for name, info in f.tensors.items():
        if info.ggml_type in AFFINE and len(info.shape) == 2 and info.shape[0] * info.shape[1] <= 32 << 20:
            if seen.setdefault(info.ggml_type, 0) < per_type or name.startswith("blk.0.attn_"):
                out.append(name)
            seen[info.ggml_type] += 1
    return out


@pytest.mark.parametrize("name", ["smollm2-135m", "gemma3-270m"])
def test_kept_tensors_dequantise_to_the_loaded_ones_bit_for_bit(name):
    path = hub.ensure(name)
    loaded, kept = open_gguf(path, keep=False), open_gguf(path, keep=True)
    arch = GGUFFile(path).metadata["general.architecture"]
    names = sample(path)
    assert names
    for g in names:
        canon = hf_name(arch, g)
        w = kept.load(canon)
        assert isinstance(w, QuantizedWeight) and w.group_size == 32, g
        assert torch.equal(dequantize(w), loaded.load(canon)), g


def test_q4_0_maps_exactly():
    """No bundled file has Q4_0: random blocks (random f16 scales, every nibble) through both paths."""
    rng = np.random.default_rng(0)
    rows, k = 6, 96
    blocks = rng.integers(0, 256, size=(rows * k // 32, 18), dtype=np.uint8)
    blocks[:, :2] = np.frombuffer(rng.standard_normal(rows * k // 32).astype(np.float16).tobytes(),
                                  dtype=np.uint8).reshape(-1, 2)
    raw = blocks.reshape(-1)
    q, scales, biases = affine_parts(raw, Q4_0, (rows, k))
    w = scales.repeat_interleave(32, -1) * q.float() + biases.repeat_interleave(32, -1)
    assert torch.equal(w, gguf_dequantize(raw, Q4_0, (rows, k)))


@pytest.mark.parametrize("name, tokens, kept", [("smollm2-135m", 6, "model.layers.0.mlp.gate_up_proj.weight"),
                                                ("gemma3-270m", 3, "model.layers.0.self_attn.o_proj.weight")])
def test_bundled_models_give_the_same_tokens_kept_quantised(monkeypatch, name, tokens, kept):
    """gemma3-270m (Q4_K_M) mixes types inside its packed projections (Q4_K with Q5_0, Q6_K dequantised):
    those load as one 16-bit weight, the rest stay quantised; the tokens are the same either way (the
    reference backend dequantises every call: gemma's 262k-row embedding makes it slow, hence 3)."""
    prompt = "The capital of France is"
    monkeypatch.setenv("KILN_KEEP_QUANTIZED", "0")
    want = kiln.load(name, device="cpu", dtype="f32").generate(prompt, max_new_tokens=tokens, temperature=0)
    monkeypatch.setenv("KILN_KEEP_QUANTIZED", "1")
    llm = kiln.load(name, device="cpu", dtype="f32")
    assert isinstance(llm.model.w[kept], QuantizedWeight)
    assert llm.generate(prompt, max_new_tokens=tokens, temperature=0).token_ids == want.token_ids


@pytest.mark.parametrize("ggml_type, size", [(Q4_K, 144), (Q5_K, 176)])
def test_k_quants_map_exactly(ggml_type, size):
    """Q4_K and Q5_K: random super-blocks (random f16 d and dmin, every 6-bit scale and min, every value)
    as eight affine groups of 32 each, scale * q + bias equal bit for bit to the dequantiser's."""
    rng = np.random.default_rng(1)
    rows, k = 5, 512
    blocks = rng.integers(0, 256, size=(rows * k // 256, size), dtype=np.uint8)
    blocks[:, :4] = np.frombuffer(rng.standard_normal(rows * k // 128).astype(np.float16).tobytes(),
                                  dtype=np.uint8).reshape(-1, 4)
    raw = blocks.reshape(-1)
    q, scales, biases = affine_parts(raw, ggml_type, (rows, k))
    assert q.shape == (rows, k) and scales.shape == biases.shape == (rows, k // 32)
    w = scales.repeat_interleave(32, -1) * q.float() + biases.repeat_interleave(32, -1)
    assert torch.equal(w, gguf_dequantize(raw, ggml_type, (rows, k)))
