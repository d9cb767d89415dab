"""Mixture of experts on the cuda backend: the router's top-k, the routed experts (grouped GEMM or
GEMV), their combine with Qwen's gated shared expert; a graph-safe gather for one token where the
kernels do not apply, the reference elsewhere."""

from __future__ import annotations

import os

import torch

from ...errors import KilnError
from ...weights.experts import ExpertStack
from ...weights.quantized import QuantizedWeight, dequantize
from ..dispatch import TunedOps
from ..fork import Forked, join, peek
from ..gemm.reference import ACTIVATIONS
from ..quant import embed
from ..quant import grouped as qgrouped
from ..quant.cuda import GEMV_ROWS, dequantised_stacks, expert_bytes, experts_in, gathered_stacks, quant_moe, stack_room
from . import kernels, router, staging
from .reference import MoeReference

# pairs an expert (on average) from which a prefill chunk's quantised experts go through dequantised
# copies instead of packed; None: never. Packed was faster at every length measured (35B-A3B 4-bit,
# H100, bench/NOTES.md 2026-12-05: 64 to 4,096 tokens, 2 to 128 pairs an expert, 1.7x to 3.9x)
COPIES_FROM: int | None = None


def streamed(*ws) -> bool:
    return any(isinstance(w, ExpertStack) for w in ws)


def dense(*ws) -> bool:
    """No quantised weight among ws: the MoE kernels take 16-bit experts; quantised ones run the quant
    family's routed GEMVs (quant_moe) or, where those do not fit, the reference."""
    return all(isinstance(w, torch.Tensor) for w in ws)


