"""Gemma 4's residual step around its sandwich norms in one launch (NormReference.residual_norms):

  u = norm(a, a_w) + norm(b, b_w)   (TWO: the dense MLP's and the experts' outputs)   else  u = a
  s = x + norm(u, post_w);  s = s * scalar   (SCALAR: layer_scalar)
  y1 = norm(s, w1);  y2 = norm(s, w2);  r = (norm_noscale(s) * router_scale) * H^-0.5   (each optional)

where the reference runs five to twelve torch ops and launches. Every intermediate is rounded to the
activation dtype where the reference's own op rounds it, so the result is the reference's to the
order of the f32 sums of squares. Each program takes ROWS rows whole. The op `residual_norms`: its
shape says which of the optional parts a call has (its form), so each form is tuned, gated and
compiled at load like any op.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...tune.device import interpreting
from ...tune.registry import Op, Variant, register
from ..common import COMMON, SUPPORTED, cdiv, next_pow2, pdl, pdl_wait, rne_flag, round_to
from . import kernels
from .kernels import STYLES, norm_variant, scale_normed, style_scaled


@triton.jit
def normed(xf, wf, eps, D: tl.constexpr, STYLE: tl.constexpr, dtype: tl.constexpr, RNE: tl.constexpr):
    """rmsnorm of rows xf [R, C] (f32, zero past D) by wf [C], rounded to dtype, back in f32."""
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
    return scale_normed(xf, rstd, wf, STYLE, dtype, RNE).to(tl.float32)


@triton.jit
def weight(w_ptr, cols, live):
    return tl.load(w_ptr + cols, mask=live, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["rows"])
def sandwich_kernel(x_ptr, a_ptr, b_ptr, aw_ptr, bw_ptr, pw_ptr, sc_ptr, w1_ptr, w2_ptr, rw_ptr,
                    s_ptr, y1_ptr, y2_ptr, r_ptr, rows, eps, rscale,
                    D: tl.constexpr, BLOCK_D: tl.constexpr, ROWS: tl.constexpr, STYLE: tl.constexpr,
                    RNE: tl.constexpr, TWO: tl.constexpr, SCALAR: tl.constexpr, Y1: tl.constexpr,
                    Y2: tl.constexpr, ROUTER: tl.constexpr, PDL: tl.constexpr = False):
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    live = cols < D
    inside = (row < rows)[:, None] & live[None, :]
    offs = row.to(tl.int64)[:, None] * D + cols[None, :]
    dtype = s_ptr.dtype.element_ty
    pdl_wait(PDL)
    u = tl.load(a_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    if TWO:
        bf = tl.load(b_ptr + offs, mask=inside, other=0.0).to(tl.float32)
        u = normed(u, weight(aw_ptr, cols, live), eps, D, STYLE, dtype, RNE)
        u = round_to(u + normed(bf, weight(bw_ptr, cols, live), eps, D, STYLE, dtype, RNE), dtype, RNE)
        u = u.to(tl.float32)
    xf = tl.load(x_ptr + offs, mask=inside, other=0.0).to(tl.float32)
    s = round_to(xf + normed(u, weight(pw_ptr, cols, live), eps, D, STYLE, dtype, RNE), dtype, RNE).to(tl.float32)
    if SCALAR:
        s = round_to(s * tl.load(sc_ptr).to(tl.float32), dtype, RNE).to(tl.float32)
    tl.store(s_ptr + offs, s.to(dtype), mask=inside)
    rstd = tl.math.rsqrt(tl.sum(s * s, axis=1) / D + eps)
    if Y1:
        tl.store(y1_ptr + offs, scale_normed(s, rstd, weight(w1_ptr, cols, live), STYLE, dtype, RNE), mask=inside)
    if Y2:
        tl.store(y2_ptr + offs, scale_normed(s, rstd, weight(w2_ptr, cols, live), STYLE, dtype, RNE), mask=inside)
    if ROUTER:
        n = round_to(s * rstd[:, None], dtype, RNE).to(tl.float32)
        n = round_to(n * weight(rw_ptr, cols, live)[None, :], dtype, RNE).to(tl.float32)
        tl.store(r_ptr + offs, round_to(n * rscale, dtype, RNE), mask=inside)


@dataclass(frozen=True)
class ResidualShape:
    rows: int          # tokens (runtime)
    d: int             # hidden size (constexpr)
    style: str
    two: bool          # two normed branches summed (the MLP's and the experts')
    scalar: bool       # times layer_scalar
    outs: int          # normed outputs of s: 0, 1 or 2
    router: bool       # and the router's input

    @property
    def key(self) -> tuple:
        return (self.d, self.style, self.two, self.scalar, self.outs, self.router)

    @property
    def form(self) -> str:
        return "".join(n for n, on in (("2", self.two), ("s", self.scalar), ("r", self.router)) if on) + f"y{self.outs}"


def shape_of(x, b, scalar, outs, router, style) -> ResidualShape:
    return ResidualShape(x.numel() // x.shape[-1], x.shape[-1], style, b is not None, scalar is not None, len(outs),
                         router is not None)


def supports(x, a, b, weights) -> bool:
    """One dtype, rows of one width D, every weight [D]."""
    d = x.shape[-1]
    tensors = [t for t in (a, b) if t is not None]
    return (x.dtype in SUPPORTED and all(t.shape == x.shape and t.dtype == x.dtype for t in tensors)
            and all(w.dtype == x.dtype and w.shape[-1] == d and w.numel() == d for w in weights))


def launch(x, a, eps, style, post_w, v: Variant, out: dict, a_w=None, b=None, b_w=None, scalar=None, outs=(),
           router=None) -> None:
    """Writes out["s"] and, as the call has them, out["y0"], out["y1"], out["r"] (all [rows, D])."""
    assert len(outs) <= 2, "at most two normed outputs besides the router's input"
    d = x.shape[-1]
    x, a = x.reshape(-1, d).contiguous(), a.reshape(-1, d).contiguous()
    b = None if b is None else b.reshape(-1, d).contiguous()
    rows, s = x.shape[0], out["s"]
    if rows == 0:
        return
    w0 = post_w                     # a weight (or output) never touched where its flag is off
    weights = (w0 if a_w is None else a_w, w0 if b_w is None else b_w, post_w, w0 if scalar is None else scalar,
               outs[0] if outs else w0,
               outs[1] if len(outs) > 1 else w0, w0 if router is None else router)
    sandwich_kernel[(cdiv(rows, v.p["rows"]),)](
        x, a, x if b is None else b, *weights, s, out.get("y0", s), out.get("y1", s), out.get("r", s), rows, eps,
        d ** -0.5, D=d, BLOCK_D=next_pow2(d), ROWS=v.p["rows"], STYLE=STYLES[style], RNE=rne_flag(x.dtype),
        TWO=b is not None, SCALAR=scalar is not None, Y1=len(outs) > 0, Y2=len(outs) > 1, ROUTER=router is not None,
        num_warps=v.p["w"], **pdl(x))


def output_names(s: ResidualShape) -> list[str]:
    return ["s"] + [f"y{j}" for j in range(s.outs)] + (["r"] if s.router else [])


def residual_norms(x, a, eps, style, post_w, v: Variant, a_w=None, b=None, b_w=None, scalar=None, outs=(),
                   router=None):
    """NormReference.residual_norms in one launch: (s, [norm(s, w) for w in outs] + [router input])."""
    shape = shape_of(x, b, scalar, outs, router, style)
    out = {n: torch.empty(x.shape, dtype=x.dtype, device=x.device) for n in output_names(shape)}
    launch(x, a, eps, style, post_w, v, out, a_w, b, b_w, scalar, outs, router)
    return out["s"], [out[n] for n in output_names(shape)[1:]]


# -- the op: variants, inputs, outputs ------------------------------------------------------------------

TRUSTED = norm_variant(1, 4)        # one row per program
CPU_TRUSTED = norm_variant(16, 4)   # under the interpreter, whose cost is per program


class ResidualNormsOp(Op):
    name = "residual_norms"
    sources = (__file__, kernels.__file__, COMMON)
    shape_type = ResidualShape

    def shape_str(self, s: ResidualShape) -> str:
        return f"{s.rows}x{s.d}_{s.style}_{s.form}"

    def with_rows(self, s: ResidualShape, rows: int) -> ResidualShape:
        return ResidualShape(rows, s.d, s.style, s.two, s.scalar, s.outs, s.router)

    def catalogue(self, s: ResidualShape, dev) -> list[Variant]:
        if dev.capability is None:
            return [CPU_TRUSTED, norm_variant(4, 2)]
        return [norm_variant(r, w) for r in (1, 2, 4) for w in (2, 4, 8, 16)]

    def candidates(self, s: ResidualShape, dev) -> list[Variant]:
        forms = self.catalogue(s, dev)
        if dev.capability is None:
            return forms
        per_thread = lambda v: v.p["rows"] * next_pow2(s.d) / (32 * v.p["w"])  # noqa: E731
        return [v for v in forms if v == TRUSTED or (2 <= per_thread(v) <= 32 and v.p["rows"] <= max(1, s.rows))]

    def trusted(self, s, dev) -> Variant:
        return CPU_TRUSTED if dev.capability is None else TRUSTED

    def default(self, s: ResidualShape, dev) -> Variant:
        return CPU_TRUSTED if dev.capability is None else norm_variant(1, 4 if s.d < 2048 else 8)

    def inputs(self, s: ResidualShape, dtype, device, gen) -> dict:
        """Rows of varied scale; weights near 1 (near 0 for the offset style)."""
        r = lambda *shape: torch.randn(*shape, generator=gen, device=device)  # noqa: E731
        scale = torch.rand(s.rows, 1, generator=gen, device=device) * 4 + 0.25
        shift = 0.0 if s.style == "offset" else 1.0
        w = lambda: (r(s.d) * 0.2 + shift).to(dtype)  # noqa: E731
        return {"x": (r(s.rows, s.d) * 3).to(dtype), "a": (r(s.rows, s.d) * scale).to(dtype), "eps": 1e-6,
                "style": s.style, "post_w": w(), "a_w": w() if s.two else None,
                "b": (r(s.rows, s.d) * 2).to(dtype) if s.two else None, "b_w": w() if s.two else None,
                "scalar": (torch.rand(1, generator=gen, device=device) + 0.25).to(dtype) if s.scalar else None,
                "outs": tuple(w() for _ in range(s.outs)), "router": w() if s.router else None}

    def outputs(self, s: ResidualShape, inputs: dict) -> dict:
        return {n: torch.empty_like(inputs["x"]) for n in output_names(s)}

    def launch(self, v: Variant, inputs: dict, outputs: dict, plan=None) -> None:
        i = inputs
        launch(i["x"], i["a"], i["eps"], i["style"], i["post_w"], v, outputs, i["a_w"], i["b"], i["b_w"], i["scalar"],
               i["outs"], i["router"])

    def compile(self, v: Variant, s: ResidualShape, dtype, device) -> list:
        if interpreting() or v.run is not None:
            return []
        x = torch.empty((1, s.d), dtype=dtype, device=device)
        return [sandwich_kernel.warmup(*([x] * 10), *([x] * 4), 1, 1e-6, 1.0, D=s.d, BLOCK_D=next_pow2(s.d),
                                       ROWS=v.p["rows"], STYLE=STYLES[s.style], RNE=False, TWO=s.two, SCALAR=s.scalar,
                                       Y1=s.outs > 0, Y2=s.outs > 1, ROUTER=s.router, num_warps=v.p["w"], grid=(1,),
                                       **pdl(x))]

    def kernel_sources(self, v: Variant) -> list:
        return [sandwich_kernel, normed, weight, scale_normed, style_scaled, round_to, pdl_wait]


OP = register(ResidualNormsOp())
