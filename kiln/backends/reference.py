"""The reference backend: plain PyTorch, rounding exactly where the HF reference rounds.

This is the executable specification and the oracle in tests; it runs on CPU and GPU. Model files
call its methods through `ops`; each family's reference lives in kiln/ops/<family>/reference.py,
and a fused op (e.g. `rmsnorm_linear`, `gated_mlp`) is written there as its composition.
"""

from __future__ import annotations

import torch

from ..ops.attention.reference import AttentionReference
from ..ops.fork import join
from ..ops.gdn.reference import GdnReference
from ..ops.gemm.reference import GemmReference
from ..ops.moe.reference import MoeReference
from ..ops.norm.reference import NormReference
from ..ops.rope.reference import RopeReference
from ..ops.sample.reference import SampleReference


class ReferenceOps(NormReference, GemmReference, RopeReference, AttentionReference, GdnReference, MoeReference,
                   SampleReference):
    name = "reference"
    graphs = False           # decode steps run eagerly
    batch_invariant = True   # a batched decode step gives each row its single-row result (rows_apart)
    static_windows = False   # sliding-window layers keep a ring of the window (kiln.cache.RingKVCache)
    prefill_chunk = 512

    def __init__(self, device: torch.device | str = "cpu"):
        self.device = torch.device(device)

    def fork(self, fn, x: torch.Tensor):
        """fn's work, to run beside what is queued next (kiln/ops/fork.py); here in order: fn's result,
        which ops.join returns as it is."""
        return fn()

    def join(self, v):
        return join(v)
