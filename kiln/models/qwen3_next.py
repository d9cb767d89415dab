"""Qwen3-Next: the Qwen3.5-MoE layout with Gated DeltaNet projections packed per key head
(`in_proj_qkvz`, `in_proj_ba`), `norm_topk_prob`, and dense MLPs where `decoder_sparse_step` /
`mlp_only_layers` say so."""

from __future__ import annotations

import torch

from .base import gemms
from .qwen3_5_moe import Qwen35Moe


class Qwen3Next(Qwen35Moe):
    @staticmethod
    def sparse_layer(c, layer: int) -> bool:
        return layer not in c.mlp_only_layers and c.num_experts > 0 and (layer + 1) % c.decoder_sparse_step == 0

    @classmethod
    def gdn_shapes(cls, c):
        shapes = super().gdn_shapes(c)
        hk, hv, dk, dv = cls.gdn_dims(c)
        h, p = c.hidden_size, "linear_attn."
        for n in ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight"):
            del shapes[p + n]
        shapes[p + "in_proj_qkvz.weight"] = (2 * hk * dk + 2 * hv * dv, h)
        shapes[p + "in_proj_ba.weight"] = (2 * hv, h)
        return shapes

    @classmethod
    def gdn_projection_shapes(cls, c, rows) -> list:
        hk, hv, dk, dv = cls.gdn_dims(c)
        h = c.hidden_size
        return gemms(rows, (2 * hk * dk + 2 * hv * dv, h), (2 * hv, h), (h, hv * dv))

    def mixer_input(self, i, h):
        """GDN layers: unpack [q_j | k_j | v_group_j | z_group_j] per key head j into Qwen3.5's
        (q|k|v, z, b, a)."""
        if self.cfg.layer_types[i] != "linear_attention":
            return super().mixer_input(i, h)
        hk, hv, dk, dv = self.gdn_dims(self.cfg)
        t, r, p = h.shape[0], hv // hk, f"model.layers.{i}.linear_attn."
        qkvz = self.ops.linear(h, self.w[p + "in_proj_qkvz.weight"]).view(t, hk, -1)
        q, k, v, z = qkvz.split([dk, dk, r * dv, r * dv], dim=-1)
        b, a = self.ops.linear(h, self.w[p + "in_proj_ba.weight"]).view(t, hk, 2 * r).split([r, r], dim=-1)
        qkv = (q.reshape(t, -1), k.reshape(t, -1), v.reshape(t, -1))
        return torch.cat(qkv, dim=-1), z.reshape(t, -1), b.reshape(t, hv), a.reshape(t, hv)
