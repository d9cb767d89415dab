"""Backends implement the `ops` seam that model files call. `reference` is plain PyTorch; `cuda` runs
Triton kernels tuned for the model (kiln.tune), falling back to the reference for the rest."""

from __future__ import annotations

from ..errors import KilnError

BACKENDS = ("reference", "cuda")


def get_ops(name: str, device):
    if name == "reference":
        from .reference import ReferenceOps
        return ReferenceOps(device)
    if name == "cuda":
        from .cuda import CudaOps
        return CudaOps(device)
    raise KilnError(f"unknown backend {name!r} (available: {', '.join(BACKENDS)})")
