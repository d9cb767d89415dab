"""RMSNorm fused into the GEMM that follows it: y = rmsnorm(x, norm_w, eps, style) @ w^T.

The fused kernel computes each row block's rstd in a first pass over K, then normalises, scales
and rounds the x tiles as they are loaded for the tensor cores (the same rounding as the
rmsnorm kernel, so the fused and unfused forms agree up to the GEMM's summation order). The
unfused form (the rmsnorm kernel, then the GEMM, each as the plan chose) is a variant too: the
tuner keeps whichever measures faster.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...tune.device import device_info, interpreting
from ...tune.registry import Op, Variant, register, variant
from ..common import SUPPORTED, dot_flags, rne_flag, round_to
from ..norm import kernels as norm_kernels
from . import gemm


@triton.jit(do_not_specialize=["M"])
def rmsnorm_gemm_kernel(x_ptr, nw_ptr, w_ptr, y_ptr, M, eps, N: tl.constexpr, K: tl.constexpr, BM: tl.constexpr,
                        BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, STYLE: tl.constexpr,
                        UPCAST: tl.constexpr, IEEE: tl.constexpr, RNE: tl.constexpr):
    pid_m, pid_n = gemm.tile_of(tl.program_id(0), M, BM, N, BN, GROUP_M)
    rm = pid_m * BM + tl.arange(0, BM)
    rn = pid_n * BN + tl.arange(0, BN)
    rk = tl.arange(0, BK)
    xs = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * K + rk[None, :]
    ws = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[None, :] * K + rk[:, None]
    EVEN: tl.constexpr = K % BK == 0
    sq = tl.zeros((BM,), dtype=tl.float32)
    for k in range(0, K, BK):                       # pass 1: sum of squares of each row
        xf = tl.load(xs + k, mask=(rk + k < K)[None, :], other=0.0).to(tl.float32)
        sq += tl.sum(xf * xf, axis=1)
    rstd = tl.math.rsqrt(sq / K + eps)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    for k in range(0, K, BK):                       # pass 2: normed x tiles into the tensor cores
        if EVEN:
            xf = tl.load(xs).to(tl.float32)
            b = tl.load(ws)
        else:
            xf = tl.load(xs, mask=(rk + k < K)[None, :], other=0.0).to(tl.float32)
            b = tl.load(ws, mask=(rk + k < K)[:, None], other=0.0)
        wf = tl.load(nw_ptr + k + rk, mask=rk + k < K, other=0.0).to(tl.float32)
        a = norm_kernels.scale_normed(xf, rstd, wf, STYLE, dtype, RNE)
        acc = gemm.mma(acc, a, b, UPCAST, IEEE)
        xs += BK
        ws += BK
    keep = (rm < M)[:, None] & (rn < N)[None, :]
    tl.store(y_ptr + rm.to(tl.int64)[:, None] * N + rn[None, :], round_to(acc, dtype, RNE), mask=keep)


def rmsnorm_gemm(x: torch.Tensor, nw: torch.Tensor, eps: float, style: str, w: torch.Tensor, v: Variant,
                 y: torch.Tensor | None = None) -> torch.Tensor:
    """The fused kernel; x [M, K] contiguous, w [N, K]."""
    (m, k), n = x.shape, w.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device) if y is None else y
    if m == 0:
        return y
    p = v.p
    rmsnorm_gemm_kernel[(gemm.tiles(m, n, p),)](x, nw, w, y, m, eps, N=n, K=k, BM=p["bm"], BN=p["bn"], BK=p["bk"],
                                                GROUP_M=gemm.GROUP_M, STYLE=norm_kernels.STYLES[style],
                                                RNE=rne_flag(x.dtype), **dot_flags(x.dtype), num_warps=p["w"],
                                                num_stages=p["s"])
    return y


@dataclass(frozen=True)
class NormGemmShape:
    rows: int     # M, tokens (runtime)
    n: int
    k: int
    style: str
    add: bool = False     # rmsnorm(x + r), and s = x + r written (the residual stream)

    @property
    def key(self) -> tuple:
        return (self.n, self.k, self.style) + (("add",) if self.add else ())

    def parts(self) -> tuple[norm_kernels.NormShape, gemm.GemmShape]:
        return norm_kernels.NormShape(self.rows, self.k, self.style), gemm.GemmShape(self.rows, self.n, self.k)


def fused_variant(bm, bn, bk, w, s) -> Variant:
    return variant(f"fused_bm{bm}_bn{bn}_bk{bk}_w{w}_s{s}", bm=bm, bn=bn, bk=bk, w=w, s=s)


def unfused(inputs: dict, outputs: dict, plan, trusted: bool = False) -> None:
    """The rmsnorm kernel, then the GEMM, with the plan's choices (or the trusted ones)."""
    x, nw, w, eps, style, r = (inputs.get(k) for k in ("x", "norm_w", "w", "eps", "style", "r"))
    norm_shape, gemm_shape = NormGemmShape(x.shape[0], w.shape[0], x.shape[1], style).parts()
    dev = plan.dev if plan is not None else device_info(x.device)
    if trusted:
        nv, gv = norm_kernels.OP.trusted(norm_shape, dev), gemm.OP.trusted(gemm_shape, dev)
    elif plan is None:
        nv, gv = norm_kernels.OP.default(norm_shape, dev), gemm.OP.default(gemm_shape, dev)
    else:
        nv, gv = plan.choose(norm_kernels.OP, norm_shape), plan.choose(gemm.OP, gemm_shape)
    if gv.p.get("tma") and not gemm.tma_ok(x, w, outputs["y"]):
        gv = gemm.OP.default(gemm_shape, dev)
    h = torch.empty_like(x)
    if r is None:
        norm_kernels.OP.run(nv, {"x": x, "norm_w": nw, "eps": eps, "style": style}, {"y": h}, plan)
    else:
        norm_kernels.rmsnorm(x, nw, eps, style, nv, y=h, add=r, s=outputs["s"])
    gemm.OP.run(gv, {"x": h, "w": w}, {"y": outputs["y"]}, plan)


