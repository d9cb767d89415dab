"""Qwen3 dense: Llama's layout plus RMSNorm on q and k per head (Llama-style rounding)."""

from __future__ import annotations

from dataclasses import dataclass

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
    qk_norm = True

    @classmethod
    def weight_shapes(cls, c):
        shapes = super().weight_shapes(c)
        for i in range(c.num_hidden_layers):
            p = f"model.layers.{i}.self_attn."
            shapes[p + "q_norm.weight"] = shapes[p + "k_norm.weight"] = (c.head_dim,)
        return shapes
