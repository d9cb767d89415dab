"""Llama (SmolLM2): pre-norm decoder, GQA attention with RoPE, SwiGLU MLP."""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.reference import default_scale, inv_freq
from ..cache import KVCache
from .base import Model, decoder_layer_shapes


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
    norm_style = "llama"

    def __init__(self, cfg, weights, ops):
        super().__init__(cfg, weights, ops)
        self.inv_freq = inv_freq(cfg.head_dim, cfg.rope_theta).to(ops.device)
        self.lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])

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

    def make_state(self, dtype, device):
        c = self.cfg
        return [KVCache(c.num_key_value_heads, c.head_dim, dtype, device) for _ in range(c.num_hidden_layers)]

    def attention(self, i: int, x, positions, cache, rope):
        c, w, ops, p = self.cfg, self.w, self.ops, f"model.layers.{i}.self_attn."
        q = ops.linear(x, w[p + "q_proj.weight"]).view(-1, c.num_attention_heads, c.head_dim)
        k = ops.linear(x, w[p + "k_proj.weight"]).view(-1, c.num_key_value_heads, c.head_dim)
        v = ops.linear(x, w[p + "v_proj.weight"]).view(-1, c.num_key_value_heads, c.head_dim)
        q, k = ops.apply_rope(q, *rope), ops.apply_rope(k, *rope)
        o = ops.attention(q, k, v, cache, positions, default_scale(c.head_dim))
        return ops.linear(o.reshape(x.shape[0], -1), w[p + "o_proj.weight"])

    def forward(self, ids, positions, state, last_only=True):
        c, w, ops = self.cfg, self.w, self.ops
        x = ops.embed(ids, w["model.embed_tokens.weight"])                    # [T, H]
        rope = ops.rope_tables(positions, self.inv_freq, x.dtype)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}."
            h = ops.rmsnorm(x, w[p + "input_layernorm.weight"], c.rms_norm_eps, self.norm_style)
            x = x + self.attention(i, h, positions, state[i], rope)
            h = ops.rmsnorm(x, w[p + "post_attention_layernorm.weight"], c.rms_norm_eps, self.norm_style)
            x = x + ops.gated_mlp(h, w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"],
                                  w[p + "mlp.down_proj.weight"], c.hidden_act)
        if last_only:
            x = x[-1:]  # the LM head only for the rows whose logits are needed
        x = ops.rmsnorm(x, w["model.norm.weight"], c.rms_norm_eps, self.norm_style)
        return ops.logits(x, self.lm_head)
