"""Gemma 4 text (dense with PLE and KV sharing, MoE with k_eq_v) on the reference backend against
HF transformers' eager Gemma4ForCausalLM, on tiny random configs with odd sizes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

import kiln
from kiln.cache import RingKVCache
from kiln.errors import KilnError

transformers = pytest.importorskip("transformers")
if not hasattr(transformers, "Gemma4TextConfig"):
    pytest.skip("transformers has no Gemma 4 (needs >= 5.5)", allow_module_level=True)

S, F = "sliding_attention", "full_attention"
VOCAB, WINDOW = 301, 5


def _dense():
    """E2B-like: MQA, per-layer input embeddings, the last two layers KV-shared with double-wide MLPs."""
    return transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=72, num_hidden_layers=6, num_attention_heads=3,
        num_key_value_heads=1, head_dim=24, global_head_dim=40, sliding_window=WINDOW,
        layer_types=[S, S, F, S, S, F], final_logit_softcapping=30.0, hidden_size_per_layer_input=8,
        vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2, use_double_wide_mlp=True, eos_token_id=None)


def _moe():
    """26B-A4B-like: full layers with 1 KV head, head dim 36 and keys as values; 11 experts, top-3."""
    return transformers.Gemma4TextConfig(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=56, num_hidden_layers=5, num_attention_heads=6,
        num_key_value_heads=3, head_dim=20, global_head_dim=36, num_global_key_value_heads=1,
        attention_k_eq_v=True, sliding_window=WINDOW, layer_types=[S, S, F, S, F], final_logit_softcapping=30.0,
        hidden_size_per_layer_input=0, enable_moe_block=True, num_experts=11, top_k_experts=3,
        moe_intermediate_size=12, eos_token_id=None)


FAMILIES = {"dense": _dense, "moe": _moe}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny matrices: threads only add contention (40x slower on a busy 2-core CI box)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _hf_model(config, seed=1):
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", experts_implementation="eager").eval()
    with torch.no_grad():  # HF starts norms, scales and layer_scalar at 1: randomise what kiln must read
        for name, p in model.named_parameters():
            if "norm" in name or "scale" in name:
                p.normal_(1.0, 0.3)
            elif name.endswith("embed_tokens.weight"):  # rows of equal norm: no hub token to repeat
                p.normal_().mul_(1.0 / p.norm(dim=1, keepdim=True))
            elif "router.proj" in name:
                p.normal_(0.0, 0.5)    # decisive routing
            else:
                p.normal_(0.0, 0.1)    # layers that move the residual, so greedy text is not one token
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.uniform_(0.5, 1.5)
    return model


@pytest.fixture(scope="module", params=list(FAMILIES))
def tiny(request, tmp_path_factory):
    model = _hf_model(FAMILIES[request.param]())
    path = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(path)
    return request.param, model, path


def _ids(n, seed):
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed))


def _load(path, dtype="f32"):
    llm = kiln.load(path, device="cpu", dtype=dtype)
    llm.eos_ids = []  # random weights: run the full length, as HF does with eos_token_id=None
    return llm


def _forward(llm, ids, dtype=torch.float32):
    with torch.no_grad():
        return llm.model.forward(ids, torch.arange(len(ids)), llm.model.make_state(dtype, "cpu"), last_only=False)


def test_logits_match_transformers(tiny):
    family, ref, path = tiny
    ids = _ids(17, 1)
    ours = _forward(_load(path), ids)
    with torch.no_grad():
        theirs = ref(ids[None]).logits[0]
    assert theirs.abs().max() > 1.0
    assert (ours - theirs).abs().max() < 1e-4 * theirs.abs().max()


def test_48_greedy_tokens_match_generate(tiny):
    """Prompt and generation far longer than the window: the ring wraps many times."""
    family, ref, path = tiny
    llm = _load(path)
    prompt = _ids(13, 2).tolist()
    out = llm.generate(prompt, max_new_tokens=48)
    with torch.no_grad():
        hf = ref.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False, eos_token_id=None,
                          pad_token_id=0)[0, len(prompt):].tolist()
    assert out.token_ids == hf
    assert len(set(hf)) > 5  # not a degenerate repetition


def test_sliding_state_is_bounded_by_the_window(tiny):
    family, ref, path = tiny
    llm = _load(path)
    state = llm.model.make_state(torch.float32, "cpu")
    with torch.no_grad():
        llm.engine.prefill(_ids(30, 3).tolist(), state)
    caches = [getattr(s, "cache", s) for s in state if hasattr(s, "k") or hasattr(s, "cache")]
    rings = [c for c in caches if isinstance(c, RingKVCache)]
    assert rings and all(c.k.shape[0] <= WINDOW - 1 for c in rings)
    assert any(c.length == 30 for c in caches if not isinstance(c, RingKVCache))


def test_decode_token_by_token_equals_one_prefill(tiny):
    family, ref, path = tiny
    llm = _load(path)
    ids = _ids(21, 4)
    whole = _forward(llm, ids)
    state = llm.model.make_state(torch.float32, "cpu")
    with torch.no_grad():
        steps = torch.cat([llm.model.forward(ids[t:t + 1], torch.tensor([t]), state) for t in range(len(ids))])
    assert (steps - whole).abs().max() <= 1e-5 * whole.abs().max()


def _exact(llm, ids, monkeypatch):
    """The whole prefill's logits computed in f64: the same model code on f64 copies of the weights
    and state, with the reference's casts to f32 (norms, softmax) made no-ops. Its own rounding
    (2^-53 carried through the model) is ~1e-9 of f32's: the exact value, for the tests here."""
    import copy

    model = copy.copy(llm.model)
    model.w = {n: t.double() if t.is_floating_point() else t for n, t in llm.model.w.items()}
    model.lm_head = llm.model.lm_head.double()
    to_f32, softmax = torch.Tensor.float, torch.softmax

    def f64_float(t, *args, **kw):
        return t if t.dtype == torch.float64 else to_f32(t, *args, **kw)

    def f64_softmax(x, dim, dtype=None):
        return softmax(x, dim, dtype=torch.float64 if x.dtype == torch.float64 else dtype)

    with monkeypatch.context() as m, torch.no_grad():
        m.setattr(torch.Tensor, "float", f64_float)
        m.setattr(torch, "softmax", f64_softmax)
        return model.forward(ids, torch.arange(len(ids)), model.make_state(torch.float64, "cpu"), last_only=False)


