"""Synthesized checkpoints: real configurations with seeded random weights, written to an HF folder
(`kiln synth ARCH OUT`) or drawn as they are loaded (the model spec `synth:NAME[:layers=N][:seed=S]`).

Tensor names and shapes are the model's own: the loader asks the checkpoint for them
(`Checkpoint.for_model`), and the writer is given them (kiln.models.checkpoint_shapes). Every tensor is
drawn in blocks of BLOCK elements, each block from its own seed (a hash of the run seed, the tensor
name and the block index): a tensor never depends on which other tensors exist, so `--layers N` is
the first N layers of the full model, and the folder and the spec hold the same values. Values are
drawn in f32 and rounded to the stored dtype, so a bf16 checkpoint is the f32 one rounded.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import shutil
import struct
import sys
import tempfile
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from tqdm import tqdm

from ..errors import KilnError
from .checkpoint import Checkpoint
from .quantized import BITS as QUANT_BITS
from .quantized import GROUP_SIZES as QUANT_GROUPS
from .quantized import QuantizedWeight, quantize

BLOCK = 1 << 22          # elements per independently seeded block (part of the determinism contract)
DRAW_BATCH = 8           # blocks a quantised draw quantises at once (any count gives the same values)
CACHE_PIECE = 1 << 16    # values (256 KB) a worker draws and maps in its L2: 64 pieces a block, few GIL trips
TRIPS_AHEAD = 2          # trips drawn while one quantises: DRAW_BATCH * TRIPS_AHEAD blocks keep WORKERS busy
WORKERS = min(16, os.cpu_count() or 1)

# -- the configurations -------------------------------------------------------------------------

_QWEN35 = dict(  # shared by every Qwen3.5 / 3.6 text model (their published config.json; docs/synth.md)
    vocab_size=248320, head_dim=256, attn_output_gate=True, linear_key_head_dim=128, linear_value_head_dim=128,
    linear_conv_kernel_dim=4, full_attention_interval=4, rms_norm_eps=1e-6, hidden_act="silu",
    max_position_embeddings=262144, attention_bias=False, eos_token_id=248044,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25,
                     "mrope_section": [11, 11, 10], "mrope_interleaved": True})


def _hybrid(n: int, interval: int) -> list[str]:
    return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]


def _sliding(n: int, period: int) -> list[str]:
    return ["full_attention" if (i + 1) % period == 0 else "sliding_attention" for i in range(n)]


def _qwen35(hidden, layers, heads, kv, inter, gdn_k, gdn_v, tied):
    return dict(_QWEN35, model_type="qwen3_5_text", architectures=["Qwen3_5ForCausalLM"], hidden_size=hidden,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, intermediate_size=inter,
                linear_num_key_heads=gdn_k, linear_num_value_heads=gdn_v, tie_word_embeddings=tied,
                layer_types=_hybrid(layers, 4))


def _qwen35_moe(hidden, layers, heads, kv, experts, top_k, expert_ffn, shared_ffn, gdn_k, gdn_v):
    return dict(_QWEN35, model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"], hidden_size=hidden,
                num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv, num_experts=experts,
                num_experts_per_tok=top_k, moe_intermediate_size=expert_ffn, shared_expert_intermediate_size=shared_ffn,
                linear_num_key_heads=gdn_k, linear_num_value_heads=gdn_v, tie_word_embeddings=False,
                layer_types=_hybrid(layers, 4))


def _tiny(base: dict, **over) -> dict:
    """A tiny config of a family: odd sizes, max context 1024."""
    cfg = dict(base, max_position_embeddings=1024, **over)
    cfg.pop("eos_token_id", None)  # random weights: generation runs to max_new_tokens
    return {k: v for k, v in cfg.items() if v is not None}  # None: the key is left out (HF default)


_GEMMA4_ROPE = {"sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.25,
                                   "rope_theta": 1_000_000.0}}
_TINY_QWEN_ROPE = {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25}
_GEMMA4_26B = dict(
    model_type="gemma4_text", architectures=["Gemma4ForCausalLM"], vocab_size=262144, hidden_size=2816,
    num_hidden_layers=30, num_attention_heads=16, num_key_value_heads=8, head_dim=256, global_head_dim=512,
    num_global_key_value_heads=2, attention_k_eq_v=True, intermediate_size=2112, enable_moe_block=True,
    num_experts=128, top_k_experts=8, moe_intermediate_size=704, hidden_activation="gelu_pytorch_tanh",
    sliding_window=1024, layer_types=_sliding(30, 6), rope_parameters=_GEMMA4_ROPE, final_logit_softcapping=30.0,
    hidden_size_per_layer_input=0, num_kv_shared_layers=0, use_double_wide_mlp=False, rms_norm_eps=1e-6,
    max_position_embeddings=262144, tie_word_embeddings=True, attention_bias=False,
    pad_token_id=0, bos_token_id=2, eos_token_id=[1, 106])
_QWEN3_NEXT_80B = dict(
    model_type="qwen3_next", architectures=["Qwen3NextForCausalLM"], vocab_size=151936, hidden_size=2048,
    num_hidden_layers=48, num_attention_heads=16, num_key_value_heads=2, head_dim=256, intermediate_size=5120,
    num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512, shared_expert_intermediate_size=512,
    norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[], linear_num_key_heads=16,
    linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
    full_attention_interval=4, layer_types=_hybrid(48, 4), hidden_act="silu", rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
    max_position_embeddings=262144, tie_word_embeddings=False, attention_bias=False, eos_token_id=151645)

CONFIGS: dict[str, dict] = {
    "qwen3.5-0.8b": _qwen35(1024, 24, 8, 2, 3584, 16, 16, tied=True),
    "qwen3.5-2b": _qwen35(2048, 24, 8, 2, 6144, 16, 16, tied=True),
    "qwen3.5-4b": _qwen35(2560, 32, 16, 4, 9216, 16, 32, tied=True),
    "qwen3.5-9b": _qwen35(4096, 32, 16, 4, 12288, 16, 32, tied=False),
    "qwen3.5-27b": _qwen35(5120, 64, 24, 4, 17408, 16, 48, tied=False),
    "qwen3.5-35b-a3b": _qwen35_moe(2048, 40, 16, 2, 256, 8, 512, 512, 16, 32),
    "qwen3.5-122b-a10b": _qwen35_moe(3072, 48, 32, 2, 256, 8, 1024, 1024, 16, 64),
    "qwen3.5-397b-a17b": _qwen35_moe(4096, 60, 32, 2, 512, 10, 1024, 1024, 16, 64),
    "qwen3-next-80b-a3b": _QWEN3_NEXT_80B,
    "gemma4-26b-a4b": _GEMMA4_26B,
    # The bundled models' shapes (their config.json), for benchmarks and memory tests on random weights.
    "smollm2-135m": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=49152, hidden_size=576,
                         intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         rms_norm_eps=1e-5, rope_theta=100_000.0, tie_word_embeddings=True, hidden_act="silu",
                         max_position_embeddings=8192, bos_token_id=1, eos_token_id=2),
    "gemma3-270m": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=262144,
                        hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256, sliding_window=512,
                        layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(18)],
                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
                        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True,
                        max_position_embeddings=32768, pad_token_id=0, eos_token_id=1, bos_token_id=2),
    # Tiny configs, one per family: sizes that are not powers of two, hybrids with >= 2 GDN and
    # >= 1 full layer, MoE with >= 8 experts, sliding windows shorter than prompt + generation.
    "tiny-llama": dict(model_type="llama", architectures=["LlamaForCausalLM"], vocab_size=331, hidden_size=72,
                       intermediate_size=136, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                       rms_norm_eps=1e-5, rope_theta=100_000.0, tie_word_embeddings=True,
                       max_position_embeddings=1024, hidden_act="silu"),
    "tiny-gemma3": dict(model_type="gemma3_text", architectures=["Gemma3ForCausalLM"], vocab_size=317,
                        hidden_size=84, intermediate_size=144, num_hidden_layers=4, num_attention_heads=6,
                        num_key_value_heads=2, head_dim=24, query_pre_attn_scalar=24, sliding_window=7,
                        layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}},
                        hidden_activation="gelu_pytorch_tanh", rms_norm_eps=1e-6, tie_word_embeddings=True,
                        max_position_embeddings=1024),
    "tiny-qwen3": dict(model_type="qwen3", architectures=["Qwen3ForCausalLM"], vocab_size=389, hidden_size=88,
                       intermediate_size=152, num_hidden_layers=3, num_attention_heads=6, num_key_value_heads=2,
                       head_dim=20, rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                       tie_word_embeddings=False, max_position_embeddings=1024, hidden_act="silu",
                       attention_bias=False),
    "tiny-qwen3.5": _tiny(_qwen35(96, 6, 6, 2, 176, 3, 6, tied=True), vocab_size=509, head_dim=40,
                          linear_key_head_dim=24, linear_value_head_dim=20, full_attention_interval=3,
                          layer_types=_hybrid(6, 3),
                          rope_parameters=_TINY_QWEN_ROPE),
    "tiny-qwen3.5-moe": _tiny(_qwen35_moe(80, 5, 6, 2, 10, 3, 40, 56, 2, 6), vocab_size=491, head_dim=24,
                              linear_key_head_dim=20, linear_value_head_dim=28, full_attention_interval=3,
                              layer_types=_hybrid(5, 3),
                              rope_parameters=_TINY_QWEN_ROPE),
    # Power-of-two head dims, so the cuda backend's attention and GDN kernels (not the fallback) run.
    "tiny-qwen3.5-moe-p2": _tiny(_qwen35_moe(64, 4, 4, 2, 8, 2, 32, 48, 2, 4), vocab_size=397, head_dim=32,
                                 linear_key_head_dim=16, linear_value_head_dim=32, full_attention_interval=2,
                                 layer_types=_hybrid(4, 2), rope_parameters=_TINY_QWEN_ROPE),
    "tiny-qwen3-next": _tiny(_QWEN3_NEXT_80B, vocab_size=443, hidden_size=72, intermediate_size=120,
                             num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, head_dim=24,
                             num_experts=12, num_experts_per_tok=4, moe_intermediate_size=36,
                             shared_expert_intermediate_size=44, linear_num_key_heads=2, linear_num_value_heads=6,
                             linear_key_head_dim=20, linear_value_head_dim=28, layer_types=_hybrid(4, 4)),
    "tiny-gemma4": _tiny(_GEMMA4_26B, vocab_size=331, hidden_size=88, intermediate_size=152, num_hidden_layers=5,
                         num_attention_heads=6, num_key_value_heads=2, head_dim=24, global_head_dim=40,
                         num_global_key_value_heads=None, attention_k_eq_v=False, enable_moe_block=False,
                         num_experts=None, top_k_experts=None, moe_intermediate_size=None, sliding_window=7,
                         layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                      "sliding_attention", "full_attention"]),
    "tiny-gemma4-moe": _tiny(_GEMMA4_26B, vocab_size=347, hidden_size=72, intermediate_size=104,
                             num_hidden_layers=4, num_attention_heads=6, num_key_value_heads=2, head_dim=24,
                             global_head_dim=56, num_global_key_value_heads=1, num_experts=9, top_k_experts=3,
                             moe_intermediate_size=36, sliding_window=9, layer_types=_sliding(4, 4)),
    # Power-of-two head dims, so Gemma 4's fused q/k/v norm + RoPE + append (and keys as values) runs.
    "tiny-gemma4-moe-p2": _tiny(_GEMMA4_26B, vocab_size=349, hidden_size=64, intermediate_size=96,
                                num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                global_head_dim=64, num_global_key_value_heads=1, num_experts=8, top_k_experts=2,
                                moe_intermediate_size=32, sliding_window=5, layer_types=_sliding(3, 3)),
}


def synth_config(name: str, layers: int | None = None) -> dict:
    """The HF config.json dict of a named configuration, cut to its first `layers` layers."""
    if name not in CONFIGS:
        raise KilnError(f"unknown synthesized model {name!r} (known: {', '.join(CONFIGS)})")
    cfg = copy.deepcopy(CONFIGS[name])
    n = cfg["num_hidden_layers"]
    if layers is None or layers == n:
        return cfg
    if not 1 <= layers <= n:
        raise KilnError(f"{name} has {n} layers: layers must be between 1 and {n}, got {layers}")
    cfg["num_hidden_layers"] = layers
    if "layer_types" in cfg:
        types = cfg["layer_types"] = cfg["layer_types"][:layers]
        # transformers forces Gemma 4's last layer to full attention, and its hybrid cache needs one
        if cfg["model_type"] == "gemma4_text" or "full_attention" not in types:
            types[-1] = "full_attention"
    if "mlp_only_layers" in cfg:
        cfg["mlp_only_layers"] = [i for i in cfg["mlp_only_layers"] if i < layers]
    return cfg


# -- initialisation -------------------------------------------------------------------------------

_NORM = re.compile(r"(^|\.)\w*norm(_\d+)?\.weight$")


def init_rule(config: dict, name: str, shape: tuple[int, ...], norm_offset: bool) -> tuple[str, float, float]:
    """(kind, a, b) for one tensor: "uniform" in [a, b), "log" = log U(a, b), "dt" = softplus^-1 of
    log-uniform in [a, b). Linear weights have variance 1/fan_in (fan_in = last dim), so each
    projection keeps its input's scale; norm scales sit near identity; logits have std ~3. norm_offset:
    the model stores its norm weights zero-centred (applied as 1 + w; never the GDN gated norm's)."""
    mt, leaf, fan_in = config["model_type"], name.rsplit(".", 1)[-1], shape[-1]
    if leaf == "A_log":
        return "log", 1.0, 16.0                       # GDN decay rate A in [1, 16), as HF initialises
    if leaf == "dt_bias":
        return "dt", 1e-3, 1e-1                       # softplus(dt_bias) in [1e-3, 0.1): memory of 3-50+ tokens
    if leaf == "layer_scalar":
        return "uniform", 0.5, 1.0
    if leaf in ("scale", "per_expert_scale"):         # Gemma 4 router scales
        return _around(1.0, 0.1)
    if leaf == "bias":
        return _around(0.0, 0.02)
    if _NORM.search(name):
        gain = 1.0
        if mt == "gemma4_text" and re.search(r"\.[qk]_norm\.weight$", name):
            gain = fan_in ** -0.25                    # Gemma 4 scores are unscaled: keeps q.k std ~1
        elif name == "model.norm.weight" and config.get("tie_word_embeddings"):
            gain = 3.0 / (_embed_std(config) * math.sqrt(fan_in))  # the small tied embedding still gives logits std 3
        offset = norm_offset and ".linear_attn.norm." not in name
        return _around(gain - (1.0 if offset else 0.0), 0.1 * gain)
    if "embed_tokens" in name:
        return _around(0.0, _embed_std(config))
    if name.endswith("lm_head.weight"):
        return _around(0.0, 3.0 / math.sqrt(fan_in))
    if name.endswith("router.proj.weight"):           # Gemma 4: input already scaled by hidden^-0.5
        return _around(0.0, 1.0)
    if len(shape) >= 2:
        return _around(0.0, 1.0 / math.sqrt(fan_in))
    return _around(1.0, 0.1)                          # any other vector: a scale near 1


def _embed_std(config: dict) -> float:
    """Embeddings enter the residual at rms hidden^-1/2 (Gemma scales them up by sqrt(hidden)), as in
    trained models: with tied weights a larger one makes every token predict itself."""
    h = config["hidden_size"]
    return 1.0 / h if config["model_type"].startswith("gemma") else 1.0 / math.sqrt(h)


def _around(mean: float, std: float) -> tuple[str, float, float]:
    """Uniform with this mean and standard deviation."""
    half = math.sqrt(3.0) * std
    return "uniform", mean - half, mean + half


def _seed(seed: int, name: str, block: int, size: int = 8) -> int:
    digest = hashlib.blake2b(f"{seed}\0{name}\0{block}".encode(), digest_size=size).digest()
    return int.from_bytes(digest, "little")


def _key(seed: int, name: str, block: int) -> int:
    """The 128-bit Philox key of a tensor's block."""
    return _seed(seed, name, block, 16)


def _affine(rule: tuple[str, float, float]) -> tuple[np.float32, np.float32]:
    """A uniform rule's (scale, shift) in f32: v = u * scale + shift, u in [0, 1)."""
    _, a, b = rule
    return np.float32(b - a), np.float32(a)


def _draw(rule: tuple[str, float, float], n: int, key: int, out: np.ndarray | None = None) -> torch.Tensor:
    """n values in f32 (into `out`'s first n when given): numpy's Philox stream under `key`, whose
    uniforms are k * 2^-24 (exact), then one affine map, each step one f32 rounding: the same bits on
    any CPU, and on a GPU (kiln/weights/philox.py draws the same stream there)."""
    kind, a, b = rule
    u = np.empty(n, dtype=np.float32) if out is None else out[:n]
    gen = np.random.Generator(np.random.Philox(key=key))
    if kind == "uniform":
        # numpy in place: single-threaded, so WORKERS threads drawing at once do not each fan out
        # over torch's intra-op pool (which oversubscribed the cores); f32 * f32(s) as torch's mul_.
        # In pieces that stay in cache: one pass over memory, not three (the stream runs on across
        # calls, so the values are one call's)
        scale, shift = _affine(rule)
        for i in range(0, n, CACHE_PIECE):
            v = u[i:i + CACHE_PIECE]
            gen.random(dtype=np.float32, out=v)
            np.multiply(v, scale, out=v)
            np.add(v, shift, out=v)
        return torch.from_numpy(u)
    gen.random(dtype=np.float32, out=u)
    u64 = u.astype(np.float64)
    if kind == "log":
        u[:] = np.log(a + (b - a) * u64)
    else:
        dt = np.exp(math.log(a) + (math.log(b) - math.log(a)) * u64)
        u[:] = dt + np.log(-np.expm1(-dt))
    return torch.from_numpy(u)


@dataclass(frozen=True)
class Synthesis:
    """What a synthesized checkpoint draws: its HF config, the model's tensors by name (tied ones left
    out), whether the model stores its norm weights zero-centred, and the seed."""
    config: dict
    shapes: dict[str, tuple[int, ...]]
    norm_offset: bool
    seed: int = 0
    skew: float = 0.0        # routing skew: router rows scaled by rank^-skew (router_scales)

    def rule(self, name: str) -> tuple[str, float, float]:
        return init_rule(self.config, name, self.shapes[name], self.norm_offset)

    def block(self, name: str, i: int, scales: torch.Tensor | None = None,
              out: torch.Tensor | None = None) -> torch.Tensor:
        """Block i of the tensor's flat values (f32, BLOCK of them but the last), drawn into `out`'s
        first values when given (a contiguous f32 CPU tensor); `scales`: its router_scales, which
        blocks() computes once."""
        n = math.prod(self.shapes[name])
        b = _draw(self.rule(name), min(BLOCK, n - i * BLOCK), _key(self.seed, name, i),
                  None if out is None else out.numpy())
        if scales is not None:      # each value times its row's scale (rows of the last dim's width)
            b.mul_(scales[(i * BLOCK + torch.arange(b.numel())) // self.shapes[name][-1]])
        return b

    def block_into(self, name: str, i: int, out: torch.Tensor, scales: torch.Tensor | None = None) -> int:
        """Block i drawn straight into `out` (its first values); how many."""
        return self.block(name, i, scales, out).numel()

    def blocks(self, name: str) -> Iterator[torch.Tensor]:
        """The tensor's values, flat, in f32 blocks of BLOCK elements (drawn on up to WORKERS threads)."""
        n = math.prod(self.shapes[name])
        count = max(1, -(-n // BLOCK))
        scales = router_scales(name, self.shapes[name], self.seed, self.skew)

        def block(i: int) -> torch.Tensor:
            return self.block(name, i, scales)

        if count == 1:
            yield block(0)
            return
        with ThreadPoolExecutor(min(WORKERS, count)) as pool:
            ahead: deque = deque()
            for i in range(count):
                ahead.append(pool.submit(block, i))
                if len(ahead) >= WORKERS:  # bounded look-ahead: memory stays at a few blocks
                    yield ahead.popleft().result()
            while ahead:
                yield ahead.popleft().result()

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The whole tensor, each f32 block rounded to `dtype` as it lands (no full-size f32 copy)."""
        out = torch.empty(math.prod(self.shapes[name]), dtype=dtype)
        at = 0
        for b in self.blocks(name):
            out[at:at + b.numel()] = b
            at += b.numel()
        return out.view(self.shapes[name])


ROUTERS = ("mlp.gate.weight", "router.proj.weight")     # [experts, hidden]: Qwen's and Gemma 4's routers


def router_scales(name: str, shape: tuple[int, ...], seed: int, skew: float) -> torch.Tensor | None:
    """Routing skew for a router's rows: expert e's row scaled by (1 + rank_e)^-skew, the ranks a
    seeded permutation per layer. Random routers route nearly uniformly; a row with a larger scale
    gives its expert logits of a larger spread, so top-k picks it more often: popularity then falls
    with rank, faster with a larger skew (0: uniform, the plain draw). Hit rates are measured, not
    derived from this."""
    if not skew or not name.endswith(ROUTERS) or len(shape) != 2:
        return None
    rank = torch.from_numpy(np.random.Generator(np.random.SFC64(_seed(seed, name, -1))).permutation(shape[0]))
    return (1.0 + rank.to(torch.float32)) ** -skew


# -- the model spec `synth:NAME[:layers=N][:seed=S]` ------------------------------------------------

@dataclass(frozen=True)
class Spec:
    name: str
    layers: int | None = None
    seed: int = 0
    bits: int | None = None      # drawn quantised (MLX affine): projections and embeddings at these bits
    group: int = 64
    router: int | None = None    # MoE routers (mlp.gate, shared_expert_gate) at these bits
    experts: int | None = None   # routed experts at these bits
    skew: float = 0.0            # routing skew (router_scales)


SPEC_USAGE = "synth:NAME[:layers=N][:seed=S][:skew=X][:bits=B[:group=G][:router=B][:experts=B]]"
_SPEC_KEYS = ("layers", "seed", "bits", "group", "router", "experts", "skew")
MAX_SKEW = 8.0


def parse_spec(spec: str) -> Spec:
    prefix, _, rest = str(spec).partition(":")
    parts = rest.split(":")
    if prefix != "synth" or not parts[0]:
        raise KilnError(f"not a synthesized model spec: {spec!r} (use {SPEC_USAGE})")
    synth_config(parts[0])  # unknown names are an error that lists the known ones
    opts: dict = {}
    for opt in parts[1:]:
        key, eq, value = opt.partition("=")
        number = value.replace(".", "", 1).isdigit() if key == "skew" else value.isdigit()
        if key not in _SPEC_KEYS or not eq or not number or key in opts:
            raise KilnError(f"bad option {opt!r} in {spec!r} (use {SPEC_USAGE})")
        opts[key] = float(value) if key == "skew" else int(value)
    if opts.get("skew", 0.0) > MAX_SKEW:
        raise KilnError(f"{spec!r}: skew takes 0 to {MAX_SKEW:g}, got {opts['skew']:g}")
    if "bits" not in opts and opts.keys() & {"group", "router", "experts"}:
        raise KilnError(f"{spec!r}: group, router and experts need bits=B (the quantised draw)")
    for key in ("bits", "router", "experts"):
        if key in opts and opts[key] not in QUANT_BITS:
            raise KilnError(f"{spec!r}: {key} takes bits in {QUANT_BITS}, got {opts[key]}")
    if opts.get("group", 64) not in QUANT_GROUPS:
        raise KilnError(f"{spec!r}: group takes {QUANT_GROUPS}, got {opts['group']}")
    return Spec(parts[0], **opts)


def quant_format(spec: Spec, name: str, shape: tuple[int, ...]) -> tuple[int, int] | None:
    """(bits, group) a quantised draw gives tensor `name`, or None (kept 16-bit): as mlx-lm quantises,
    the Linear and Embedding weights whose input width is a multiple of the group (not norms, not
    conv1d, not the GDN's per-head parameters); the routed expert stacks at `experts` bits, the
    routers at `router` bits."""
    if spec.bits is None or shape[-1] % spec.group:
        return None
    if name.endswith(("experts.gate_up_proj", "experts.down_proj")) and len(shape) == 3:
        return spec.experts or spec.bits, spec.group
    if len(shape) != 2 or not name.endswith(".weight") or "norm" in name or "conv1d" in name:
        return None
    if name.endswith(("mlp.gate.weight", "shared_expert_gate.weight", "router.proj.weight")):
        return spec.router or spec.bits, spec.group
    return spec.bits, spec.group


def quantized_draw(synthesis: Synthesis, name: str, fmt: tuple[int, int], dtype: torch.dtype) -> QuantizedWeight:
    """The tensor drawn as `synthesis.tensor` draws it (rounded to dtype) and quantised block by block
    as it lands: a group never straddles a row (the width is a multiple of it) and its bits fill whole
    words, so groups quantised in flat order are the rows' own (mx.quantize's values, never a full
    16-bit copy). Where a GPU is present the values are drawn and quantised there (_kernel_trips)."""
    bits, group = fmt
    shape = synthesis.shapes[name]
    n = math.prod(shape)
    packed = torch.empty(n * bits // 32, dtype=torch.int32)
    scales, biases = torch.empty(n // group, dtype=dtype), torch.empty(n // group, dtype=dtype)
    router = router_scales(name, shape, synthesis.seed, synthesis.skew)
    gpu = torch.cuda.is_available() and synthesis.rule(name)[0] == "uniform"
    at = 0
    for x in _kernel_trips(synthesis, name, router, "cuda") if gpu else _cpu_trips(synthesis, name, router):
        size = x.numel()
        if at + size > n or size == 0:
            raise KilnError(f"{name}: the draw gave {at + size} of {n} values")
        q = quantize(x.to(dtype).view(-1, group), bits, group)
        g = size // group
        packed[at * bits // 32:(at + size) * bits // 32] = q.packed.reshape(-1)     # (these copies wait for it)
        scales[at // group:at // group + g], biases[at // group:at // group + g] = q.scales[:, 0], q.biases[:, 0]
        at += size
    if at != n:
        raise KilnError(f"{name}: the draw gave {at} of {n} values")
    if gpu:
        del q, x
        torch.cuda.empty_cache()    # the trips' ~1 GB of temporaries: not left reserved past the load
    rows = shape[:-1]
    return QuantizedWeight(packed.view(*rows, -1), scales.view(*rows, -1), biases.view(*rows, -1), bits, group)


def _kernel_trips(synthesis: Synthesis, name: str, router: torch.Tensor | None, device) -> Iterator[torch.Tensor]:
    """A uniform tensor's f32 values on `device` (a GPU; the CPU under Triton's interpreter in tests),
    DRAW_BATCH blocks a trip, drawn there by the Philox kernel (the CPU draw's bits): no host thread
    draws, and nothing crosses PCIe but the quantised result."""
    from . import philox

    n = math.prod(synthesis.shapes[name])
    scale, shift = _affine(synthesis.rule(name))
    count, width = max(1, -(-n // BLOCK)), synthesis.shapes[name][-1]
    router = None if router is None else router.to(device)
    for first in range(0, count, DRAW_BATCH):
        blocks = range(first, min(count, first + DRAW_BATCH))
        x = torch.empty(min(n, (first + len(blocks)) * BLOCK) - first * BLOCK, device=device)
        philox.uniform([_key(synthesis.seed, name, i) for i in blocks], x, BLOCK, scale, shift)
        if router is not None:      # as Synthesis.block scales each value by its row's scale
            x.mul_(router[(first * BLOCK + torch.arange(x.numel(), device=device)) // width])
        yield x


def _cpu_trips(synthesis: Synthesis, name: str, router: torch.Tensor | None) -> Iterator[torch.Tensor]:
    """The tensor's f32 values, DRAW_BATCH blocks a trip, drawn by WORKERS threads straight into one
    of TRIPS_AHEAD + 1 buffers, TRIPS_AHEAD trips ahead of the one being quantised (so up to WORKERS
    blocks draw at once). A trip is quantised before its buffer is drawn into again."""
    n = math.prod(synthesis.shapes[name])
    count, trip = max(1, -(-n // BLOCK)), DRAW_BATCH * BLOCK
    trips = -(-count // DRAW_BATCH)
    bufs = [torch.empty(min(n, trip)) for _ in range(min(TRIPS_AHEAD + 1, trips))]
    with ThreadPoolExecutor(min(WORKERS, count)) as pool:
        def fill(t: int) -> list:
            first, k = t * DRAW_BATCH, t % len(bufs)
            return [pool.submit(synthesis.block_into, name, i, bufs[k][(i - first) * BLOCK:], router)
                    for i in range(first, min(count, first + DRAW_BATCH))]

        pending = deque(fill(t) for t in range(min(len(bufs) - 1, trips) or 1))
        for t in range(trips):
            size = sum(f.result() for f in pending.popleft())
            if t + len(pending) + 1 < trips:
                pending.append(fill(t + len(pending) + 1))
            yield bufs[t % len(bufs)][:size]


def open_synth(spec: str, dtype: torch.dtype = torch.bfloat16) -> Checkpoint:
    """A `Checkpoint` of the spec's config whose tensors are the ones the model declares, drawn when
    loaded (f32; the load casts to its dtype): see Checkpoint.for_model. With bits=B the tensors
    quant_format names are drawn quantised (values rounded to `dtype` first, scales and biases in it)."""
    s = parse_spec(spec)
    config = synth_config(s.name, s.layers)

    def drawn(shapes: dict, norm_offset: bool) -> Checkpoint:
        synthesis = Synthesis(config, shapes, norm_offset, s.seed, s.skew)

        def load(name: str):
            fmt = quant_format(s, name, shapes[name])
            return synthesis.tensor(name) if fmt is None else quantized_draw(synthesis, name, fmt, dtype)

        def locate(name: str):
            return DrawnSpan(synthesis, name) if quant_format(s, name, shapes[name]) is None else None

        return Checkpoint(Path(spec), "synth", config, dict(shapes), load, locator=locate, located=load)

    return Checkpoint(Path(spec), "synth", config, {}, _undeclared, drawn=drawn)


@dataclass(frozen=True)
class DrawnSpan:
    """A drawn tensor's f32 bytes as they are drawn, a block at a time (FileSpan's synthesized twin:
    kiln pack writes them without holding the tensor)."""
    synthesis: Synthesis
    name: str
    dtype: torch.dtype = torch.float32

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.synthesis.shapes[self.name])

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * 4

    def chunks(self) -> Iterator[bytes]:
        for b in self.synthesis.blocks(self.name):
            yield b.contiguous().numpy().tobytes()


def _undeclared(name: str) -> torch.Tensor:
    raise KilnError(f"a synthesized checkpoint draws only the tensors a model declares (asked for {name})")


def random_prompt(n: int, vocab: int, seed: int = 0) -> list[int]:
    """n token ids uniform in [0, vocab), the same for the same (n, vocab, seed) on any machine."""
    return np.random.Generator(np.random.SFC64(_seed(seed, "prompt", n))).integers(0, vocab, n).tolist()


# -- writing an HF folder ------------------------------------------------------------------------

DTYPES = {"bf16": torch.bfloat16, "f32": torch.float32, "f16": torch.float16}
_ST_NAMES = {torch.bfloat16: "BF16", torch.float32: "F32", torch.float16: "F16"}
_HF_NAMES = {torch.bfloat16: "bfloat16", torch.float32: "float32", torch.float16: "float16"}


def plan_shards(shapes: dict[str, tuple[int, ...]], itemsize: int, shard_bytes: int) -> list[list[str]]:
    """Tensors in declaration order, a new shard whenever the next one would overflow `shard_bytes`."""
    shards, size = [[]], 0
    for name, shape in shapes.items():
        nbytes = math.prod(shape) * itemsize
        if shards[-1] and size + nbytes > shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += nbytes
    return shards


def _write_shard(path: Path, names, synthesis: Synthesis, dtype, bar) -> None:
    """A safetensors file written tensor by tensor, block by block: the header first (every size
    is known), then each block's bytes as soon as it is drawn."""
    header, at, shapes = {"__metadata__": {"format": "pt"}}, 0, synthesis.shapes
    for n in names:
        nbytes = math.prod(shapes[n]) * dtype.itemsize
        header[n] = {"dtype": _ST_NAMES[dtype], "shape": list(shapes[n]), "data_offsets": [at, at + nbytes]}
        at += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for n in names:
            for block in synthesis.blocks(n):
                f.write(block.to(dtype).view(torch.uint8).numpy())
                bar.update(block.numel() * dtype.itemsize)


def write_checkpoint(synthesis: Synthesis, out: str | Path, name: str, dtype: str = "bf16",
                     shard_bytes: int = 4 << 30, quiet: bool = False) -> Path:
    """Write the synthesized checkpoint `name` as an HF folder at `out` (which must not exist): built
    in a temporary folder beside it, renamed when complete. Memory stays at a few blocks whatever
    the model's size."""
    config, shapes, seed, dt = synthesis.config, synthesis.shapes, synthesis.seed, DTYPES[dtype]
    out = Path(out).expanduser()
    if out.exists():
        raise KilnError(f"{out} already exists (remove it or choose another folder)")
    if not out.parent.is_dir():
        raise KilnError(f"no such folder: {out.parent}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        shards = plan_shards(shapes, dt.itemsize, shard_bytes)
        total = sum(math.prod(s) for s in shapes.values()) * dt.itemsize
        weight_map = {}
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=f"synth {name}",
                  file=sys.stderr, disable=quiet) as bar:
            for k, names in enumerate(shards):
                file = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
                _write_shard(tmp / file, names, synthesis, dt, bar)
                weight_map.update(dict.fromkeys(names, file))
        index = {"metadata": {"total_size": total, "kiln_synth": {"name": name, "layers": config["num_hidden_layers"],
                                                                 "seed": seed}},
                 "weight_map": weight_map}
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        (tmp / "config.json").write_text(json.dumps(dict(config, dtype=_HF_NAMES[dt]), indent=2))
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
