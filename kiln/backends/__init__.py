"""Backends behind the `ops` seam: `reference` (plain PyTorch, the specification) and `cuda` (the
tuned Triton kernels of kiln.ops, decode as one CUDA graph)."""

from __future__ import annotations

import torch

from ..errors import KilnError
from .reference import ReferenceOps

BACKENDS = ("reference", "cuda")


def get_ops(name: str, device: torch.device):
    if name == "reference":
        return ReferenceOps(device)
    if name == "cuda":
        from .cuda import CudaOps  # Triton: imported only where the cuda backend is asked for
        return CudaOps(device)
    raise KilnError(f"unknown backend {name!r} (use one of: {', '.join(BACKENDS)})")
