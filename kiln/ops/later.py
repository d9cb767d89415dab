"""A projection handed on uncomputed: x @ w^T as the residual branch of the add + norm that follows it.

The cuda backend's `linear_later` returns one at decode for a quantised weight, so that the add +
RMSNorm after it can run in that GEMV's last block (one launch, not two: docs/quant.md); every op
that takes a residual branch (add_rmsnorm and the fused forms after it) accepts one, and anything
else calls `now` first. Other backends compute the product at once."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Later:
    x: torch.Tensor     # the projection's input
    w: object           # its weight (a QuantizedWeight where the cuda backend hands one on)


def now(ops, v):
    """v, or the product a Later names, computed now by `ops`."""
    return ops.linear(v.x, v.w) if isinstance(v, Later) else v
