"""Synthesized checkpoints: the config table against the published configurations and transformers, seeded tensors,
the folder writer (strict HF load, streaming memory), the `synth:` spec, and non-degenerate init."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys

import pytest
import torch

import kiln
from kiln.cli import main as cli_main
from kiln.errors import KilnError
from kiln.models import MODEL_TYPES, checkpoint_shapes, model_config, synthesis
from kiln.weights import synth

transformers = pytest.importorskip("transformers")

TINY = [n for n in synth.CONFIGS if n.startswith("tiny-")]


def needs_family(name: str) -> str:
    """Skip until kiln has a model file for this configuration's family."""
    mt = synth.CONFIGS[name]["model_type"]
    if mt not in MODEL_TYPES:
        pytest.skip(f"kiln has no model for {mt} yet ({name} needs it for tensor names and shapes)")
    return mt


def _pow2(n: int) -> bool:
    return n & (n - 1) == 0


def _hf_config(config: dict):
    config = copy.deepcopy(config)  # transformers may normalise nested dicts in place
    return transformers.AutoConfig.for_model(config.pop("model_type"), **config)


# -- the table ----------------------------------------------------------------------------------

# The published configurations (docs/synth.md): hidden, layers, full-attention layers, heads, KV heads,
# intermediate, GDN key heads, GDN value heads, tied.
DENSE = {"qwen3.5-0.8b": (1024, 24, 6, 8, 2, 3584, 16, 16, True),
         "qwen3.5-2b": (2048, 24, 6, 8, 2, 6144, 16, 16, True),
         "qwen3.5-4b": (2560, 32, 8, 16, 4, 9216, 16, 32, True),
         "qwen3.5-9b": (4096, 32, 8, 16, 4, 12288, 16, 32, False),
         "qwen3.5-27b": (5120, 64, 16, 24, 4, 17408, 16, 48, False)}
# hidden, layers, full layers, heads, KV heads, experts, top-k, expert FFN, shared FFN, GDN K, GDN V, vocab
MOE = {"qwen3.5-35b-a3b": (2048, 40, 10, 16, 2, 256, 8, 512, 512, 16, 32, 248320),
       "qwen3.5-122b-a10b": (3072, 48, 12, 32, 2, 256, 8, 1024, 1024, 16, 64, 248320),
       "qwen3.5-397b-a17b": (4096, 60, 15, 32, 2, 512, 10, 1024, 1024, 16, 64, 248320),
       "qwen3-next-80b-a3b": (2048, 48, 12, 16, 2, 512, 10, 512, 512, 16, 32, 151936)}


def _qwen_common(c):
    """What every real Qwen3.5 / Qwen3-Next config shares, read back through transformers."""
    rp = c.rope_parameters
    assert (c.head_dim, c.linear_key_head_dim, c.linear_value_head_dim, c.linear_conv_kernel_dim) == (256, 128, 128, 4)
    assert rp["rope_theta"] == 1e7 and int(c.head_dim * rp["partial_rotary_factor"]) == 64 and c.rms_norm_eps == 1e-6
    assert [i for i, t in enumerate(c.layer_types) if t == "full_attention"][:3] == [3, 7, 11]


@pytest.mark.parametrize("name", DENSE)
def test_dense_qwen35_configs_are_reference_md(name):
    c = _hf_config(synth.CONFIGS[name])
    hidden, layers, full, heads, kv, inter, gk, gv, tied = DENSE[name]
    assert (c.hidden_size, c.num_hidden_layers, c.layer_types.count("full_attention")) == (hidden, layers, full)
    assert (c.num_attention_heads, c.num_key_value_heads, c.intermediate_size) == (heads, kv, inter)
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.tie_word_embeddings) == (gk, gv, tied)
    assert c.vocab_size == 248320 and c.model_type == "qwen3_5_text"
    _qwen_common(c)


