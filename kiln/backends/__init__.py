"""Backends implement the `ops` seam that model files call. `reference` is plain PyTorch."""

from __future__ import annotations

from ..errors import KilnError

BACKENDS = ("reference",)


def get_ops(name: str, device):
    if name == "reference":
        from .reference import ReferenceOps
        return ReferenceOps(device)
    raise KilnError(f"unknown backend {name!r} (available: {', '.join(BACKENDS)})")
