"""Mixture of experts, the reference: routers (softmax top-k; Gemma 4's scaled router), the routed
experts in ascending id as HF adds them, and Qwen's sigmoid-gated shared expert."""

from __future__ import annotations

import torch

from ...weights.experts import ExpertStack
from ..fork import join
from ..gemm.reference import ACTIVATIONS


class MoeReference:
    """Needs the projections and the norms beside it (linear, rmsnorm_noscale)."""

    def moe_experts(self, x, idx, weights, gate_up, down, act: str) -> torch.Tensor:
        """Routed experts: x [T, H]; idx/weights [T, k]; gate_up [E, 2I, H] (gate rows first);
        down [E, H, I]. Each chosen expert's output, times its weight, is added into a zero buffer
        in the activation dtype, experts in ascending id, as HF's experts module does. Streamed stacks
        (ExpertStack) go through their store, which adds the same way from its slots."""
        if isinstance(gate_up, ExpertStack):
            return gate_up.store.moe(self, x, idx, weights, gate_up, down, act)
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            self.expert_add(out, x, tok, slot, weights, gate_up[e], down[e], act)
        return out

    def moe_prefetch(self, idx, gate_up, down) -> None:
        """Streamed experts: start reading idx's misses now (ExpertStore.prefetch), so that the work
        queued before moe_experts overlaps the read; nothing for resident experts. Changes no value."""
        if isinstance(gate_up, ExpertStack):
            gate_up.store.prefetch(self, idx, gate_up, down)

    def stage_ahead(self, idx, table, host):
        """A backend's staging of idx's misses into device scratch, started ahead of moe_from_slots
        (whose `staged` it becomes); None here: the store's expert-by-expert path reads them itself."""
        return None

    def moe_from_slots(self, x, idx, rows, weights, gate_up, down, act: str, gate=None, host=None, table=None,
                       staged=None):
        """Streamed experts all in slots (rows: each pair's slot), or with `host` read in place from
        host stacks where a row is negative: a backend's resident kernels, or None, as here, for the
        store's expert-by-expert path (expert_add)."""
        return None

    def expert_add(self, out, x, tok, slot, weights, gate_up_e, down_e, act: str) -> None:
        """One expert's output on its rows `tok` (routing slot `slot`), times its weight, added into out."""
        out.index_add_(0, tok, self.expert_out(x, tok, slot, weights, gate_up_e, down_e, act).to(out.dtype))

    def expert_out(self, x, tok, slot, weights, gate_up_e, down_e, act: str) -> torch.Tensor:
        """One expert's weighted output on its rows (expert_add before the add: computed in any order,
        added in id order)."""
        gate, up = self.linear(x[tok], gate_up_e).chunk(2, dim=-1)
        return self.linear(ACTIVATIONS[act](gate) * up, down_e) * weights[tok, slot, None]

    def pairs_apply(self, x, gate_up, down, act: str) -> bool:
        """Whether a streamed prefill's batches go through slot_pairs and moe_combine (a backend with
        grouped kernels); here not: the store computes and adds expert by expert (expert_out)."""
        return False

    def slot_pairs(self, x, idx, weights, where: dict, gate_up, down, act: str, y) -> None:
        """Each (token, slot) pair of idx whose expert is in `where` (expert id -> its slot of the slot
        stacks): its weighted output into y [T*k, H] (pair order), for moe_combine to add."""
        k = idx.shape[1]
        for e in sorted(where):
            tok, slot = torch.where(idx == e)
            if tok.numel():
                y[tok * k + slot] = self.expert_out(x, tok, slot, weights, gate_up[where[e]], down[where[e]],
                                                    act).to(y.dtype)

    def moe_combine(self, y, idx, x, gate=None) -> torch.Tensor:
        """The per-pair outputs y [T*k, H] added per token in expert id order, as moe_experts adds them
        (plus Qwen's gated shared expert, gate = (gate_w, shared))."""
        out, k = torch.zeros_like(x), idx.shape[1]
        for e in torch.unique(idx).tolist():
            tok, slot = torch.where(idx == e)
            out.index_add_(0, tok, y[tok * k + slot].to(out.dtype))
        return out if gate is None else self.shared_gate_add(out, x, gate[0], join(gate[1]))

    def shared_gate_add(self, routed, x, gate_w, shared) -> torch.Tensor:
        """Qwen's shared expert, scaled by a sigmoid gate [1, H] and added to the routed experts."""
        return routed + self.linear(x, gate_w).sigmoid() * shared

    def moe_experts_gated(self, x, idx, weights, gate_up, down, act: str, gate_w, shared) -> torch.Tensor:
        """The routed experts plus the sigmoid-gated shared expert (Qwen's sparse MoE block output);
        shared may be a fork's (kiln/ops/fork.py), joined here."""
        shared = join(shared)
        if isinstance(gate_up, ExpertStack):
            return gate_up.store.moe(self, x, idx, weights, gate_up, down, act, gate=(gate_w, shared))
        return self.shared_gate_add(self.moe_experts(x, idx, weights, gate_up, down, act), x, gate_w, shared)

    def router_topk(self, logits: torch.Tensor, k: int, renormalize: bool = True):
        """Softmax in f32, top-k, optional renormalisation in f32, weights cast back to the logits dtype."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, idx = torch.topk(probs, k, dim=-1)
        if renormalize:
            top = top / top.sum(dim=-1, keepdim=True)
        return top.to(logits.dtype), idx

    def scaled_topk(self, logits, expert_scale, k: int):
        """Gemma 4's router after its projection (whose input, rmsnorm(x) * scale * H^-0.5, is one of
        residual_norms' outputs): softmax, top-k and renormalisation in f32, times per_expert_scale[idx].
        The weights stay f32 (the expert outputs are multiplied by them in f32, then rounded)."""
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        top, idx = torch.topk(probs, k, dim=-1)
        top = top / top.sum(dim=-1, keepdim=True)
        return top * expert_scale[idx], idx

    def router_linear_topk(self, x, proj, k: int, renormalize: bool = True):
        """Qwen's whole router: router_topk of the projection linear(x, proj) (rounded to x's dtype)."""
        return self.router_topk(self.linear(x, proj), k, renormalize)

    def router_scaled_topk(self, x, proj, expert_scale, k: int):
        """Gemma 4's whole router: scaled_topk of the projection linear(x, proj) (rounded to x's dtype)."""
        return self.scaled_topk(self.linear(x, proj), expert_scale, k)