class MoeCuda(TunedOps, MoeReference):
    slot_kernels = True       # streamed experts: moe_from_slots runs the resident decode kernels
    mapped_rows = GEMV_ROWS   # ... and up to this many rows reads host experts in place (zero-copy)
    dense_routers = True      # a quantised router or shared-expert gate also kept dense (_dense): memory_plan

    def _dense(self, w):
        """A quantised router or shared-expert gate ([experts or 1, H]: a few MB at most) as the dense
        weight the reference computes with (dequantize, mx.dequantize's values), made once and kept:
        the one-launch router and the combine's gate take dense weights, and on the quantised ones Qwen's
        gate ran as four launches a layer (a GEMV, sigmoid, product, sum) beside the fused experts."""
        if not isinstance(w, QuantizedWeight):
            return w
        kept = self.__dict__.setdefault("_dense_weights", {})
        hit = kept.get(id(w))
        if hit is None or hit[0] is not w:      # (the weight itself is kept: its id is never reused)
            hit = kept[id(w)] = (w, dequantize(w))
            if hit[1].is_cuda and not torch.cuda.is_current_stream_capturing():
                # the fused router loads its weight before its PDL wait (weights are never written):
                # this one was written by the kernel just before, so it must be done first (once a weight)
                torch.cuda.current_stream(hit[1].device).synchronize()
        return hit[1]

    def _gate(self, gate_w):
        """Qwen's shared-expert gate [1, H], dense (_dense) when quantised."""
        if isinstance(gate_w, QuantizedWeight) and len(gate_w.shape) == 2 and gate_w.shape[0] == 1:
            return self._dense(gate_w)
        return gate_w

    def _router(self, x, proj):
        """proj dense where the fused router would then run (decode's few rows), else as it is."""
        if (isinstance(proj, QuantizedWeight) and x.dim() == 2 and 0 < x.shape[0] <= router.FUSED_ROWS
                and len(proj.shape) == 2 and proj.shape[0] <= router.MAX_EXPERTS
                and proj.shape[1] <= router.FUSED_WIDTH and self.on("moe", x)):
            return self._dense(proj)
        return proj

    def router_topk(self, logits, k, renormalize=True):
        if (self.on("moe", logits) and logits.dim() == 2 and logits.dtype in kernels.SUPPORTED
                and logits.shape[1] <= router.MAX_EXPERTS and k <= logits.shape[1]):
            return router.router_topk(logits, k, renormalize)
        return super().router_topk(logits, k, renormalize)

    def scaled_topk(self, logits, expert_scale, k):
        if self.on("moe", logits) and router.supports(logits, expert_scale, k):
            return router.scaled_topk(logits, expert_scale, k)
        return super().scaled_topk(logits, expert_scale, k)

    def router_linear_topk(self, x, proj, k, renormalize=True):
        proj = self._router(x, proj)
        if self.on("moe", x) and router.fused_supports(x, proj, None, k):
            return router.router_linear_topk(x, proj, k, renormalize)
        return super().router_linear_topk(x, proj, k, renormalize)

    def router_scaled_topk(self, x, proj, expert_scale, k):
        proj = self._router(x, proj)
        if self.on("moe", x) and router.fused_supports(x, proj, expert_scale, k):
            return router.router_scaled_topk(x, proj, expert_scale, k)
        return super().router_scaled_topk(x, proj, expert_scale, k)

    def shared_gate_add(self, routed, x, gate_w, shared):
        gate_w = self._gate(gate_w)
        if (self.on("moe", x) and dense(gate_w) and x.dim() == 2 and gate_w.shape[0] == 1
                and x.dtype in kernels.SUPPORTED and routed.dtype == shared.dtype == gate_w.dtype == x.dtype
                and routed.shape == shared.shape == x.shape):
            return kernels.shared_gate_add(routed, x, gate_w, shared)
        return super().shared_gate_add(routed, x, gate_w, shared)

    def moe_experts_gated(self, x, idx, weights, gate_up, down, act, gate_w, shared):
        """The routed experts' combine also adds sigmoid(x . gate_w) * shared (one launch fewer).
        Streamed experts: their store's per-expert path (not yet the fused kernels). A forked shared
        expert (kiln/ops/fork.py) is joined as late as the path allows: just before the combine that
        reads it where the kernels run, else first. A quantised gate (mlx-lm keeps it at 8 bits) runs
        dense (_dense), so its combine is the fused one."""
        gate_w = self._gate(gate_w)
        if streamed(gate_up, down):
            return gate_up.store.moe(self, x, idx, weights, gate_up, down, act, gate=(gate_w, join(shared)))
        if not dense(gate_up, down):
            if (dense(gate_w) and gate_w.shape[0] == 1 and peek(shared).shape == x.shape
                    and (y := quant_moe(self, x, idx, weights, gate_up, down, act, (gate_w, shared))) is not None):
                return y
            if (y := self._packed(x, idx, weights, gate_up, down, act, (gate_w, shared))) is not None:
                return y
            if (y := self._in_batches(x, idx, weights, gate_up, down, act, (gate_w, shared))) is not None:
                return y
            gate_up, down = self._dequantised(x, gate_up, down)
        s = peek(shared)
        if (self.on("moe", x) and dense(gate_up, down, gate_w) and kernels.supports(x, gate_up, down, act)
                and gate_w.shape[0] == 1
                and gate_w.dtype == s.dtype == x.dtype and s.shape == x.shape and x.dim() == 2):
            v = self.choose(kernels.OP, self._moe_shape(x, idx, gate_up, down, act))
            if (isinstance(shared, Forked) and (v.p.get("gemv") or v.p.get("pairs")) and not v.p.get("fin")
                    and x.shape[0] > 0):
                return self._gemv_then_gated_combine(x, idx, weights, gate_up, down, act, v, gate_w, shared)
            return kernels.moe_experts(x, idx, weights, gate_up, down, act, v=v, gate=(gate_w, join(shared)))
        return super().moe_experts_gated(x, idx, weights, gate_up, down, act, gate_w, join(shared))

    @staticmethod
    def _gemv_then_gated_combine(x, idx, weights, gate_up, down, act, v, gate_w, forked):
        """kernels.moe_experts with GEMV or pair form v (not fin), the fork joined between the routed
        GEMVs and the combine that reads it."""
        x, idx, weights = x.contiguous(), idx.contiguous(), weights.contiguous()
        y = torch.empty((idx.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
        kernels.routed(x, idx, weights, gate_up, down, act, v.p, y)
        out = torch.empty_like(x)
        kernels.combine(y, idx, out, x, (gate_w, forked.join()))
        return out

    def moe_experts(self, x, idx, weights, gate_up, down, act):
        if streamed(gate_up, down):
            return super().moe_experts(x, idx, weights, gate_up, down, act)
        if not dense(gate_up, down):
            y = quant_moe(self, x, idx, weights, gate_up, down, act)
            if y is not None:
                return y
            if (y := self._packed(x, idx, weights, gate_up, down, act)) is not None:
                return y
            if (y := self._in_batches(x, idx, weights, gate_up, down, act)) is not None:
                return y
            gate_up, down = self._dequantised(x, gate_up, down)
            if not dense(gate_up, down) and x.shape[0] == 1 and x.device.type == "cuda":
                return self._moe_one_token(x, idx, weights, gate_up, down, act)     # a graph can hold it
            if not dense(gate_up, down):
                return super().moe_experts(x, idx, weights, gate_up, down, act)
        if self.on("moe", x) and kernels.supports(x, gate_up, down, act):
            v = self.choose(kernels.OP, self._moe_shape(x, idx, gate_up, down, act))
            return kernels.moe_experts(x, idx, weights, gate_up, down, act, v=v)
        if x.shape[0] == 1 and x.device.type == "cuda":
            return self._moe_one_token(x, idx, weights, gate_up, down, act)
        return super().moe_experts(x, idx, weights, gate_up, down, act)

    def moe_from_slots(self, x, idx, rows, weights, gate_up, down, act, gate=None, host=None, table=None,
                       staged=None):
        """Streamed experts whose every needed one sits in a slot (or, with `host`, the gate_up and down
        stacks in mapped host memory: a negative row r names their row -1 - r): the resident decode's
        kernels, the weights read from slot rows[pair] (quant_moe), the combine in expert id order.
        With `table` (expert -> slot, or -1 - its row of the host stacks) instead of rows: the misses
        copied from host memory into device scratch by one kernel first (staging.stage; KILN_STAGE_MISSES=0: read in
        place by the GEMVs). `staged`: stage_ahead's result for idx (the copy on a side stream, joined here).
        None where those kernels do not apply (the store then adds expert by expert)."""
        if staged is not None:
            rows, scratch, side = staged
            if side is not None:
                torch.cuda.current_stream(idx.device).wait_stream(side)
            table, host = None, scratch
        if gate is not None and not (dense(gate[0]) and gate[0].shape[0] == 1 and gate[1].shape == x.shape):
            return None
        if table is not None:
            staged = self._stage_misses(idx, table, host) if os.environ.get("KILN_STAGE_MISSES", "1") != "0" else None
            rows, host = staged if staged is not None else (table[idx], host)
        return quant_moe(self, x, idx, weights, gate_up, down, act, gate, rows=rows, host=host)

    def stage_ahead(self, idx, table, host):
        """_stage_misses on a side stream forked from the current one, so that the kernels queued next
        overlap the copy: (rows, scratch, side stream) for moe_from_slots(staged=...), which joins it;
        None where staging does not apply, or KILN_STAGE_AHEAD=0 (A/B runs: staged in order then).
        (Inside a CUDA graph the fork and join are its edges.)"""
        if "0" in (os.environ.get("KILN_STAGE_MISSES", "1"), os.environ.get("KILN_STAGE_AHEAD", "1")):
            return None
        if not idx.is_cuda:        # the interpreter (tests): in order, no stream
            staged = self._stage_misses(idx, table, host)
            return None if staged is None else (*staged, None)
        main = torch.cuda.current_stream(idx.device)
        side = self.__dict__.get("_stage_stream")
        if side is None:           # (made by an eager step: a decode graph captures its second)
            side = self._stage_stream = torch.cuda.Stream(idx.device)
        side.wait_stream(main)
        with torch.cuda.stream(side):
            staged = self._stage_misses(idx, table, host)
        if staged is None:
            main.wait_stream(side)     # nothing launched; joined all the same (a capture needs it)
            return None
        return (*staged, side)

    def _stage_misses(self, idx, table, host):
        """(rows, scratch stacks) after staging.stage copied idx's misses into device scratch; None where
        a stack is not quantised or its parts are not whole words."""
        if not all(isinstance(w, QuantizedWeight) for w in host):
            return None
        parts = [staging.words(t) for w in host for t in (w.packed, w.scales, w.biases)]
        if any(p is None for p in parts):
            return None
        key = (tuple(tuple(t.shape[1:]) for t in parts), idx.numel(), idx.device)
        cache = self.__dict__.setdefault("_staging_scratch", {})
        if key not in cache:        # (made by an eager step before any capture reuses it)
            new = lambda t: torch.empty((idx.numel(), *t.shape[1:]), dtype=t.dtype, device=idx.device)  # noqa: E731
            cache[key] = [w._with(new(w.packed), new(w.scales), new(w.biases)) for w in host]
        scratch = cache[key]
        rows = staging.stage(idx, table, parts, [staging.words(t) for w in scratch for t in (w.packed, w.scales,
                                                                                             w.biases)])
        return rows.view(idx.shape), tuple(scratch)

    def _packed(self, x, idx, weights, gate_up, down, act, gate=None):
        """A prefill chunk's quantised experts read packed (quant/grouped.py: the grouped kernels with
        each tile dequantised as loaded), then the one combine; the dequantised copies only from
        COPIES_FROM pairs an expert where they fit (never, by default: packed measured faster at every
        length). None where the kernels do not take the stacks (the copies' paths then run)."""
        if not isinstance(gate_up, QuantizedWeight):
            return None
        e = gate_up.shape[0]
        if (COPIES_FROM is not None and idx.numel() > COPIES_FROM * e
                and ((room := stack_room(x)) is None or e * expert_bytes(gate_up, down) <= room)):
            return None
        y = qgrouped.experts(self, x, idx, weights, gate_up, down, act)
        return None if y is None else self.moe_combine(y, idx, x, gate)

    def _in_batches(self, x, idx, weights, gate_up, down, act, gate=None):
        """A prefill chunk's routed experts where the whole stacks' dequantised copies do not fit (the
        397B's 12.9 GB a layer): the experts in batches whose copies do, each batch's pairs through the
        grouped kernels into the chunk's per-pair outputs, then the one combine (experts added in id
        order, as the whole-stack path adds them). None where the whole stacks fit or the kernels do
        not apply (the caller's paths then run)."""
        if not (isinstance(gate_up, QuantizedWeight) and self.pairs_apply(x, gate_up, down, act)):
            return None
        room, e = stack_room(x), gate_up.shape[0]
        if room is None or e * expert_bytes(gate_up, down) <= room:
            return None
        if x.is_cuda and torch.cuda.is_current_stream_capturing():    # (a prefill graph: say why, before a sync)
            raise KilnError("the routed experts' dequantised copies do not fit whole: their batches wait for "
                            "the host, which a CUDA graph cannot")
        size = experts_in(room, gate_up, down)
        flat_idx = idx.reshape(-1)
        y = torch.zeros((idx.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
        for first in range(0, e, size):
            last = min(e, first + size)
            pairs = ((flat_idx >= first) & (flat_idx < last)).nonzero()[:, 0]
            if pairs.numel():
                gu, dn = dequantised_stacks(self, x, gate_up, down, first=first, last=last)
                self._pairs(x, idx, weights, pairs, flat_idx[pairs] - first, gu, dn, act, y)
                del gu, dn      # before the next batch's copies exist: one batch's at a time, not two
        return self.moe_combine(y, idx, x, gate)

    def _pairs(self, x, idx, weights, pairs, rows, gate_up, down, act, y) -> None:
        """The (token, slot) pairs `pairs` (flat positions in idx), each on expert `rows` of the 16-bit
        [B, 2I, H] and [B, H, I] stacks (or quantised ones the packed kernels take), through the grouped
        kernels (or the GEMVs) into y[pairs]: each pair its own row (one token, one expert), weighted by
        its routing weight."""
        xs = x.index_select(0, pairs // idx.shape[1]).contiguous()
        rw = weights.reshape(-1)[pairs][:, None].contiguous()
        part = torch.empty((pairs.numel(), x.shape[1]), dtype=x.dtype, device=x.device)
        if isinstance(gate_up, QuantizedWeight):
            v = qgrouped.form(self, xs, rows[:, None], gate_up, down, act, least=0)
            qgrouped.run(xs, rows[:, None].contiguous(), rw.reshape(-1), gate_up, down, act, v.p, part)
            y[pairs] = part
            return
        sub = kernels.MoeShape(pairs.numel(), gate_up.shape[0], 1, x.shape[1], down.shape[2], act)
        v = self.choose(kernels.OP, sub)
        if v.p.get("fin"):       # (it would combine inside: these pairs are not a chunk's tokens)
            v = kernels.OP.default(sub, self.dev)
        run = kernels.run_gemv if v.p.get("gemv") else kernels.run_grouped
        run(xs, rows[:, None].contiguous(), rw, gate_up, down, act, v.p, part)
        y[pairs] = part

    def moe_combine(self, y, idx, x, gate=None):
        """The per-pair outputs y [T*k, H] added per token in expert id order (plus Qwen's gated shared
        expert, gate = (gate_w, shared)), as moe_experts adds them."""
        out = torch.empty_like(x)
        gate_w, shared = (None, None) if gate is None else (self._gate(gate[0]), join(gate[1]))
        fused = (gate is not None and dense(gate_w) and gate_w.shape[0] == 1 and gate_w.dtype == x.dtype
                 and shared.shape == x.shape and shared.dtype == x.dtype)
        kernels.combine(y, idx.contiguous(), out, x.contiguous(), (gate_w, shared) if fused else None)
        return out if gate is None or fused else self.shared_gate_add(out, x, gate_w, shared)

    def pairs_apply(self, x, gate_up, down, act) -> bool:
        """slot_pairs runs here: a prefill chunk (more rows than the GEMVs take), the MoE family on, x's
        dtype and act in its kernels, the slot stacks 16-bit in x's dtype or quantised ones the
        dequantiser takes."""
        def fits(w):
            if isinstance(w, QuantizedWeight):
                return (self.on("quant", x) and w.packed.dim() == 3 and w.dtype == x.dtype
                        and embed.supports(None, w._with(w.packed[0], w.scales[0], w.biases[0])))
            return isinstance(w, torch.Tensor) and w.dim() == 3 and w.dtype == x.dtype
        return (x.dim() == 2 and x.shape[0] > GEMV_ROWS and self.on("moe", x) and x.dtype in kernels.SUPPORTED
                and act in kernels.ACTS and fits(gate_up) and fits(down))

    def slot_pairs(self, x, idx, weights, where: dict, gate_up, down, act, y) -> None:
        """Streamed experts at prefill (ExpertStore._copied): the pairs of idx whose expert is in `where`
        (expert id -> its slot in the slot stacks gate_up, down), their experts gathered from the slots
        and dequantised in one launch a stack, through the grouped kernels into y [T*k, H]; moe_combine
        adds them once every batch is in."""
        experts, flat_idx = sorted(where), idx.reshape(-1)
        if qgrouped.form(self, x, idx, gate_up, down, act) is not None:     # read packed: no copies
            ids = torch.tensor(experts, dtype=idx.dtype, device=idx.device)
            pairs = torch.isin(flat_idx, ids).nonzero()[:, 0]
            if pairs.numel():
                slots = torch.tensor([where[e] for e in experts], dtype=idx.dtype, device=idx.device)
                self._pairs(x, idx, weights, pairs, slots[torch.searchsorted(ids, flat_idx[pairs])], gate_up, down,
                            act, y)
            return
        room = stack_room(x)        # the copies in parts that fit (static's hot set: hundreds of experts)
        size = len(experts) if room is None else experts_in(room, gate_up, down)
        for part in (experts[j:j + size] for j in range(0, len(experts), size)):
            ids = torch.tensor(part, dtype=idx.dtype, device=idx.device)
            pairs = torch.isin(flat_idx, ids).nonzero()[:, 0]
            if pairs.numel() == 0:
                continue
            slots = torch.tensor([where[e] for e in part], dtype=torch.int64, device=x.device)
            gu, dn = gathered_stacks((gate_up, down), slots)
            self._pairs(x, idx, weights, pairs, torch.searchsorted(ids, flat_idx[pairs]), gu, dn, act, y)
            del gu, dn      # (as _in_batches: one part's copies at a time)

    def _dequantised(self, x, gate_up, down):
        """Quantised stacks past the routed GEMVs (a prefill chunk): both dequantised whole, one launch
        each, for the grouped kernels; as they were where they do not fit (the reference's loop)."""
        stacks = dequantised_stacks(self, x, gate_up, down)
        return stacks if stacks is not None else (gate_up, down)

    @staticmethod
    def _moe_shape(x, idx, gate_up, down, act):
        return kernels.MoeShape(x.shape[0], gate_up.shape[0], idx.shape[1], x.shape[1], down.shape[2], act)

    def _moe_one_token(self, x, idx, weights, gate_up, down, act):
        """One token's experts by gathering their weights (quantised ones dequantised as the reference
        dequantises them, mx.dequantize): no host read, so a graph can hold it."""
        order = torch.sort(idx[0]).indices                      # ascending expert id, as the reference adds
        e, wt = idx[0, order], weights[0, order]
        pick = lambda w: w[e] if dense(w) else dequantize(w.rows(e))      # noqa: E731
        gate, up = torch.matmul(pick(gate_up), x[0]).chunk(2, dim=-1)            # [k, I] each
        y = torch.matmul(pick(down), (ACTIVATIONS[act](gate) * up)[..., None])[..., 0] * wt[:, None]
        out = torch.zeros_like(x[0])
        for j in range(y.shape[0]):
            out = out + y[j].to(out.dtype)
        return out[None]
