"""The cuda backend: Triton kernels compiled for the loaded model's shapes and chosen by the tuner
(kiln.tune). `linear`, `rmsnorm` and `rmsnorm_linear` run tuned kernels; every other op, and any
call the kernels do not cover (a bias, mixed dtypes), falls back to the reference backend.

On CPU the same kernels run under Triton's interpreter (TRITON_INTERPRET=1): slow, for tests.
"""

from __future__ import annotations

import time

import torch

from ...errors import KilnError
from ..reference import ReferenceOps
from . import gemm as G
from . import rmsnorm as R
from . import rmsnorm_gemm as RG
from .common import device_info, interpreting


class CudaOps(ReferenceOps):
    name = "cuda"

    def __init__(self, device: torch.device | str = "cuda"):
        super().__init__(device)
        if self.device.type != "cuda" and not interpreting():
            raise KilnError("backend cuda needs a CUDA GPU (or TRITON_INTERPRET=1 to run its kernels on CPU, slowly)")
        self.dev = device_info(self.device)
        self.plan = None              # kiln.tune.tuner.Plan; until prepare() runs, each op's default
        self.tune_s: float | None = None
        self.tune_cache: str | None = None

    def prepare(self, model, dtype: torch.dtype, *, m_values=None, retune: bool = False, pins=None,
                budget_s: float | None = None, quiet: bool = True):
        """Compile and tune the kernels for `model`'s shapes (a cache hit measures nothing)."""
        from ...tune.tuner import Tuner
        from ...tune.workloads import DECODE_ROWS, PREFILL_CHUNK, model_workloads

        t0 = time.perf_counter()
        model_type = next(k for k, (_, c) in _model_types().items() if c == type(model).__name__)
        workloads = model_workloads(type(model), model.cfg, model_type, m_values or (PREFILL_CHUNK, DECODE_ROWS))
        tuner = Tuner(self.device, dtype, retune=retune, pins=pins, budget_s=budget_s, quiet=quiet)
        self.plan, report = tuner.tune(workloads)
        self.tune_s, self.tune_cache = time.perf_counter() - t0, "hit" if report.hit else "miss"
        return report

    # -- routing -------------------------------------------------------------------------------
    def _runs_here(self, x: torch.Tensor) -> bool:
        return x.device.type == "cuda" or interpreting()

    def _choose(self, op, shape):
        return self.plan.choose(op, shape) if self.plan is not None else op.default(shape, self.dev)

    def linear(self, x, w, b=None):
        if b is not None or not self._runs_here(x) or not G.OP.supports(x, w):
            return super().linear(x, w, b)
        n, k = w.shape
        x2 = x.reshape(-1, k).contiguous()
        y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
        v = self._choose(G.OP, G.GemmShape(x2.shape[0], n, k))
        if v.p.get("tma") and not G.tma_ok(x2, w, y):
            v = G.OP.default(G.GemmShape(x2.shape[0], n, k), self.dev)
        G.OP.run(v, {"x": x2, "w": w.contiguous()}, {"y": y}, self.plan)
        return y.view(*x.shape[:-1], n)

    def rmsnorm(self, x, w, eps, style="llama"):
        if not self._runs_here(x) or not R.OP.supports(x, w, style):
            return super().rmsnorm(x, w, eps, style)
        y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        v = self._choose(R.OP, R.NormShape(x.numel() // x.shape[-1], x.shape[-1], style))
        R.OP.run(v, {"x": x, "norm_w": w, "eps": eps, "style": style}, {"y": y}, self.plan)
        return y

    def rmsnorm_linear(self, x, norm_w, eps, style, w):
        if not self._runs_here(x) or not RG.OP.supports(x, norm_w, w, style):
            return super().rmsnorm_linear(x, norm_w, eps, style, w)
        n, k = w.shape
        x2 = x.reshape(-1, k).contiguous()
        y = torch.empty((x2.shape[0], n), dtype=x.dtype, device=x.device)
        v = self._choose(RG.OP, RG.NormGemmShape(x2.shape[0], n, k, style))
        RG.OP.run(v, {"x": x2, "norm_w": norm_w, "eps": eps, "style": style, "w": w.contiguous()}, {"y": y}, self.plan)
        return y.view(*x.shape[:-1], n)


def _model_types() -> dict:
    from ...models import MODEL_TYPES
    return MODEL_TYPES
