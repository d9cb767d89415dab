"""RMSNorm on the cuda backend: the tuned kernel, the reference where it does not apply."""

from __future__ import annotations

import torch

from ..dispatch import TunedOps
from ..later import Later
from ..quant.cuda import quant_linear_add_rmsnorm
from . import kernels, sandwich
from .reference import NormReference


class NormCuda(TunedOps, NormReference):
    def _norm_fits(self, x, w, style) -> bool:
        return self.on("norm", x) and kernels.OP.supports(x, w, style)

    def rmsnorm(self, x, w, eps, style="llama"):
        if not self._norm_fits(x, w, style):
            return super().rmsnorm(x, w, eps, style)
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        v = self.choose(kernels.OP, kernels.NormShape(x.numel() // x.shape[-1], x.shape[-1], style))
        kernels.OP.run(v, {"x": x, "norm_w": w, "eps": eps, "style": style}, {"y": y}, self.plan)
        return y

    def add_rmsnorm(self, x, r, w, eps, style="llama"):
        if isinstance(r, Later):       # its GEMV adds and norms in its last block, where the tuner keeps that
            if (got := quant_linear_add_rmsnorm(self, r.x, r.w, x, w, eps, style)) is not None:
                return got
            r = self.now(r)
        if not self._norm_fits(x, w, style) or r.shape != x.shape or r.dtype != x.dtype:
            return super().add_rmsnorm(x, r, w, eps, style)
        s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        v = self.choose(kernels.OP, kernels.NormShape(x.numel() // x.shape[-1], x.shape[-1], style))
        y = kernels.rmsnorm(x, w, eps, style, v, add=r, s=s)
        return s, y

    def residual_norms(self, x, a, eps, style, post_w, a_w=None, b=None, b_w=None, scalar=None, outs=(),
                       router=None):
        weights = [w for w in (post_w, a_w, b_w, router, *outs) if w is not None]
        pair = (b is None) == (a_w is None) == (b_w is None)
        if (not self._norm_fits(x, post_w, style) or len(outs) > 2 or not pair
                or not sandwich.supports(x, a, b, weights)
                or (scalar is not None and (scalar.numel() != 1 or scalar.dtype != x.dtype))):
            return super().residual_norms(x, a, eps, style, post_w, a_w, b, b_w, scalar, outs, router)
        v = self.choose(sandwich.OP, sandwich.shape_of(x, b, scalar, outs, router, style))
        s, ys = sandwich.residual_norms(x, a, eps, style, post_w, v, a_w, b, b_w, scalar, outs, router)
        return s.view(x.shape), [y.view(x.shape) for y in ys]
