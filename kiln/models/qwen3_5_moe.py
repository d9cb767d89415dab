"""Qwen3.5-MoE text: the Qwen3.5 hybrid with a sparse MoE block in every layer (softmax router,
top-k, renormalised weights, experts stored fused [E, 2I, H] / [E, H, I], and a shared expert
scaled by a sigmoid gate)."""

from __future__ import annotations

from .base import fuse_experts, gated_mlp_shapes, gemms, kernel, stacks_to_fused
from .qwen3_5 import Qwen35, undo_mlx_sanitize


class Qwen35Moe(Qwen35):
    packed = {**Qwen35.packed,
              "mlp.shared_expert.gate_up_proj.weight": ("mlp.shared_expert.gate_proj.weight",
                                                        "mlp.shared_expert.up_proj.weight")}
    norm_in_next_gemv = False   # its MLP is the MoE block: the norms run on their own kernel

    @classmethod
    def sanitize(cls, ckpt):
        # checkpoints store experts one by one, fused, or (mlx-lm) as switch_mlp stacks; models use fused
        return undo_mlx_sanitize(stacks_to_fused(fuse_experts(ckpt), "mlp.switch_mlp.", "mlp.experts."))

    def is_sparse(self, layer: int) -> bool:
        return self.sparse_layer(self.cfg, layer)

    @staticmethod
    def sparse_layer(c, layer: int) -> bool:
        return True

    @classmethod
    def mlp_shapes(cls, c, layer: int):
        if not cls.sparse_layer(c, layer):
            return super().mlp_shapes(c, layer)
        h, e, f, s = c.hidden_size, c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
        return {"mlp.gate.weight": (e, h), "mlp.experts.gate_up_proj": (e, 2 * f, h),
                "mlp.experts.down_proj": (e, h, f), "mlp.shared_expert.gate_proj.weight": (s, h),
                "mlp.shared_expert.up_proj.weight": (s, h), "mlp.shared_expert.down_proj.weight": (h, s),
                "mlp.shared_expert_gate.weight": (1, h)}

    @classmethod
    def mlp_kernel_shapes(cls, c, layer: int, rows) -> list:
        """The router's logits, the routed experts, the shared expert as a gated MLP (its sigmoid gate
        [1, H] runs inside the experts' combine: no GEMM of its own)."""
        if not cls.sparse_layer(c, layer):
            return super().mlp_kernel_shapes(c, layer, rows)
        h, e = c.hidden_size, c.num_experts
        shared = gated_mlp_shapes(rows, h, c.shared_expert_intermediate_size, c.hidden_act, cls.norm_style,
                                  norm_inside=False)
        return gemms(rows, (e, h)) + shared + [kernel("moe", rows=m, e=e, k=c.num_experts_per_tok, h=h,
                                                      i=c.moe_intermediate_size, act=c.hidden_act) for m in rows]

    def mlp(self, i, x):
        if not self.is_sparse(i):
            return super().mlp(i, x)
        c, w, ops, p = self.cfg, self.w, self.ops, f"model.layers.{i}.mlp."
        # at decode the shared expert runs beside the router and the routed experts (joined before their combine)
        shared = ops.fork(lambda: ops.gated_mlp(x, w[p + "shared_expert.gate_up_proj.weight"],
                                                w[p + "shared_expert.down_proj.weight"], c.hidden_act), x)
        weights, idx = ops.router_linear_topk(x, w[p + "gate.weight"], c.num_experts_per_tok, c.norm_topk_prob)
        # streamed experts: their misses' read starts here and overlaps the shared expert
        ops.moe_prefetch(idx, w[p + "experts.gate_up_proj"], w[p + "experts.down_proj"])
        return ops.moe_experts_gated(x, idx, weights, w[p + "experts.gate_up_proj"], w[p + "experts.down_proj"],
                                     c.hidden_act, w[p + "shared_expert_gate.weight"], shared)