@pytest.mark.parametrize("name", MOE)
def test_moe_configs_are_reference_md(name):
    c = _hf_config(synth.CONFIGS[name])
    hidden, layers, full, heads, kv, experts, k, ffn, shared, gk, gv, vocab = MOE[name]
    assert (c.hidden_size, c.num_hidden_layers, c.layer_types.count("full_attention")) == (hidden, layers, full)
    assert (c.num_attention_heads, c.num_key_value_heads) == (heads, kv)
    assert (c.num_experts, c.num_experts_per_tok) == (experts, k)
    assert (c.moe_intermediate_size, c.shared_expert_intermediate_size) == (ffn, shared)
    assert (c.linear_num_key_heads, c.linear_num_value_heads, c.vocab_size) == (gk, gv, vocab)
    assert not c.tie_word_embeddings
    _qwen_common(c)
    if c.model_type == "qwen3_next":
        assert c.norm_topk_prob and c.mlp_only_layers == [] and c.decoder_sparse_step == 1


def test_gemma4_26b_config_is_reference_md():
    c = _hf_config(synth.CONFIGS["gemma4-26b-a4b"])
    assert (c.hidden_size, c.num_hidden_layers, c.vocab_size, c.tie_word_embeddings) == (2816, 30, 262144, True)
    full = [i for i, t in enumerate(c.layer_types) if t == "full_attention"]
    assert full == [5, 11, 17, 23, 29] and c.sliding_window == 1024  # 5 sliding : 1 full
    assert c.num_attention_heads == 16
    assert (c.per_layer_config[5].head_dim, c.per_layer_config[5].num_key_value_heads) == (512, 2)
    assert (c.per_layer_config[0].head_dim, c.per_layer_config[0].num_key_value_heads) == (256, 8)
    assert (c.intermediate_size, c.num_experts, c.top_k_experts, c.moe_intermediate_size) == (2112, 128, 8, 704)
    assert c.enable_moe_block and c.attention_k_eq_v and c.final_logit_softcapping == 30.0
    assert c.hidden_activation == "gelu_pytorch_tanh" and not c.hidden_size_per_layer_input
    assert c.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert c.rope_parameters["full_attention"] == {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                                   "rope_theta": 1e6}


