"""The quant family's dispatch: projections on quantised weights, called by the gemm family's `linear`
(the mixins own disjoint names: `linear` is gemm's). A few rows (decode) run the tuned quantised GEMV
(kernels.py), which reads the packed words; more rows dequantise the weight once and run the gemm
family's tuned 16-bit kernel."""

from __future__ import annotations

from ...weights.quantized import QuantizedWeight
from . import kernels
from .reference import dequantize

GEMV_ROWS = 4     # up to this many rows the GEMV re-reads its slab from L2 for each row; beyond, one GEMM


def quant_linear(ops, x, w: QuantizedWeight):
    """x @ dequantize(w)^T on `ops` (a TunedOps with `linear`), or None where the family is off or
    cannot run here (the caller's reference then dequantises)."""
    if not ops.on("quant", x):
        return None
    k = w.shape[-1]
    x2 = x.reshape(-1, k)
    if x2.shape[0] > GEMV_ROWS or not kernels.OP.supports(x2, w):
        return ops.linear(x, dequantize(w))     # a dense weight: the gemm family's kernels
    shape = kernels.QGemvShape(x2.shape[0], w.shape[0], k, w.bits, w.group_size)
    y = kernels.qgemv(x2.contiguous(), w, ops.choose(kernels.OP, shape))
    return y.view(*x.shape[:-1], w.shape[0])


def quant_workloads(weights: dict) -> list[tuple]:
    """(op, shape) at one row for each distinct 2-D quantised weight a model holds: what decode runs."""
    shapes = {kernels.QGemvShape(1, w.shape[0], w.shape[1], w.bits, w.group_size)
              for w in weights.values() if isinstance(w, QuantizedWeight) and w.packed.dim() == 2}
    return [(kernels.OP, s) for s in sorted(shapes, key=lambda s: s.key)]
