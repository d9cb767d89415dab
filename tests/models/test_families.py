"""Reference backend against HF transformers on tiny random configs of each family (HF folders)."""

from __future__ import annotations

import json

import pytest
import torch

import kiln
from kiln.errors import KilnError

transformers = pytest.importorskip("transformers")


def _tiny_llama():
    return transformers.LlamaConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_theta=10000.0)


def _tiny_gemma3():
    return transformers.Gemma3TextConfig(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, sliding_window=5, max_position_embeddings=256,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"], query_pre_attn_scalar=32)


def _tiny_qwen3():
    return transformers.Qwen3Config(
        vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=24, max_position_embeddings=256, tie_word_embeddings=True)


_HYBRID = dict(vocab_size=301, hidden_size=64, num_hidden_layers=3, num_attention_heads=3, num_key_value_heads=1,
               head_dim=40, linear_num_key_heads=2, linear_num_value_heads=6, linear_key_head_dim=16,
               linear_value_head_dim=24, linear_conv_kernel_dim=4, max_position_embeddings=512,
               layer_types=["linear_attention", "full_attention", "linear_attention"],
               rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
_MOE = dict(num_experts=10, num_experts_per_tok=3, moe_intermediate_size=40, shared_expert_intermediate_size=56)


def _tiny_qwen35():
    return transformers.Qwen3_5TextConfig(intermediate_size=96, tie_word_embeddings=False, **_HYBRID)


def _tiny_qwen35_moe():
    return transformers.Qwen3_5MoeTextConfig(**_HYBRID, **_MOE)


def _tiny_qwen3_next():
    return transformers.Qwen3NextConfig(intermediate_size=72, norm_topk_prob=False, mlp_only_layers=[1],
                                        **_HYBRID, **_MOE)


FAMILIES = {"llama": _tiny_llama, "gemma3": _tiny_gemma3, "qwen3": _tiny_qwen3, "qwen3_5": _tiny_qwen35,
            "qwen3_5_moe": _tiny_qwen35_moe, "qwen3_next": _tiny_qwen3_next}
ZERO_CENTRED_NORMS = ("gemma3", "qwen3_5", "qwen3_next")  # (1 + w) norms; the GDN gated norm is plain w


def _eager_experts(model) -> dict:
    """HF's MoE defaults to grouped_mm; its plain loop ("eager") is the reference kiln follows."""
    return {"experts_implementation": "eager"} if "experts" in str(dict(model.named_modules()).keys()) else {}


def _hf_model(config, seed=0):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    centred = config.model_type.startswith(ZERO_CENTRED_NORMS)
    with torch.no_grad():  # norms start at 1 or 0; randomise them so a swapped norm would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0.0 if centred and "linear_attn.norm" not in name else 1.0, 0.2)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    model = _hf_model(FAMILIES[request.param]())
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def test_logits_match_transformers(tiny):
    family, ref, path = tiny
    llm = kiln.load(path, device="cpu", dtype="f32")
    ids = torch.randint(0, 300, (11,), generator=torch.Generator().manual_seed(1))
    state = llm.model.make_state(torch.float32, "cpu")
    with torch.no_grad():
        ours = llm.model.forward(ids, torch.arange(11), state, last_only=False)
        theirs = ref(ids[None]).logits[0]
        # an int n: the LM head for the last n rows only (kiln compare's teacher-forced positions)
        tail = llm.model.forward(ids, torch.arange(11), llm.model.make_state(torch.float32, "cpu"), last_only=4)
    assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()
    assert tail.shape == (4, ours.shape[1]) and torch.allclose(tail, ours[-4:], rtol=0, atol=1e-5)


@pytest.mark.parametrize("chunk, new", [(512, 48), (3, 12)])
def test_greedy_tokens_match_generate(tiny, chunk, new):
    """Prompt longer than the sliding window, prefilled whole or in chunks of 3, then decoded."""
    family, ref, path = tiny
    llm = kiln.load(path, device="cpu", dtype="f32")
    llm.engine.prefill_chunk = chunk
    prompt = torch.randint(0, 300, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    out = llm.generate(prompt, max_new_tokens=new)
    with torch.no_grad():
        hf = ref.generate(torch.tensor([prompt]), max_new_tokens=new, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert out.token_ids == hf
    assert out.finish_reason == "length" and out.stats.generated_tokens == new


def test_decode_steps_equal_one_prefill(tiny):
    """Chunks of 50 (across the GDN chunk of 64 and the sliding window), then one token at a time,
    give the logits of one whole prefill at every position."""
    family, ref, path = tiny
    llm = kiln.load(path, device="cpu", dtype="f32")
    ids = torch.randint(0, 300, (140,), generator=torch.Generator().manual_seed(4))
    fwd = llm.model.forward
    with torch.no_grad():
        whole = fwd(ids, torch.arange(140), llm.model.make_state(torch.float32, "cpu"), last_only=False)
        st = llm.model.make_state(torch.float32, "cpu")
        parts = [fwd(ids[a:a + 50], torch.arange(a, a + 50), st, last_only=False) for a in (0, 50)]
        parts += [fwd(ids[i:i + 1], torch.arange(i, i + 1), st, last_only=False) for i in range(100, 140)]
    assert (torch.cat(parts) - whole).abs().max() <= 1e-4 * whole.abs().max()


def test_bf16_follows_reference_rounding(tiny):
    family, ref, path = tiny
    llm = kiln.load(path, device="cpu", dtype="bf16")
    ref16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager",
                                                              **_eager_experts(ref)).eval()
    ids = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = llm.model.forward(ids, torch.arange(9), llm.model.make_state(torch.bfloat16, "cpu"), last_only=False)
        theirs = ref16(ids[None]).logits[0]
    # Same roundings in the same places and the same CPU kernels: bit-identical to HF eager.
    assert torch.equal(ours, theirs)


def _rewrite(path, transform_names, transform_config=None):
    from safetensors.torch import load_file, save_file

    weights = load_file(path / "model.safetensors")
    save_file(transform_names(weights), path / "model.safetensors")
    if transform_config:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(transform_config(cfg)))


def _copy(src, dst):
    import shutil
    shutil.copytree(src, dst)
    return dst


def test_multimodal_wrapper_layout_loads(tiny, tmp_path):
    family, ref, path = tiny
    wrapped = _copy(path, tmp_path / "wrapped")

    def rename(w):
        out = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in w.items()}
        out["model.vision_tower.patch_embed.weight"] = torch.zeros(2, 2)  # not text: ignored
        return out

    _rewrite(wrapped, rename, lambda c: {"model_type": "wrapper", "text_config": c, "tie_word_embeddings": True})
    a = kiln.load(path, device="cpu").generate([1, 2, 3], max_new_tokens=5).token_ids
    b = kiln.load(wrapped, device="cpu").generate([1, 2, 3], max_new_tokens=5).token_ids
    assert a == b


def test_sharded_checkpoint_loads(tiny, tmp_path):
    family, ref, path = tiny
    sharded = tmp_path / "sharded"
    ref.save_pretrained(sharded, max_shard_size="20KB")
    assert (sharded / "model.safetensors.index.json").exists()
    a = kiln.load(path, device="cpu").generate([4, 5, 6], max_new_tokens=5).token_ids
    b = kiln.load(sharded, device="cpu").generate([4, 5, 6], max_new_tokens=5).token_ids
    assert a == b


@pytest.mark.parametrize("damage", ["missing", "unexpected", "shape"])
def test_strict_loading_names_the_tensor(tiny, tmp_path, damage):
    family, ref, path = tiny
    bad = _copy(path, tmp_path / "bad")
    name = "model.layers.1.self_attn.o_proj.weight"

    def edit(w):
        if damage == "missing":
            del w[name]
        elif damage == "unexpected":
            w["model.layers.1.self_attn.extra.weight"] = torch.zeros(3)
        else:
            w[name] = w[name][:-1].contiguous()
        return w

    _rewrite(bad, edit)
    with pytest.raises(KilnError) as e:
        kiln.load(bad, device="cpu")
    assert ("extra" if damage == "unexpected" else name) in str(e.value)


def test_safetensors_tensors_are_views_of_the_file_and_loaded_weights_are_owned(tmp_path):
    """The HF reader hands out views of the file's memory map (no host copy before the GPU copy),
    every dtype and an empty tensor equal to safetensors' own reader; load_strict copies such a view
    when it would otherwise keep it (same device and dtype): weights are owned, the file untouched."""
    from safetensors.torch import load_file, save_file

    from kiln.models.base import load_strict
    from kiln.weights import open_checkpoint

    tensors = {"a.weight": torch.randn(3, 5).to(torch.bfloat16), "b.weight": torch.randn(7),
               "c.weight": torch.arange(3, dtype=torch.int64), "d.weight": torch.randn(2, 3).half(),
               "e.weight": torch.randn(0, 4)}
    save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    ckpt = open_checkpoint(tmp_path)
    want = load_file(tmp_path / "model.safetensors")
    for name, t in want.items():
        got = ckpt.load(name)
        assert got.dtype == t.dtype and torch.equal(got, t), name
    assert ckpt.load("b.weight").data_ptr() == ckpt.load("b.weight").data_ptr()     # a view, not a copy
    w = load_strict(ckpt, {n: tuple(t.shape) for n, t in want.items()}, None, "cpu")
    w["a.weight"].add_(1)
    assert torch.equal(w["a.weight"], want["a.weight"] + 1) and torch.equal(ckpt.load("a.weight"), want["a.weight"])
    assert torch.equal(load_file(tmp_path / "model.safetensors")["a.weight"], want["a.weight"])


def test_no_pickle_checkpoints(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(KilnError, match="safetensors"):
        kiln.load(tmp_path, device="cpu")


def test_bf16_decode_steps_are_bit_exact(tiny):
    """Prefill then one-token decode steps give HF eager's generate logits bit for bit."""
    family, ref, path = tiny
    llm = kiln.load(path, device="cpu", dtype="bf16")
    ref16 = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation="eager",
                                                              **_eager_experts(ref)).eval()
    prompt = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        out = ref16.generate(prompt[None], max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0,
                             output_logits=True, return_dict_in_generate=True)
        new = out.sequences[0, 9:].tolist()
        st = llm.model.make_state(torch.bfloat16, "cpu")
        ours = [llm.model.forward(prompt, torch.arange(9), st)[-1]]
        ours += [llm.model.forward(torch.tensor([t]), torch.tensor([9 + i]), st)[-1] for i, t in enumerate(new[:-1])]
    for i, (a, b) in enumerate(zip(ours, out.logits)):
        assert torch.equal(a, b[0]), f"step {i}"