@pytest.mark.parametrize("name", TINY)
def test_tiny_configs_have_odd_sizes_and_every_layer_kind(name):
    d = synth.CONFIGS[name]
    c = _hf_config(d)
    assert not _pow2(c.vocab_size)
    if name.endswith("-p2"):    # power-of-two heads on purpose: the cuda backend's kernels (not fallbacks) run
        dims = [d["head_dim"]] + [d[k] for k in ("global_head_dim", "linear_key_head_dim", "linear_value_head_dim")
                                  if k in d]
        assert len(dims) >= 2 and all(_pow2(x) for x in dims)
        return
    assert not _pow2(c.num_attention_heads)
    assert not _pow2(d.get("head_dim") or d["hidden_size"] // d["num_attention_heads"])
    types = getattr(c, "layer_types", None) or []
    if "linear_attention" in types:  # hybrids: at least 2 GDN layers and 1 full-attention layer
        assert types.count("linear_attention") >= 2 and types.count("full_attention") >= 1
        assert not _pow2(c.linear_key_head_dim) and not _pow2(c.linear_value_head_dim)
    if getattr(c, "num_experts", None):
        assert c.num_experts >= 8 and not _pow2(c.num_experts)
    if "sliding_attention" in types:  # a window shorter than the prompts and generations tests use
        assert c.sliding_window < 16 and types.count("full_attention") >= 1


def test_layers_cut_depth_and_keep_gemma4_last_layer_full():
    c = synth.synth_config("qwen3.5-35b-a3b", 4)
    assert c["num_hidden_layers"] == 4 and c["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    g = synth.synth_config("gemma4-26b-a4b", 3)  # transformers forces the last layer to full attention
    assert g["layer_types"] == ["sliding_attention", "sliding_attention", "full_attention"]
    assert synth.CONFIGS["gemma4-26b-a4b"]["layer_types"][2] == "sliding_attention"  # the table is untouched
    h = synth.synth_config("qwen3.5-9b", 2)  # a hybrid keeps one full-attention layer (HF's cache needs it)
    assert h["layer_types"] == ["linear_attention", "full_attention"]
    with pytest.raises(KilnError, match="between 1 and 40"):
        synth.synth_config("qwen3.5-35b-a3b", 41)


@pytest.mark.parametrize("spec, says", [
    ("synth:nope", "unknown synthesized model"), ("synth:", "not a synthesized"),
    ("synth:tiny-llama:layers=x", "bad option"), ("synth:tiny-llama:depth=2", "bad option"),
    ("synth:tiny-llama:seed=1:seed=2", "bad option"), ("synth:tiny-llama:layers=0", "between 1 and 3"),
    ("synth:tiny-llama:bits=7", "bits takes bits in"), ("synth:tiny-llama:bits=4:group=48", "group takes"),
    ("synth:tiny-llama:experts=2", "need bits=B"), ("synth:tiny-llama:bits=4:router=9", "router takes bits in"),
])
def test_bad_specs_are_user_errors(spec, says):
    with pytest.raises(KilnError, match=says):
        kiln.load(spec, device="cpu")


# -- the tensors --------------------------------------------------------------------------------

def test_tensors_are_seeded_per_name_and_block(monkeypatch):
    monkeypatch.setattr(synth, "BLOCK", 1000)  # several blocks (and worker threads) for a small tensor
    cfg = synth.CONFIGS["tiny-llama"]
    up0, up1 = "model.layers.0.mlp.up_proj.weight", "model.layers.1.mlp.up_proj.weight"

    def drawn(seed):
        return synth.Synthesis(cfg, {up0: (136, 72), up1: (136, 72)}, False, seed)

    a = drawn(0).tensor(up0)
    assert torch.equal(a, drawn(0).tensor(up0))
    assert torch.equal(a.flatten(), torch.cat(list(drawn(0).blocks(up0))))
    assert not torch.equal(a, drawn(1).tensor(up0))
    assert not torch.equal(a, drawn(0).tensor(up1))
    blocks = a.flatten().split(1000)  # blocks are independent draws, not one stream cut in pieces
    assert not torch.equal(blocks[0], blocks[1])
    assert abs(float(a.std()) - 72 ** -0.5) < 0.1 * 72 ** -0.5 and abs(float(a.mean())) < 0.01


def test_layers_and_seed_options_select_the_same_tensors():
    full = kiln.load("synth:tiny-gemma3", device="cpu").model.w
    cut = kiln.load("synth:tiny-gemma3:layers=2", device="cpu").model.w
    other = kiln.load("synth:tiny-gemma3:seed=7", device="cpu").model.w
    assert set(cut) < set(full) and all(torch.equal(cut[n], full[n]) for n in cut)
    assert not any(torch.equal(other[n], full[n]) for n in full)


def test_bf16_weights_are_the_f32_weights_rounded():
    w32 = kiln.load("synth:tiny-llama", device="cpu", dtype="f32").model.w
    w16 = kiln.load("synth:tiny-llama", device="cpu", dtype="bf16").model.w
    assert all(w16[n].dtype == torch.bfloat16 and torch.equal(w16[n], w32[n].to(torch.bfloat16)) for n in w32)


def test_random_prompt_is_seeded_and_in_range():
    a = synth.random_prompt(50, 331, seed=0)
    assert a == synth.random_prompt(50, 331, seed=0) != synth.random_prompt(50, 331, seed=1)
    assert len(a) == 50 and all(0 <= i < 331 for i in a) and len(set(a)) > 30


@pytest.mark.parametrize("name", TINY)
def test_norm_weights_are_centred_as_transformers_initialises_them(name):
    """zero-centred (applied as 1 + w) exactly where HF initialises a norm weight to 0, plain where to 1."""
    needs_family(name)
    config = synth.synth_config(name)
    model_class, _ = model_config(config)
    hf = transformers.AutoModelForCausalLM.from_config(_hf_config(config))
    state = hf.state_dict()
    checked = 0
    for n in checkpoint_shapes(config):
        if synth._NORM.search(n) and n in state:
            zero_centred = model_class.norm_style == "offset" and ".linear_attn.norm." not in n
            assert float(state[n].float().mean()) == (0.0 if zero_centred else 1.0), n
            checked += 1
    assert checked >= 2 * config["num_hidden_layers"]


def _router_choices(model):
    """The experts every router picked, hooked on HF's router modules (last output = indices)."""
    picks = []
    for name, mod in model.named_modules():
        if name.endswith(".mlp.gate") or name.endswith(".router"):
            mod.register_forward_hook(lambda m, i, o: picks.append(o[-1]))
    return picks


@pytest.mark.parametrize("name", TINY + ["deep-qwen3.5", "deep-gemma4-moe"])
def test_activations_are_finite_and_non_degenerate(name, monkeypatch):
    """Through every layer of the transformers reference on the synthesized weights: hidden-state RMS
    in a sane band, logits neither constant nor dominated by the input token, routers spread."""
    if name.startswith("deep-"):  # the tiny widths at a real depth: the residual must not blow up
        base = synth.CONFIGS["tiny-" + name[5:]]
        n = 48 if "qwen" in name else 30
        types = synth._hybrid(n, 3) if "qwen" in name else synth._sliding(n, 6)
        monkeypatch.setitem(synth.CONFIGS, name, dict(base, num_hidden_layers=n, layer_types=types))
    needs_family(name if name in TINY else "tiny-" + name[5:])
    from kiln.tools.hf_reference import load_hf_reference

    ref = load_hf_reference(f"synth:{name}", "f32", "cpu")
    picks = _router_choices(ref)
    vocab = synth.CONFIGS[name]["vocab_size"]
    ids = torch.tensor([synth.random_prompt(64, vocab, seed=5)])
    with torch.no_grad():
        out = ref(ids, output_hidden_states=True)
    rms = [float(h.float().pow(2).mean().sqrt()) for h in out.hidden_states[1:-1]]  # after each layer
    assert all(math.isfinite(r) and 0.3 < r < 20 for r in rms), rms
    logits = out.logits[0]
    assert torch.isfinite(logits).all() and 1.0 < float(logits.std(-1).mean()) < 10.0
    best = logits.argmax(-1)
    assert len(set(best.tolist())) >= 8                      # the next token depends on the context
    assert float((best == ids[0]).float().mean()) < 0.25     # and is not just the input token again
    experts = synth.CONFIGS[name].get("num_experts")
    if experts:
        assert picks, "no router outputs were seen"
        for idx in picks:  # every MoE layer sends the 64 tokens to most experts
            assert len(set(idx.flatten().tolist())) >= experts * 2 // 3


# -- the folder ----------------------------------------------------------------------------------

def _write(name, out, *args):
    assert cli_main(["synth", name, str(out), "--quiet", *args]) == 0
    return out


def _checkpoint_tensors(llm) -> dict:
    """The loaded weights by checkpoint name: each packed projection split back into the tensors it
    merged at load (rows in order)."""
    cls, cfg = type(llm.model), llm.model.cfg
    shapes, w = cls.weight_shapes(cfg), dict(llm.model.w)
    for merged, parts in cls.packed_groups(cfg).items():
        w.update(zip(parts, w.pop(merged).split([shapes[p][0] for p in parts])))
    return w


@pytest.mark.parametrize("name", TINY)
def test_folder_round_trip_equals_the_spec_and_loads_strictly_in_transformers(name, tmp_path):
    needs_family(name)
    out = _write(name, tmp_path / name)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shapes = checkpoint_shapes(synth.synth_config(name))
    assert set(index["weight_map"]) == set(shapes)
    assert index["metadata"]["total_size"] == 2 * sum(math.prod(s) for s in shapes.values())
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"

    disk = _checkpoint_tensors(kiln.load(out, device="cpu", dtype="bf16"))
    spec = _checkpoint_tensors(kiln.load(f"synth:{name}", device="cpu", dtype="bf16"))
    assert set(disk) == set(spec) and all(torch.equal(disk[n], spec[n]) for n in spec)

    hf, info = transformers.AutoModelForCausalLM.from_pretrained(
        out, dtype=torch.bfloat16, output_loading_info=True, attn_implementation="eager",
        experts_implementation="eager")
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    state = hf.state_dict()
    assert all(torch.equal(state[n], spec[n]) for n in spec if n in state)

    # The in-memory reference (meta build + the same tensors) is the folder's reference, buffers included.
    from kiln.tools.hf_reference import load_hf_reference

    mem = load_hf_reference(f"synth:{name}", "bf16", "cpu")
    ids = torch.tensor([synth.random_prompt(20, synth.CONFIGS[name]["vocab_size"])])
    with torch.no_grad():
        assert torch.equal(mem(ids).logits, hf.eval()(ids).logits)


def test_f32_folder_shards_and_equals_the_f32_spec(tmp_path):
    out = _write("tiny-llama", tmp_path / "m", "--dtype", "f32", "--shard-mb", "0.2")
    files = sorted(p.name for p in out.glob("*.safetensors"))
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(files) >= 2 and sorted(set(index["weight_map"].values())) == files
    disk = kiln.load(out, device="cpu", dtype="f32").model.w
    spec = kiln.load("synth:tiny-llama", device="cpu", dtype="f32").model.w
    assert all(disk[n].dtype == torch.float32 and torch.equal(disk[n], spec[n]) for n in spec)


def test_existing_output_is_refused_and_a_failed_write_leaves_nothing(tmp_path, monkeypatch):
    (tmp_path / "taken").mkdir()
    assert cli_main(["synth", "tiny-llama", str(tmp_path / "taken"), "--quiet"]) == 2

    def fail(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(synth, "_write_shard", fail)
    with pytest.raises(OSError):
        synth.write_checkpoint(synthesis("tiny-llama"), tmp_path / "new", "tiny-llama", quiet=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["taken"]  # no OUT, no partial temp folder


def test_writing_streams_block_by_block(tmp_path):
    """gemma3-270m cut to 1 layer is 335 MB in bf16 and its embedding alone 671 MB in f32; the writer's
    peak memory grows by a few blocks only (measured in a fresh process)."""
    script = (
        "import resource, sys\n"
        "from kiln.models import synthesis\n"
        "from kiln.weights import synth\n"
        "synth.WORKERS = 2\n"
        "drawn = synthesis('gemma3-270m', 1)\n"
        "base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "synth.write_checkpoint(drawn, sys.argv[1], 'gemma3-270m', quiet=True)\n"
        "print(base, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)\n")
    out = tmp_path / "g"
    r = subprocess.run([sys.executable, "-c", script, str(out)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    base_kb, peak_kb = map(int, r.stdout.split())
    size = sum(p.stat().st_size for p in out.glob("*.safetensors"))
    assert size > 330e6
    assert (peak_kb - base_kb) * 1024 < 250e6, (base_kb, peak_kb)  # drawing whole tensors: > 1 GB


def test_the_397b_config_is_drawn_in_small_blocks():
    """Its largest tensor (an expert stack of 4.3G values) comes out block by block, never whole."""
    needs_family("qwen3.5-397b-a17b")
    config = synth.synth_config("qwen3.5-397b-a17b", 2)
    shapes = checkpoint_shapes(config)
    name = max(shapes, key=lambda n: math.prod(shapes[n]))
    assert math.prod(shapes[name]) > 4e9
    blocks = synthesis("qwen3.5-397b-a17b", 2).blocks(name)
    assert [next(blocks).numel() for _ in range(3)] == [synth.BLOCK] * 3
    blocks.close()
    shards = synth.plan_shards(shapes, 2, 4 << 30)
    assert all(sum(math.prod(shapes[n]) * 2 for n in s) <= 4 << 30 or len(s) == 1 for s in shards)


def test_list_names_every_configuration():
    r = subprocess.run([sys.executable, "-m", "kiln.cli", "synth", "--list"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and all(n in r.stdout for n in synth.CONFIGS)


# -- drawn quantised ----------------------------------------------------------------------------

def test_a_quantised_draw_is_mx_quantize_of_the_rounded_draw(monkeypatch):
    """Quantised a few blocks at a time as drawn (several trips, a partial last block and a partial last
    trip; trips of one block reuse each buffer), the words, scales and biases are quantize() of the
    whole tensor rounded to bf16: no 16-bit copy needed for the same result."""
    from kiln.ops.quant.reference import quantize

    monkeypatch.setattr(synth, "BLOCK", 64 * 40)
    name = "model.layers.0.mlp.up_proj.weight"
    drawn = synth.Synthesis(synth.CONFIGS["tiny-llama"], {name: (150, 128)}, False, 3)
    # 7.5 blocks: trips of 3, 3 and 1.5; of 1 (8 trips through TRIPS_AHEAD + 1 buffers)
    for (bits, group), batch in (((4, 64), 3), ((3, 32), 3), ((2, 128), 3), ((4, 64), 1)):
        monkeypatch.setattr(synth, "DRAW_BATCH", batch)
        got = synth.quantized_draw(drawn, name, (bits, group), torch.bfloat16)
        want = quantize(drawn.tensor(name, torch.bfloat16), bits, group)
        assert got.shape == want.shape and torch.equal(got.packed, want.packed)
        assert torch.equal(got.scales, want.scales) and torch.equal(got.biases, want.biases)


def test_a_quantised_spec_loads_and_runs_kept_quantised(monkeypatch):
    """synth:NAME:bits=4:group=32:router=8:experts=2 quantises what mlx-lm would (projections and the
    embedding at 4 bits, routers at 8, the expert stacks at 2; norms, conv1d and widths that are not a
    multiple of the group stay 16-bit), and the cuda backend (its quantised GEMV, routed experts and
    embedding under the interpreter) gives the reference backend's greedy tokens."""
    from kiln.weights.quantized import QuantizedWeight

    monkeypatch.setenv("KILN_TUNE_BUDGET_S", "0")    # each op's default variant: tuning is tested elsewhere
    spec = "synth:tiny-qwen3.5-moe-p2:bits=4:group=32:router=8:experts=2"
    ref = kiln.load(spec, device="cpu", dtype="f32", backend="reference")
    w = ref.model.w
    bits = {n: t.bits for n, t in w.items() if isinstance(t, QuantizedWeight)}
    assert bits["model.embed_tokens.weight"] == 4 and bits["model.layers.0.mlp.gate.weight"] == 8
    assert bits["model.layers.0.mlp.experts.gate_up_proj"] == bits["model.layers.0.mlp.experts.down_proj"] == 2
    assert not any(isinstance(t, QuantizedWeight) for n, t in w.items() if "norm" in n or "conv1d" in n)
    prompt = [5, 17, 200, 33, 91, 4]
    want = ref.generate(prompt, max_new_tokens=2, temperature=0).token_ids     # a prefill and a decode step
    cuda = kiln.load(spec, device="cpu", dtype="f32", backend="cuda")
    assert cuda.generate(prompt, max_new_tokens=2, temperature=0).token_ids == want


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_quantised_draw_on_a_gpu_is_the_cpus(monkeypatch):
    """Where a GPU is present the draw quantises there: the same words, scales and biases as the CPU's."""
    test_a_quantised_draw_is_mx_quantize_of_the_rounded_draw(monkeypatch)
