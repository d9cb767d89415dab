"""The greedy choice on the cuda backend: one kernel inside the decode step's CUDA graph."""

from __future__ import annotations

from ..dispatch import TunedOps
from . import kernels
from .reference import SampleReference


class SampleCuda(TunedOps, SampleReference):
    def greedy_next(self, logits, ids, pos):
        if not logits.is_cuda or "sample" in self.off:   # (the interpreter: the reference, as tests expect)
            return super().greedy_next(logits, ids, pos)
        kernels.greedy_next(logits, ids, pos)
