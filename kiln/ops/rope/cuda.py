"""RoPE on the cuda backend: the step's cos/sin tables in one launch (tables.py) where that kernel gives
the reference's bits; the rotation itself runs inside the attention input kernel (qk_rope, attention/cuda.py)."""

from __future__ import annotations

import sys

import torch

from ..dispatch import TunedOps
from . import tables
from .reference import RopeReference


class RopeCuda(TunedOps, RopeReference):
    def rope_tables(self, positions, inv_freq, dtype, scaling: float = 1.0):
        if (positions.is_cuda and "rope" not in self.off and tables.tables_on() and tables.takes(positions, inv_freq)
                and self._tables_exact(inv_freq, dtype, scaling)):
            return tables.rope_tables(positions, inv_freq, dtype, scaling)
        return super().rope_tables(positions, inv_freq, dtype, scaling)

    def _tables_exact(self, inv_freq, dtype, scaling) -> bool:
        """Whether the kernel's tables equal the reference's for these frequencies (checked at the first
        call, outside any graph capture: the check reads its count back; a capture first takes the torch
        ops). A difference is reported once and keeps the torch ops for these frequencies."""
        verdicts = self.__dict__.setdefault("_rope_verdicts", {})
        key = (inv_freq.data_ptr(), inv_freq.shape[0], dtype, float(scaling))
        if key not in verdicts:
            if torch.cuda.is_current_stream_capturing():
                return False
            bad, total = tables.differing(inv_freq, dtype, scaling)
            verdicts[key] = bad == 0
            if bad:
                print(f"[kiln] warning: the RoPE table kernel differs from torch's cos/sin at {bad} of {total} "
                      f"values ({dtype}, {inv_freq.shape[0]} frequencies); the torch ops compute them",
                      file=sys.stderr)
        return verdicts[key]