UNFUSED = variant("unfused", run=unfused)
UNFUSED_TRUSTED = variant("unfused_trusted", run=lambda i, o, plan: unfused(i, o, plan, trusted=True))
GPU_TILES = [(128, 128, 64, 8, 3), (128, 64, 64, 4, 4), (64, 128, 64, 4, 4), (64, 64, 64, 4, 4),
             (64, 32, 128, 4, 4), (16, 64, 128, 4, 4), (16, 128, 128, 4, 3), (16, 256, 64, 4, 3)]
CPU_TILES = [(128, 128, 32, 4, 1), (16, 128, 64, 4, 1)]


class RmsnormGemmOp(Op):
    name = "rmsnorm_gemm"
    sources = (__file__, *gemm.GemmOp.sources)   # gemm.py's own sources included
    shape_type = NormGemmShape

    def accepts(self, s: NormGemmShape) -> bool:
        return not (s.add and interpreting())   # the interpreter: the add + norm GEMV is tested on its own

    def shape_str(self, s: NormGemmShape) -> str:
        return f"{s.rows}x{s.n}x{s.k}_{s.style}" + ("_add" if s.add else "")

    def with_rows(self, s: NormGemmShape, rows: int) -> NormGemmShape:
        return NormGemmShape(rows, s.n, s.k, s.style, s.add)

    def catalogue(self, s, dev) -> list[Variant]:
        tiles = [] if s.add else (CPU_TILES if dev.capability is None else GPU_TILES)
        forms = [UNFUSED_TRUSTED, UNFUSED] + [fused_variant(*t) for t in tiles]
        if s.rows == 1 and s.add and dev.capability is None:   # (the LM head's shape: the interpreter is slow on it)
            forms += [gemm.gemv_variant(*g) for g in gemm.CPU_GEMV]
        elif s.rows == 1 and dev.capability is not None:   # the GEMV with the norm in its prologue (kept where it wins)
            forms += [gemm.gemv_variant(*g, whole=whole) for g in gemm.GEMV_FORMS for whole in (False, True)]
        return forms

    def candidates(self, s, dev) -> list[Variant]:
        forms = [v for v in self.catalogue(s, dev) if v.run is not None or v.p.get("gemv") or gemm.fits(s, v.p)]
        if dev.capability is None:
            return forms
        return [v for v in forms if v.run is not None or (
            gemm.gemv_worth(s, v.p, dev.sms) and (not v.p["whole"] or gemm.whole_fits(s, v.p)) if v.p.get("gemv")
            else gemm.worth_measuring(s, v.p, dev.sms))]

    def trusted(self, s, dev) -> Variant:
        return UNFUSED_TRUSTED

    def default(self, s, dev) -> Variant:
        return UNFUSED

    def inputs(self, s: NormGemmShape, dtype, device, gen) -> dict:
        d = norm_kernels.norm_inputs(s.rows, s.k, s.style, dtype, device, gen)
        d["w"] = (torch.randn(s.n, s.k, generator=gen, device=device) * s.k ** -0.5).to(dtype)
        if s.add:
            d["r"] = torch.randn(s.rows, s.k, generator=gen, device=device).to(dtype)
        return d

    def outputs(self, s, inputs: dict) -> dict:
        x = inputs["x"]
        out = {"y": torch.empty((x.shape[0], inputs["w"].shape[0]), dtype=x.dtype, device=x.device)}
        if inputs.get("r") is not None:
            out["s"] = torch.empty_like(x)
        return out

    def launch(self, v: Variant, inputs: dict, outputs: dict, plan=None) -> None:
        if v.p.get("gemv"):
            norm = {"w": inputs["norm_w"], "eps": inputs["eps"], "style": inputs["style"], "r": inputs.get("r"),
                    "s": outputs.get("s")}
            gemm.gemm(inputs["x"], inputs["w"], v, outputs["y"], norm=norm)
            return
        rmsnorm_gemm(inputs["x"], inputs["norm_w"], inputs["eps"], inputs["style"], inputs["w"], v, outputs["y"])

    def compile(self, v: Variant, s: NormGemmShape, dtype, device) -> list:
        """Tile forms ahead of time; the GEMV forms compile at their first (gate) run."""
        if interpreting() or v.run is not None or v.p.get("gemv"):
            return []
        x = torch.empty((1, s.k), dtype=dtype, device=device)
        w = torch.empty((s.n, s.k), dtype=dtype, device=device)
        y = torch.empty((1, s.n), dtype=dtype, device=device)
        p = v.p
        return [rmsnorm_gemm_kernel.warmup(x, x[0], w, y, 1, 1e-6, N=s.n, K=s.k, BM=p["bm"], BN=p["bn"], BK=p["bk"],
                                           GROUP_M=gemm.GROUP_M, STYLE=norm_kernels.STYLES[s.style], RNE=False,
                                           **dot_flags(dtype), num_warps=p["w"], num_stages=p["s"], grid=(1,))]

    def kernel_sources(self, v: Variant) -> list:
        if v.run is not None:
            return []
        if v.p.get("gemv"):
            return gemm.OP.kernel_sources(v)
        return [rmsnorm_gemm_kernel, gemm.tile_of, gemm.mma, norm_kernels.scale_normed, norm_kernels.style_scaled,
                round_to]

    def supports(self, x, nw, w, style) -> bool:
        return x.dtype in SUPPORTED and nw.dtype == x.dtype and w.dtype == x.dtype and style in norm_kernels.STYLES


OP = register(RmsnormGemmOp())
