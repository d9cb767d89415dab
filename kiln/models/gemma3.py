"""Gemma 3 text: sandwich norms with (1 + w), q/k norm, 5:1 sliding/global layers, GeGLU MLP,
embeddings scaled by sqrt(hidden). Sliding layers keep a ring of `sliding_window` positions."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..cache import RingKVCache
from .base import (
    Model,
    decoder_layer_shapes,
    gated_mlp_shapes,
    gemms,
    last_rows,
    lm_head_shapes,
    norms,
    per_request,
)
from .rope import inv_freq


@dataclass
class Gemma3Config:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int = 1
    head_dim: int = 256
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_local_base_freq: float = 10_000.0
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None
    sliding_window: int = 4096
    sliding_window_pattern: int = 6
    layer_types: list = field(default_factory=list)
    query_pre_attn_scalar: float = 256
    final_logit_softcapping: float | None = None
    attn_logit_softcapping: float | None = None
    hidden_activation: str = "gelu_pytorch_tanh"
    max_position_embeddings: int = 32768
    tie_word_embeddings: bool = True

    def __post_init__(self):
        if not self.layer_types:
            n = self.sliding_window_pattern
            self.layer_types = ["full_attention" if (i + 1) % n == 0 else "sliding_attention"
                                for i in range(self.num_hidden_layers)]
        rp = self.rope_parameters or {}
        full, local = rp.get("full_attention", {}), rp.get("sliding_attention", {})
        self.rope_theta = full.get("rope_theta", self.rope_theta)
        self.rope_local_base_freq = local.get("rope_theta", self.rope_local_base_freq)
        if full.get("rope_type") == "linear":
            self.rope_scaling = {"rope_type": "linear", "factor": full["factor"]}


class Gemma3(Model):
    config_class = Gemma3Config
    several_prompts = True   # prompts prefilled together: per_request slices each one's rows
    norm_style = "offset"
    packed = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                            "self_attn.v_proj.weight"),
              "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}

    def __init__(self, cfg, weights, ops):
        super().__init__(cfg, weights, ops)
        c = cfg
        scaling = c.rope_scaling or {}
        factor = scaling.get("factor", 1.0) if scaling.get("rope_type", scaling.get("type")) == "linear" else 1.0
        self.inv_freq = {
            "full_attention": inv_freq(c.head_dim, c.rope_theta, factor).to(ops.device),
            "sliding_attention": inv_freq(c.head_dim, c.rope_local_base_freq).to(ops.device),
        }
        self.lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        d = c.head_dim
        self.qkv_sizes = [c.num_attention_heads * d, c.num_key_value_heads * d, c.num_key_value_heads * d]

    @classmethod
    def weight_shapes(cls, c):
        h, d = c.hidden_size, c.head_dim
        shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,),
                  "lm_head.weight": (c.vocab_size, h)}
        norms = ("input_layernorm", "post_attention_layernorm", "pre_feedforward_layernorm",
                 "post_feedforward_layernorm")
        qk_norms = {"self_attn.q_norm.weight": (d,), "self_attn.k_norm.weight": (d,)}
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            layer = {**{n + ".weight": (h,) for n in norms}, **decoder_layer_shapes(c, qk_norms)}
            shapes.update({p + k: v for k, v in layer.items()})
        return shapes

    @classmethod
    def kernel_shapes(cls, c, rows, contexts):
        """Projections and norms; attention is left at each kernel's default (sliding layers keep a
        ring on the reference backend, and the window differs between layer kinds)."""
        h, d, heads, kv, style = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads, cls.norm_style
        out = gemms(rows, ((heads + 2 * kv) * d, h), (h, heads * d)) + norms(rows, h, style)
        out += norms(rows, d, style, per_row=heads) + norms(rows, d, style, per_row=kv)
        out += gated_mlp_shapes(rows, h, c.intermediate_size, c.hidden_activation, style, norm_inside=False)
        return out + lm_head_shapes(c.vocab_size, h, style)

    def make_state(self, dtype, device):
        """Sliding layers keep a ring of the window, or, on a backend whose attention masks the window
        itself over a fixed buffer (`ops.static_windows`: cuda, for CUDA graphs; cpu), a plain cache."""
        c = self.cfg
        ring = not getattr(self.ops, "static_windows", False)
        kv, d = c.num_key_value_heads, c.head_dim
        return [RingKVCache(kv, d, c.sliding_window, dtype, device)
                if t == "sliding_attention" and ring else self.kv_cache(kv, d, dtype, device, self._window(t))
                for t in c.layer_types]

    def _window(self, kind: str) -> int | None:
        return self.cfg.sliding_window if kind == "sliding_attention" else None

    def attention(self, i, x, positions, cache, ropes):
        c, w, ops, p, style = self.cfg, self.w, self.ops, f"model.layers.{i}.self_attn.", self.norm_style
        kind = c.layer_types[i]
        q, k, v = (y.view(-1, n, c.head_dim) for y, n in zip(
            ops.linear_split(x, w[p + "qkv_proj.weight"], self.qkv_sizes),
            (c.num_attention_heads, c.num_key_value_heads, c.num_key_value_heads)))
        q = ops.apply_rope(ops.rmsnorm(q, w[p + "q_norm.weight"], c.rms_norm_eps, style), *ropes[kind])
        k = ops.apply_rope(ops.rmsnorm(k, w[p + "k_norm.weight"], c.rms_norm_eps, style), *ropes[kind])
        window = c.sliding_window if kind == "sliding_attention" else None
        o = per_request(cache, lambda s, q, k, v, pos: ops.attention(
            q, k, v, s, pos, c.query_pre_attn_scalar ** -0.5, window, c.attn_logit_softcapping), q, k, v, positions)
        return ops.linear(o.reshape(x.shape[0], -1), w[p + "o_proj.weight"])

    def forward(self, ids, positions, state, last_only=True):
        c, w, ops, eps, style = self.cfg, self.w, self.ops, self.cfg.rms_norm_eps, self.norm_style
        x = ops.embed(ids, w["model.embed_tokens.weight"], scale=c.hidden_size ** 0.5)
        ropes = {k: ops.rope_tables(positions, f, x.dtype) for k, f in self.inv_freq.items()}
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            h = ops.rmsnorm(x, w[p + "input_layernorm.weight"], eps, style)
            h = self.attention(i, h, positions, state[i], ropes)
            x = x + ops.rmsnorm(h, w[p + "post_attention_layernorm.weight"], eps, style)
            h = ops.rmsnorm(x, w[p + "pre_feedforward_layernorm.weight"], eps, style)
            h = ops.gated_mlp(h, w[p + "mlp.gate_up_proj.weight"], w[p + "mlp.down_proj.weight"], c.hidden_activation)
            x = x + ops.rmsnorm(h, w[p + "post_feedforward_layernorm.weight"], eps, style)
            self.layer_done()
        x = ops.rmsnorm(last_rows(x, last_only), w["model.norm.weight"], eps, style)
        return ops.logits(x, self.lm_head, c.final_logit_softcapping)
