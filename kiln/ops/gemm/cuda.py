"""Projections on the cuda backend: the tuned GEMM (tiles, split-K, TMA, GEMV), the gated MLP's
gate|up with its activation in the epilogue, and at decode the residual add and norm inside the
next GEMV; the reference where a call does not fit (a bias, mixed dtypes)."""

from __future__ import annotations

import torch

from .. import nvrtc
from ..counters import keep_counters
from ..dispatch import TunedOps
from ..later import Later
from ..quant.cuda import (
    gate_up_act_form,
    norm_epilogue_on,
    quant_act_down,
    quant_embed,
    quant_gate_up_act,
    quant_linear,
    quant_linear_add_rmsnorm,
    quant_norm_linear,
)
from ..quant.kernels import OP as QGEMV
from ..quant.reference import QuantizedWeight
from . import activation, gelu, gemm, gemm_act, norm_gemm
from .reference import GemmReference

keep_counters(gemm)     # a captured graph's split-K counters never freed (kiln/ops/counters.py)


def dense(*ws) -> bool:
    """No quantised weight among ws: the fused forms take 16-bit weights only; a quantised one goes
    through `linear` (the quant family's GEMV) or the reference composition."""
    return not any(isinstance(w, QuantizedWeight) for w in ws)


class GemmCuda(TunedOps, GemmReference):
    def embed(self, ids, table, scale=None):
        if dense(table) or (x := quant_embed(self, ids, table)) is None:
            return super().embed(ids, table, scale)
        if scale is not None:   # as the reference: the scale cast to the table's dtype first
            x = x * torch.tensor(scale, dtype=table.dtype)
        return x

    def linear(self, x, w, b=None):
        if b is None and not dense(w) and (y := quant_linear(self, x, w)) is not None:
            return y
        if b is not None or not dense(w) or not self.on("gemm", x) or not gemm.OP.supports(x, w):
            return super().linear(x, w, b)
        n, k = w.shape
        x2 = x.reshape(-1, k).contiguous()
        y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
        v = self.choose(gemm.OP, gemm.GemmShape(x2.shape[0], n, k))
        if v.p.get("tma") and not gemm.tma_ok(x2, w, y):
            v = gemm.OP.default(gemm.GemmShape(x2.shape[0], n, k), self.dev)
        gemm.OP.run(v, {"x": x2, "w": w.contiguous()}, {"y": y}, self.plan)
        return y.view(*x.shape[:-1], n)

    def linear_split(self, x, w, sizes):
        """One GEMM (or quantised GEMV) over the packed rows, then split."""
        if not self.on("gemm" if dense(w) else "quant", x):
            return super().linear_split(x, w, sizes)
        return list(self.linear(x, w).split(sizes, dim=-1))

    def linear_later(self, x, w):
        """At one row on a quantised weight where kiln's CUDA C kernels run and KILN_NORM_EPILOGUE=1: a
        Later, computed by the add + norm that takes it (in the GEMV's last block where the tuner keeps
        that form)."""
        if (x.numel() == x.shape[-1] and not dense(w) and norm_epilogue_on() and self.on("quant", x)
                and nvrtc.kernels_run(self.dev) and QGEMV.supports(x.reshape(1, -1), w)):
            return Later(x, w)
        return self.linear(x, w)

    def gated_mlp(self, x, gate_up, down, act, later=False):
        if not dense(down) and x.numel() == x.shape[-1]:      # one row, quantised down: the gate|up GEMV's
            # epilogue, or the down GEMV's prologue
            x1 = x.reshape(1, -1)
            if not dense(gate_up) and (h := quant_gate_up_act(self, x1, gate_up, act)) is not None:
                h = h.view(*x.shape[:-1], -1)
                return self.linear_later(h, down) if later else self.linear(h, down)
            return self._act_down(self.linear(x1, gate_up), down, act).view(*x.shape[:-1], -1)
        if not dense(gate_up, down) or not self.on("gemm", x) or not gemm_act.OP.supports(x, gate_up, act):
            gate, up = self.linear_split(x, gate_up, [down.shape[1]] * 2)
            return self.linear(self.act_mul(gate, up, act), down)
        x2 = x.reshape(-1, x.shape[-1]).contiguous()
        v = self.choose(gemm_act.OP, gemm_act.GemmActShape(x2.shape[0], down.shape[1], x2.shape[1], act))
        if v.run is not None and x2.shape[0] == 1:
            return self._act_down(self.linear(x2, gate_up), down, act).view(*x.shape[:-1], -1)
        h = torch.empty((x2.shape[0], down.shape[1]), dtype=x.dtype, device=x.device)
        gemm_act.OP.run(v, {"x": x2, "w": gate_up, "act": act}, {"y": h}, self.plan)
        return self.linear(h.view(*x.shape[:-1], -1), down)

    def _linear_add_rmsnorm(self, x, r, norm_w, eps, style):
        """r a Later: (s, h) of its GEMV with the add + norm in the last block where the tuner keeps
        that form, else None and r computed: (None, r)."""
        if (got := quant_linear_add_rmsnorm(self, r.x, r.w, x, norm_w, eps, style)) is not None:
            return got, r
        return None, self.now(r)

    def add_rmsnorm_linear_split(self, x, r, norm_w, eps, style, w, sizes):
        """At one row, when the tuner chose the GEMV with the norm in its prologue: s = x + r and the
        packed projections of rmsnorm(s) in one launch. r a Later: its GEMV adds and norms (where kept)."""
        if isinstance(r, Later):
            got, r = self._linear_add_rmsnorm(x, r, norm_w, eps, style)
            if got is not None:
                return got[0], self.linear_split(got[1], w, sizes)
        if not dense(w) and (got := quant_norm_linear(self, x, r, norm_w, eps, style, w)) is not None:
            return got[0], list(got[1].split(sizes, dim=-1))
        v = self._norm_gemv_choice(x, r, norm_w, w, style)
        if v is None:
            return super().add_rmsnorm_linear_split(x, r, norm_w, eps, style, w, sizes)
        s, y = self._norm_gemv(v, x, r, norm_w, eps, style, w)
        return s.view(x.shape), list(y.view(*x.shape[:-1], -1).split(sizes, dim=-1))

    def add_rmsnorm_gated_mlp(self, x, r, norm_w, eps, style, gate_up, down, act, later=False):
        """At one row, when the tuner chose the GEMV with the norm in its prologue (and the unfused
        gate|up): s = x + r and gate|up of rmsnorm(s) in one launch, then the down projection. r a
        Later: its GEMV adds and norms (where kept); `later` as gated_mlp's."""
        if isinstance(r, Later):
            got, r = self._linear_add_rmsnorm(x, r, norm_w, eps, style)
            if got is not None:
                return got[0], self.gated_mlp(got[1], gate_up, down, act, later=later)
        if (not dense(gate_up) and gate_up_act_form(self, x, gate_up, act) is None    # else: the norm's kernel,
                # then gated_mlp's epilogue form
                and (got := quant_norm_linear(self, x, r, norm_w, eps, style, gate_up)) is not None):
            return got[0], self._act_down(got[1].reshape(1, -1), down, act).view(x.shape)
        v = self._norm_gemv_choice(x, r, norm_w, gate_up, style)
        shape = gemm_act.GemmActShape(1, down.shape[1], x.shape[-1], act)
        if v is None or not dense(down) or self.choose(gemm_act.OP, shape).run is None:
            return super().add_rmsnorm_gated_mlp(x, r, norm_w, eps, style, gate_up, down, act, later=later)
        s, gu = self._norm_gemv(v, x, r, norm_w, eps, style, gate_up)
        return s.view(x.shape), self._act_down(gu, down, act).view(x.shape)

    def _norm_gemv_choice(self, x, r, norm_w, w, style):
        """The tuned GEMV form with add + norm in its prologue for this one-row input, or None (not
        one row, unsupported, or the tuner kept the unfused form)."""
        if (x.numel() != x.shape[-1] or not dense(w) or not self.on("gemm", x) or r.shape != x.shape
                or r.dtype != x.dtype or not norm_gemm.OP.supports(x, norm_w, w, style)):
            return None
        v = self.choose(norm_gemm.OP, norm_gemm.NormGemmShape(1, w.shape[0], x.shape[-1], style, add=True))
        return v if v.p.get("gemv") else None

    def _norm_gemv(self, v, x, r, norm_w, eps, style, w):
        """(s, y): s = x + r and y = rmsnorm(s) @ w^T by the GEMV form v, x one row."""
        k = x.shape[-1]
        x2, r2 = x.reshape(1, k).contiguous(), r.reshape(1, k).contiguous()
        s, y = torch.empty_like(x2), torch.empty((1, w.shape[0]), dtype=x.dtype, device=x.device)
        norm_gemm.OP.run(v, {"x": x2, "norm_w": norm_w, "eps": eps, "style": style, "w": w, "r": r2},
                         {"y": y, "s": s}, self.plan)
        return s, y

    def _act_down(self, gu, down, act):
        """Decode's down projection of act(g) * u, the act_mul in its own launch or in the GEMV's loads."""
        if not dense(down) and (y := quant_act_down(self, gu, down, act)) is not None:
            return y
        if not dense(down) or not gemm_act.ACT_OP.supports(gu, down, act):
            g, u = gu.split(down.shape[1], dim=-1)
            return self.linear(self.act_mul(g, u, act), down)
        y = torch.empty((gu.shape[0], down.shape[0]), dtype=gu.dtype, device=gu.device)
        v = self.choose(gemm_act.ACT_OP, gemm_act.ActGemmShape(gu.shape[0], down.shape[0], down.shape[1], act))
        gemm_act.ACT_OP.run(v, {"gu": gu, "w": down.contiguous(), "act": act}, {"y": y}, self.plan)
        return y

    def act_mul(self, g, u, act):
        if self.on("gemm", g) and gelu.supports(g, u, act):
            return gelu.gelu_mul(g, u)
        if not self.on("gemm", g) or not activation.supports(g, u, act):
            return super().act_mul(g, u, act)
        return activation.act_mul(g, u, act)

    def rmsnorm_linear(self, x, norm_w, eps, style, w):
        if not dense(w) and x.numel() == x.shape[-1] and (got := quant_norm_linear(self, x, None, norm_w, eps, style,
                                                                                  w)) is not None:
            return got[1]
        if not dense(w) or not self.on("gemm", x) or not norm_gemm.OP.supports(x, norm_w, w, style):
            return super().rmsnorm_linear(x, norm_w, eps, style, w)
        n, k = w.shape
        x2 = x.reshape(-1, k).contiguous()
        y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
        v = self.choose(norm_gemm.OP, norm_gemm.NormGemmShape(x2.shape[0], n, k, style))
        norm_gemm.OP.run(v, {"x": x2, "norm_w": norm_w, "eps": eps, "style": style, "w": w.contiguous()}, {"y": y},
                         self.plan)
        return y.view(*x.shape[:-1], n)
