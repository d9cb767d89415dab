"""RoPE facts the model files share: default inverse frequencies and the attention scale."""

from __future__ import annotations

import math

import torch


def inv_freq(dim: int, theta: float, factor: float = 1.0) -> torch.Tensor:
    """Default RoPE inverse frequencies (linear scaling divides them by `factor`)."""
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)) / factor


def default_scale(head_dim: int) -> float:
    return 1.0 / math.sqrt(head_dim)
