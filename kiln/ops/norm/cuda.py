"""RMSNorm on the cuda backend: the tuned kernel, the reference where it does not apply."""

from __future__ import annotations

import torch

from ..dispatch import TunedOps
from . import kernels
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
        if not self._norm_fits(x, w, style) or r.shape != x.shape or r.dtype != x.dtype:
            return super().add_rmsnorm(x, r, w, eps, style)
        s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        v = self.choose(kernels.OP, kernels.NormShape(x.numel() // x.shape[-1], x.shape[-1], style))
        y = kernels.rmsnorm(x, w, eps, style, v, add=r, s=s)
        return s, y
