"""Qwen3 dense: Llama's layout plus RMSNorm on q and k per head (Llama-style rounding)."""

from __future__ import annotations

from dataclasses import dataclass

from ..backends.reference import default_scale
from ..errors import KilnError
from .llama import Llama, LlamaConfig


@dataclass
class Qwen3Config(LlamaConfig):
    attention_bias: bool = False
    use_sliding_window: bool = False

    def __post_init__(self):
        super().__post_init__()
        if self.attention_bias or self.use_sliding_window:
            raise KilnError("Qwen3 with attention_bias or use_sliding_window is not supported")


class Qwen3(Llama):
    config_class = Qwen3Config

    @classmethod
    def weight_shapes(cls, c):
        shapes = super().weight_shapes(c)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}.self_attn."
            shapes[p + "q_norm.weight"] = shapes[p + "k_norm.weight"] = (c.head_dim,)
        return shapes

    def attention(self, i, x, positions, cache, rope):
        c, w, ops, p = self.cfg, self.w, self.ops, f"model.layers.{i}.self_attn."
        t, d, eps = x.shape[0], c.head_dim, c.rms_norm_eps
        q, k, v = (y.reshape(t, -1, d) for y in ops.linear_split(x, [w[p + f"{n}_proj.weight"] for n in "qkv"]))
        o = ops.qk_norm_rope_attention(q, k, v, w[p + "q_norm.weight"], w[p + "k_norm.weight"], eps, "llama", rope,
                                       cache, positions, default_scale(d))
        return ops.linear(o.reshape(t, -1), w[p + "o_proj.weight"])