def _greedy_agree(llm, prompt, got, want, tol):
    """Greedy tokens `got` equal `want` up to the first step where the top two logits (the whole
    prefill of the prompt and `want`'s tokens before it) are within tol: a near-tie, where either
    token is right within rounding; after it the two may differ."""
    n = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), None)
    if n is None:
        return len(got) == len(want)
    top = _forward(llm, torch.tensor(prompt + want[:n]))[-1].topk(2).values
    return (top[0] - top[1]).item() <= tol


@pytest.mark.parametrize("chunk", [3, 4])
def test_chunked_prefill_equals_whole_prefill(tiny, chunk, monkeypatch):
    """Chunked and whole prefill run the same f32 operations on every row; only the row counts of the
    GEMMs and of attention's products differ, and with them the order in which the CPU's BLAS sums
    (it blocks by row count: the first GEMM already differs by 1-3 ulps). Each run is then the same
    function rounded in f32, as far from its exact value as f32 rounding through this model carries:
    E, the whole prefill's distance from the same forward in f64 (1.1e-5 of the largest logit on
    dense, 2.9e-6 on moe: a one-ulp change, 2^-24, grows ~300-fold through attention at scale 1.0
    over RMS-normed q/k and a norm after every block). The chunked run's error is the same kind of
    error but another sample of it, and a maximum over 19 x 301 logits is a noisy statistic: over
    2160 draws (60 id sequences x chunks of 1-18 x both families) |chunked - whole| <= 3.9 E (median
    0.75 E), the engine's last row <= 1.9 E (1080 draws). Bound: 8 E. A chunking defect (a position,
    a mask, a cache row kept for later chunks off by 1e-5 of itself) moves them by 4e-5 to 1 of the
    largest logit, 8 E by 2e-5 (moe) to 8e-5 (dense)."""
    family, ref, path = tiny
    llm = _load(path)
    ids = _ids(19, 5)
    whole = _forward(llm, ids)
    err = (whole.double() - _exact(llm, ids, monkeypatch)).abs().max().item()
    bound = 8 * err
    assert 0 < bound < 1e-3 * whole.abs().max()       # a rounding bound, far below a defect's: it can fail
    state = llm.model.make_state(torch.float32, "cpu")
    with torch.no_grad():
        parts = [llm.model.forward(ids[s:s + chunk], torch.arange(s, min(s + chunk, len(ids))), state, last_only=False)
                 for s in range(0, len(ids), chunk)]
    assert (torch.cat(parts) - whole).abs().max() <= bound
    # The engine's path: last-row-only chunks (KV-shared layers then run on one row), then decode.
    llm.engine.prefill_chunk = chunk
    last = llm.engine.prefill(ids.tolist(), llm.model.make_state(torch.float32, "cpu"))
    assert (last - whole[-1]).abs().max() <= bound
    prompt = ids.tolist()
    chunked = llm.generate(prompt, max_new_tokens=12).token_ids
    llm.engine.prefill_chunk = 512
    assert _greedy_agree(llm, prompt, chunked, llm.generate(prompt, max_new_tokens=12).token_ids, 2 * bound)


