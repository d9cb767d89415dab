"""Llama (SmolLM2): pre-norm decoder, GQA attention with RoPE, SwiGLU MLP."""

from __future__ import annotations

from dataclasses import dataclass

from .base import (
    Model,
    attention_shapes,
    decoder_layer_shapes,
    gated_mlp_shapes,
    gemms,
    last_rows,
    lm_head_shapes,
    norms,
    per_request,
)
from .rope import default_scale, inv_freq


@dataclass
class LlamaConfig:
    hidden_size: int
    num_hidden_layers: int
    intermediate_size: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_parameters: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"

    def __post_init__(self):
        self.num_key_value_heads = self.num_key_value_heads or self.num_attention_heads
        self.head_dim = self.head_dim or self.hidden_size // self.num_attention_heads
        if self.rope_parameters:  # transformers 5 moves rope_theta here
            self.rope_theta = self.rope_parameters.get("rope_theta", self.rope_theta)


class Llama(Model):
    config_class = LlamaConfig
    several_prompts = True   # prompts prefilled together: per_request slices each one's rows
    norm_style = "llama"
    packed = {"self_attn.qkv_proj.weight": ("self_attn.q_proj.weight", "self_attn.k_proj.weight",
                                            "self_attn.v_proj.weight"),
              "mlp.gate_up_proj.weight": ("mlp.gate_proj.weight", "mlp.up_proj.weight")}
    qk_norm = False          # Qwen3: RMSNorm on q and k per head

    def __init__(self, cfg, weights, ops):
        super().__init__(cfg, weights, ops)
        self.inv_freq = inv_freq(cfg.head_dim, cfg.rope_theta).to(ops.device)
        self.lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
        d = cfg.head_dim
        self.qkv_sizes = [cfg.num_attention_heads * d, cfg.num_key_value_heads * d, cfg.num_key_value_heads * d]

    @classmethod
    def weight_shapes(cls, c):
        h = c.hidden_size
        shapes = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,),
                  "lm_head.weight": (c.vocab_size, h)}
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            layer = {"input_layernorm.weight": (h,), "post_attention_layernorm.weight": (h,), **decoder_layer_shapes(c)}
            shapes.update({p + k: v for k, v in layer.items()})
        return shapes

    @classmethod
    def kernel_shapes(cls, c, rows, contexts):
        h, d, heads, kv = c.hidden_size, c.head_dim, c.num_attention_heads, c.num_key_value_heads
        style = cls.norm_style
        out = gemms(rows, ((heads + 2 * kv) * d, h), (h, heads * d)) + norms(rows, h, style)
        out += gated_mlp_shapes(rows, h, c.intermediate_size, c.hidden_act, style, norm_inside=False)
        if cls.qk_norm:
            out += norms(rows, d, style, per_row=heads) + norms(rows, d, style, per_row=kv)
        out += attention_shapes(rows, contexts, heads, kv, d, d, style if cls.qk_norm else None)
        return out + lm_head_shapes(c.vocab_size, h, style)

    def make_state(self, dtype, device):
        c = self.cfg
        return [self.kv_cache(c.num_key_value_heads, c.head_dim, dtype, device) for _ in range(c.num_hidden_layers)]

    def attention(self, i: int, x, positions, cache, rope):
        c, w, ops, p = self.cfg, self.w, self.ops, f"model.layers.{i}.self_attn."
        t, d = x.shape[0], c.head_dim
        q, k, v = (y.reshape(t, -1, d) for y in ops.linear_split(x, w[p + "qkv_proj.weight"], self.qkv_sizes))
        qn, kn = (w[p + "q_norm.weight"], w[p + "k_norm.weight"]) if self.qk_norm else (None, None)
        o = per_request(cache, lambda s, q, k, v, cos, sin, pos: ops.qk_norm_rope_attention(
            q, k, v, qn, kn, c.rms_norm_eps, self.norm_style, (cos, sin), s, pos, default_scale(d)),
            q, k, v, *rope, positions,
            whole=lambda s, q, k, v, cos, sin, pos: ops.qk_norm_rope_attention_rows(
                q, k, v, qn, kn, c.rms_norm_eps, self.norm_style, (cos, sin), s, pos, default_scale(d)))
        return ops.linear(o.reshape(t, -1), w[p + "o_proj.weight"])

    def forward(self, ids, positions, state, last_only=True):
        c, w, ops = self.cfg, self.w, self.ops
        x = ops.embed(ids, w["model.embed_tokens.weight"])                    # [T, H]
        rope = ops.rope_tables(positions, self.inv_freq, x.dtype)
        eps, style, n = c.rms_norm_eps, self.norm_style, c.num_hidden_layers
        h = ops.rmsnorm(x, w["model.layers.0.input_layernorm.weight"], eps, style)
        for i in range(n):
            p = f"model.layers.{i}."
            a = self.attention(i, h, positions, state[i], rope)
            # each residual add fused into the norm that follows it (bit-equal: the sum is rounded first)
            x, h = ops.add_rmsnorm(x, a, w[p + "post_attention_layernorm.weight"], eps, style)
            m = ops.gated_mlp(h, w[p + "mlp.gate_up_proj.weight"], w[p + "mlp.down_proj.weight"], c.hidden_act)
            if i + 1 < n:
                x, h = ops.add_rmsnorm(x, m, w[f"model.layers.{i + 1}.input_layernorm.weight"], eps, style)
            self.layer_done()
        # the LM head only for the rows whose logits are needed
        x, m = last_rows(x, last_only), last_rows(m, last_only)
        return ops.logits(ops.add_rmsnorm(x, m, w["model.norm.weight"], eps, style)[1], self.lm_head)
