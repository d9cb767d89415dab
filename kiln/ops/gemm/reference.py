"""Projections, the reference: F.linear, the gated MLP and its fused forms written as their
composition, the embedding and the LM head. A packed weight (several projections of one input in
one tensor, rows in order) is run part by part, so each part rounds as the separate projection."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...indexcheck import checked
from ..later import now
from ..quant.reference import QuantizedWeight, dequantize

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "sigmoid": torch.sigmoid,      # Qwen3.5's attention output gate
}


class GemmReference:
    """Needs the norm family beside it (rmsnorm, add_rmsnorm) for the fused forms."""

    def embed(self, ids: torch.Tensor, table: torch.Tensor, scale: float | None = None) -> torch.Tensor:
        if isinstance(table, QuantizedWeight):
            x = dequantize(table.rows(ids))
        else:
            x = F.embedding(checked(ids, table.shape[0], "embed"), table)
        if scale is not None:  # Gemma: the scale is cast to the weight dtype first, as HF does
            x = x * torch.tensor(scale, dtype=table.dtype)   # a CPU scalar: no copy, so a graph can hold it
        return x

    rows_apart = False      # set while a batched decode step runs (Engine.decode_batch): see linear

    def linear(self, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None = None) -> torch.Tensor:
        """x @ w^T (+ b); a quantised w is dequantised first, exactly as mlx does (the specification).
        With `rows_apart`, row by row: a multi-row product may sum in another order than one row
        (MKL's gemm against its gemv), and a request in a batch must get its single-row result."""
        dense = dequantize(w) if isinstance(w, QuantizedWeight) else w
        rows = x.numel() // x.shape[-1]
        if self.rows_apart and rows > 1:
            x2 = x.reshape(rows, x.shape[-1])
            return torch.cat([F.linear(x2[i:i + 1], dense, b) for i in range(rows)]).view(*x.shape[:-1], -1)
        return F.linear(x, dense, b)

    def act_mul(self, g: torch.Tensor, u: torch.Tensor, act: str) -> torch.Tensor:
        """act(g) * u, each rounded to the activation dtype as torch does (one pass on GPU)."""
        return ACTIVATIONS[act](g) * u

    def linear_split(self, x: torch.Tensor, w: torch.Tensor, sizes: list[int]) -> list:
        """The projections packed in w (rows in `sizes` order) of the same input: one GEMM on GPU."""
        return [self.linear(x, part) for part in w.split(sizes)]

    def rmsnorm_linear(self, x, norm_w, eps, style, w):
        """Norm fused into the next projection (fused on GPU where the tuner finds it pays)."""
        return self.linear(self.rmsnorm(x, norm_w, eps, style), w)

    def linear_later(self, x: torch.Tensor, w) -> torch.Tensor:
        """x @ w^T, used only as the residual branch of the add + norm that follows (add_rmsnorm and
        the fused forms after it take it as r): here the product; a backend may hand on a Later
        (kiln/ops/later.py) and compute it inside that norm."""
        return self.linear(x, w)

    def now(self, v):
        """v, or the product of a Later that linear_later or gated_mlp(later=True) handed on."""
        return now(self, v)

    def gated_mlp(self, x, gate_up, down, act: str, later: bool = False) -> torch.Tensor:
        """down(act(gate(x)) * up(x)): SwiGLU / GeGLU; gate_up [2I, H] packs gate's rows, then up's.
        `later`: the output is only the residual branch of an add + norm (as linear_later's)."""
        gate, up = self.linear_split(x, gate_up, [down.shape[1]] * 2)
        return self.linear(self.act_mul(gate, up, act), down)

    def add_rmsnorm_linear_split(self, x, r, norm_w, eps: float, style: str, w, sizes: list[int]) -> tuple:
        """The residual add, the next layer's input norm and its packed projections: (x + r,
        linear_split(h, w, sizes)) with h = rmsnorm(x + r); on GPU at decode the norm can run inside
        their GEMV."""
        s, h = self.add_rmsnorm(x, r, norm_w, eps, style)
        return s, self.linear_split(h, w, sizes)

    def add_rmsnorm_gated_mlp(self, x, r, norm_w, eps: float, style: str, gate_up, down, act: str,
                              later: bool = False):
        """The residual add, the post-attention norm and the MLP: (x + r, gated_mlp(rmsnorm(x + r)));
        on GPU at decode the norm can run inside the gate|up GEMV. `later` as gated_mlp's."""
        s, h = self.add_rmsnorm(x, r, norm_w, eps, style)
        return s, self.gated_mlp(h, gate_up, down, act, later=later)

    def logits(self, x: torch.Tensor, w: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
        out = self.linear(x, w)
        if softcap is not None:
            out = torch.tanh(out / softcap) * softcap
        return out

    def gated_input(self, x, gate_w, signal, proj_w, act: str) -> torch.Tensor:
        """proj(act(gate(x)) * signal): Gemma 4's per-layer-input block."""
        return self.linear(ACTIVATIONS[act](self.linear(x, gate_w)) * signal, proj_w)