def test_bf16_is_bit_exact_with_hf_eager(tiny):
    """Same roundings in the same places and the same CPU kernels: logits and 48 greedy tokens
    identical to HF eager attention with the eager experts loop (HF's default experts path,
    grouped_mm, sums the top-k in f32 instead and is not bit-comparable)."""
    family, ref, path = tiny
    llm = _load(path, "bf16")
    ref16 = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="eager", experts_implementation="eager").eval()
    ids = _ids(15, 6)
    ours = _forward(llm, ids, torch.bfloat16)
    with torch.no_grad():
        theirs = ref16(ids[None]).logits[0]
    assert ours.dtype == torch.bfloat16 and torch.equal(ours, theirs)
    prompt = _ids(11, 7).tolist()
    with torch.no_grad():
        hf = ref16.generate(torch.tensor([prompt]), max_new_tokens=48, do_sample=False, eos_token_id=None,
                            pad_token_id=0)[0, len(prompt):].tolist()
    assert llm.generate(prompt, max_new_tokens=48).token_ids == hf


def _rewrite(path, names=None, config=None):
    from safetensors.torch import load_file, save_file
    if names:
        save_file(names(load_file(path / "model.safetensors")), path / "model.safetensors")
    if config:
        cfg = json.loads((path / "config.json").read_text())
        (path / "config.json").write_text(json.dumps(config(cfg)))


def test_multimodal_wrapper_layout_loads(tiny, tmp_path):
    """A real Gemma4ForConditionalGeneration folder (weights under model.language_model.*, config
    under text_config) loads to the same model as the ForCausalLM folder."""
    family, ref, path = tiny
    wrapper = transformers.Gemma4ForConditionalGeneration(
        transformers.Gemma4Config(text_config=ref.config.to_dict(), vision_config=None, audio_config=None))
    state = {"model.language_model." + k[len("model."):]: v
             for k, v in ref.state_dict().items() if k.startswith("model.")}
    missing, unexpected = wrapper.load_state_dict(state, strict=False)
    assert not unexpected and all(not k.startswith("model.language_model.") or "embed_scale" in k for k in missing)
    wrapper.save_pretrained(tmp_path / "wrapped")
    from safetensors import safe_open
    with safe_open(str(tmp_path / "wrapped" / "model.safetensors"), "pt") as f:
        assert any(k.startswith("model.language_model.layers.") for k in f.keys())
    assert json.loads((tmp_path / "wrapped" / "config.json").read_text())["model_type"] == "gemma4"
    ids = _ids(12, 8)
    assert torch.equal(_forward(_load(tmp_path / "wrapped"), ids), _forward(_load(path), ids))


def test_config_with_global_head_keys_loads(tiny, tmp_path):
    """Configs saved before transformers moved the full layers' sizes into per_layer_config carry
    global_head_dim / num_global_key_value_heads instead (as the published checkpoints do)."""
    family, ref, path = tiny
    old = shutil.copytree(path, tmp_path / "old")

    def legacy(cfg):
        full = cfg.pop("per_layer_config")[str(cfg["layer_types"].index(F))]
        cfg["global_head_dim"] = full["head_dim"]
        if "num_key_value_heads" in full:
            cfg["num_global_key_value_heads"] = full["num_key_value_heads"]
        return cfg

    _rewrite(old, config=legacy)
    assert "per_layer_config" not in json.loads((old / "config.json").read_text())
    ids = _ids(9, 9)
    assert torch.equal(_forward(_load(old), ids), _forward(_load(path), ids))


def test_unused_kv_weights_of_shared_layers_are_ignored(tmp_path):
    """HF ignores k/v projections stored for KV-shared layers; strict loading drops only those."""
    model = _hf_model(_dense())
    model.save_pretrained(tmp_path)
    extra = {"model.layers.4.self_attn.k_proj.weight": torch.ones(24, 48),
             "model.layers.5.self_attn.k_norm.weight": torch.ones(40)}
    _rewrite(tmp_path, names=lambda w: {**w, **extra})
    ids = _ids(10, 10)
    with torch.no_grad():
        assert (_forward(_load(tmp_path), ids) - model(ids[None]).logits[0]).abs().max() < 1e-5
    _rewrite(tmp_path, names=lambda w: {**w, "model.layers.3.self_attn.extra.weight": torch.ones(2)})
    with pytest.raises(KilnError, match="extra"):
        _load(tmp_path)


