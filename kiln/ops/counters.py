"""Arrival-counter buffers that CUDA graphs capture by address stay alive once handed out.

Serial split-K GEMMs (gemm.arrival_counters) and the GDN decode (gdn.kernels.arrival_counters) count
arrivals in one buffer per device that is replaced by a larger one when a launch needs more, e.g. the
first batched step of 8 rows after graphs of 1, 2 and 4 rows were captured. A captured graph keeps
the old buffer's address; freed, the caching allocator gives that memory to the next small tensor (a
step's positions, slot ids, a block-table row), and every replay of the old graph then adds its
arrivals into that tensor and skips the state writes its counts gate: the device-side index assert
docs/batching.md records, and wrong tokens where it does not assert. So every buffer stored in those
dicts is kept for the process's life (a few, each a few KB).

The dicts are swapped here rather than changed in gemm.py and gdn/kernels.py, whose text is hashed
into every shipped tuning choice."""

from __future__ import annotations

import os

import torch


class Keeping(dict):
    """A dict whose every stored tensor stays referenced (by address) after it is replaced or popped."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.kept: dict[int, torch.Tensor] = {t.data_ptr(): t for t in self.values() if t is not None}

    def __setitem__(self, key, value) -> None:
        if value is not None:
            self.kept.setdefault(value.data_ptr(), value)
        super().__setitem__(key, value)

    def setdefault(self, key, default=None):
        if key not in self:
            self[key] = default
        return self[key]

    def update(self, *args, **kwargs) -> None:
        for key, value in dict(*args, **kwargs).items():
            self[key] = value


def keep_counters(*modules) -> None:
    """Make each module's `_COUNTERS` dict a Keeping one (idempotent). KILN_KEEP_COUNTERS=0 leaves
    them plain dicts: the old behaviour, to reproduce the fault (diagnosis only)."""
    if os.environ.get("KILN_KEEP_COUNTERS", "1") == "0":
        return
    for module in modules:
        if not isinstance(module._COUNTERS, Keeping):
            module._COUNTERS = Keeping(module._COUNTERS)
