"""KILN_CHECK_INDEX=1: the index tensors of the few index_selects that take at most 16 indices (the
embedding, a prefill's last rows, a slot's GDN state, a few K/V rows) checked on the device, without
a host sync: an out-of-range index is counted by site, then clamped so that no device-side assert
poisons the context, and `report()` (called where the engine syncs anyway) names the sites that saw
one. A diagnosis aid for the index assert under page pressure (docs/batching.md), off by default."""

from __future__ import annotations

import os

import torch

ON = os.environ.get("KILN_CHECK_INDEX", "0") not in ("", "0")
SITES = ("embed", "last_rows", "slot_state", "kv_rows", "snapshot_rows")
_counts: dict[torch.device, torch.Tensor] = {}   # per device: [sites, 2] (bad count, largest bad index)


def prepare(device: torch.device) -> None:
    """The counters allocated before any capture (a graph then updates the same buffer), keyed by the
    device as a tensor on it names it: "cuda" is cuda:N there (until 2026-12-04 they were keyed by
    "cuda", which no tensor's device equals: nothing was checked on a GPU)."""
    device = torch.device(device)
    if ON and device.type == "cuda":
        device = torch.empty(0, device=device).device
        if device not in _counts:
            _counts[device] = torch.zeros((len(SITES), 2), dtype=torch.long, device=device)


def checked(idx: torch.Tensor, size: int, site: str) -> torch.Tensor:
    """idx as it is when off (or off the GPU); else counted and clamped into [0, size)."""
    counts = _counts.get(idx.device) if ON else None
    if counts is None or idx.numel() == 0:
        return idx
    row = counts[SITES.index(site)]
    bad = (idx < 0) | (idx >= size)
    row[0:1] += bad.sum()
    torch.maximum(row[1:2], torch.where(bad, idx, -1).max().long().reshape(1), out=row[1:2])
    return idx.clamp(0, size - 1)


def report() -> None:
    """Raise naming each site that saw an out-of-range index (a host sync: call it where one is)."""
    for device, counts in _counts.items():
        seen = counts.tolist()
        bad = [f"{site}: {n} bad (largest {top})" for site, (n, top) in zip(SITES, seen) if n]
        if bad:
            raise RuntimeError(f"index out of range on {device}: " + "; ".join(bad))
