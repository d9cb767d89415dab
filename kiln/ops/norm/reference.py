"""RMSNorm, the reference: plain PyTorch, rounding where each family's HF code rounds."""

from __future__ import annotations

import torch

from ..later import now


class NormReference:
    def rmsnorm(self, x: torch.Tensor, w: torch.Tensor, eps: float, style: str = "llama") -> torch.Tensor:
        """style "llama": cast the normed value, then * w; "offset": (x_n * (1 + w)) in f32, then cast
        (Gemma 3, Qwen3.5); "plain": (x_n * w) in f32, then cast (Gemma 4)."""
        xf = x.float()
        normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        if style == "llama":
            return w * normed.to(x.dtype)
        if style == "offset":
            return (normed * (1.0 + w.float())).to(x.dtype)
        return (normed * w.float()).to(x.dtype)

    def add_rmsnorm(self, x: torch.Tensor, r: torch.Tensor, w: torch.Tensor, eps: float, style: str = "llama"):
        """The residual add and the next norm: (x + r, rmsnorm(x + r)) (one pass on GPU); r may be a
        Later (kiln/ops/later.py)."""
        s = x + now(self, r)
        return s, self.rmsnorm(s, w, eps, style)

    def rmsnorm_noscale(self, x: torch.Tensor, eps: float) -> torch.Tensor:
        """RMSNorm with no weight (Gemma 4's v_norm and router norm): normed in f32, then cast."""
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)

    def residual_norms(self, x, a, eps: float, style: str, post_w, a_w=None, b=None, b_w=None, scalar=None,
                       outs=(), router=None):
        """Gemma 4's residual step around its sandwich norms, one seam a backend fuses:
        u = rmsnorm(a, a_w) + rmsnorm(b, b_w) with b (else u = a); s = x + rmsnorm(u, post_w), times
        `scalar` when given. Returns (s, ys): rmsnorm(s, w) for each w of `outs`, then, with `router` (its
        scale [H]), the router's input rmsnorm_noscale(s) * router * H^-0.5, each product rounded."""
        u = a if b is None else self.rmsnorm(a, a_w, eps, style) + self.rmsnorm(b, b_w, eps, style)
        s = x + self.rmsnorm(u, post_w, eps, style)
        if scalar is not None:
            s = s * scalar
        ys = [self.rmsnorm(s, w, eps, style) for w in outs]
        if router is not None:
            ys.append(self.rmsnorm_noscale(s, eps) * router * s.shape[-1] ** -0.5)
        return s, ys