def test_experts_stored_one_by_one_load(tmp_path):
    """HF writes Gemma 4 experts fused; a per-expert checkpoint loads to the same model."""
    model = _hf_model(_moe())
    model.save_pretrained(tmp_path)

    def split(w):
        out = {}
        for name, t in w.items():
            prefix, _, kind = name.rpartition(".")
            if kind == "gate_up_proj":
                for e, (gate, up) in enumerate(zip(*t.chunk(2, dim=1))):
                    out[f"{prefix}.{e}.gate_proj.weight"], out[f"{prefix}.{e}.up_proj.weight"] = gate, up
            elif kind == "down_proj" and prefix.endswith("experts"):
                out.update({f"{prefix}.{e}.down_proj.weight": t[e] for e in range(t.shape[0])})
            else:
                out[name] = t
        return {k: v.contiguous() for k, v in out.items()}

    _rewrite(tmp_path, names=split)
    ids = _ids(10, 11)
    with torch.no_grad():
        assert (_forward(_load(tmp_path), ids) - model(ids[None]).logits[0]).abs().max() < 1e-5


REAL_26B_A4B = dict(  # as the published config.json spells it (legacy keys)
    model_type="gemma4_text", vocab_size=262144, hidden_size=2816, intermediate_size=2112, num_hidden_layers=30,
    num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512, num_global_key_value_heads=2,
    attention_k_eq_v=True, sliding_window=1024, final_logit_softcapping=30.0, hidden_size_per_layer_input=0,
    enable_moe_block=True, num_experts=128, top_k_experts=8, moe_intermediate_size=704,
    use_bidirectional_attention="vision")


@pytest.mark.parametrize("config", ["26b-a4b", "26b-a4b-saved", "dense", "moe"])
def test_weight_shapes_match_hf_at_every_size(config):
    """kiln's declared checkpoint equals HF's state dict (built on the meta device, no memory),
    for the real 26B-A4B config as published and as transformers re-saves it."""
    from kiln.models.base import config_from_dict
    from kiln.models.gemma4 import Gemma4, Gemma4Config
    if config.startswith("26b"):
        hf_cfg = transformers.Gemma4TextConfig(**{k: v for k, v in REAL_26B_A4B.items() if k != "model_type"})
        raw = hf_cfg.to_dict() if config.endswith("saved") else REAL_26B_A4B
    else:
        hf_cfg = FAMILIES[config]()
        raw = hf_cfg.to_dict()
    with torch.device("meta"):
        hf = transformers.Gemma4ForCausalLM(hf_cfg)
    theirs = {k: tuple(v.shape) for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    ours = Gemma4.weight_shapes(config_from_dict(Gemma4Config, raw))
    ours.pop("lm_head.weight")
    assert ours == theirs


def test_proportional_rope_matches_hf_init():
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from kiln.models.gemma4 import rope_inv_freq
    cfg = _moe()
    theirs, _ = ROPE_INIT_FUNCTIONS["proportional"](cfg, "cpu", layer_type=F)
    ours = rope_inv_freq(cfg.rope_parameters[F], 36)
    assert ours.shape == (18,) and torch.equal(ours, theirs) and (ours[4:] == 0).all() and (ours[:4] > 0).all()


def test_non_causal_config_is_rejected(tiny, tmp_path):
    family, ref, path = tiny
    bad = shutil.copytree(path, tmp_path / "bad")
    _rewrite(bad, config=lambda c: {**c, "use_bidirectional_attention": "all"})
    with pytest.raises(KilnError, match="use_bidirectional_attention"):
        kiln.load(bad, device="cpu")


def test_prompts_prefilled_together_give_each_ones_logits_alone(tiny):
    """Several prompts in one forward (Engine.prefill_rows): the KV-shared layers of the E2B-like
    model run on each prompt's last row only, and each prompt's logits and next step are its alone."""
    family, _, path = tiny
    llm = _load(path)
    eng = llm.engine
    prompts = [_ids(n, 10 + n).tolist() for n in (9, 1, 14)]
    alone, states = [], []
    for p in prompts:
        states.append(eng.new_state(32))
        alone.append(eng.prefill(p, states[-1]))
    together = [eng.new_state(32) for _ in prompts]
    got = eng.prefill_rows([(p, s, 0) for p, s in zip(prompts, together)])
    for j, p in enumerate(prompts):
        torch.testing.assert_close(got[j], alone[j], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(eng.decode_step(3, len(p), together[j]), eng.decode_step(3, len(p), states[j]),
                                   rtol=1e-4, atol=1e-4)
    assert llm.model.cfg.first_shared < llm.model.cfg.num_hidden_layers or family == "moe"
