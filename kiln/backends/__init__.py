"""Backends behind the `ops` seam: `reference` (plain PyTorch, the specification), `cpu` (the
reference with quantised projections kept quantised, forms measured at load) and `cuda` (the tuned
Triton kernels of kiln.ops, decode as one CUDA graph)."""

from __future__ import annotations

import torch

from ..errors import KilnError
from .reference import ReferenceOps

BACKENDS = ("reference", "cpu", "cuda")


def get_ops(name: str, device: torch.device):
    if name == "reference":
        return ReferenceOps(device)
    if name == "cpu":
        if device.type != "cpu":
            raise KilnError(f"the cpu backend runs on the CPU, not {device.type} (use --device cpu)")
        from .cpu import CpuOps
        return CpuOps(device)
    if name == "cuda":
        from .cuda import CudaOps  # Triton: imported only where the cuda backend is asked for
        return CudaOps(device)
    raise KilnError(f"unknown backend {name!r} (use one of: {', '.join(BACKENDS)})")
