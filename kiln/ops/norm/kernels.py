"""RMSNorm over the last dimension D (a model dimension, `tl.constexpr`), rounding where the
reference does (kiln/ops/norm/reference.py):
  "llama":  w * (x * rstd).to(dtype)          (the normed value is rounded before the scale)
  "offset": ((x * rstd) * (1 + w)).to(dtype)  (zero-centred weights: Gemma 3, Qwen3.5)
  "plain":  ((x * rstd) * w).to(dtype)        (Gemma 4)
with rstd = rsqrt(mean(x^2) + eps) in f32. Each program normalises ROWS rows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ...tune.device import interpreting
from ...tune.registry import Op, Variant, register, variant
from ..common import COMMON, SUPPORTED, cdiv, next_pow2, pdl, pdl_wait, rne_flag, round_to

STYLES = {"llama": 0, "offset": 1, "plain": 2}


@triton.jit
def scale_normed(xf, rstd, wf, STYLE: tl.constexpr, dtype: tl.constexpr, RNE: tl.constexpr):
    """Rows xf [R, C] (f32) normed by rstd [R] and scaled by wf [C] (f32), rounded to `dtype` as the
    style says."""
    return style_scaled(xf * rstd[:, None], wf[None, :], STYLE, dtype, RNE)


@triton.jit
def style_scaled(normed, wf, STYLE: tl.constexpr, dtype: tl.constexpr, RNE: tl.constexpr):
    """normed * wf elementwise (f32, any one shape), rounded to `dtype` as the style says."""
    if STYLE == 0:
        y = round_to(round_to(normed, dtype, RNE).to(tl.float32) * wf, dtype, RNE)
    elif STYLE == 1:
        y = round_to(normed * (1.0 + wf), dtype, RNE)
    else:
        y = round_to(normed * wf, dtype, RNE)
    return y


@triton.jit(do_not_specialize=["rows", "stride"])
def rmsnorm_kernel(x_ptr, w_ptr, y_ptr, rows, stride, eps, D: tl.constexpr, BLOCK_D: tl.constexpr,
                   ROWS: tl.constexpr, STYLE: tl.constexpr, RNE: tl.constexpr, r_ptr=None, s_ptr=None,
                   ADD: tl.constexpr = False, PDL: tl.constexpr = False):
    """x [rows, D] with row stride `stride` (last dim contiguous) -> y [rows, D] contiguous. ADD: the
    residual sum s = x + r (r and s contiguous) is rounded, stored, and normalised instead of x."""
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, BLOCK_D)
    inside = (r < rows)[:, None] & (cols < D)[None, :]
    r64 = r.to(tl.int64)
    wf = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    pdl_wait(PDL)
    xf = tl.load(x_ptr + r64[:, None] * stride + cols[None, :], mask=inside, other=0.0).to(tl.float32)
    if ADD:
        xf += tl.load(r_ptr + r64[:, None] * D + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        xs = round_to(xf, s_ptr.dtype.element_ty, RNE)
        tl.store(s_ptr + r64[:, None] * D + cols[None, :], xs, mask=inside)
        xf = xs.to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(xf * xf, axis=1) / D + eps)
    y = scale_normed(xf, rstd, wf, STYLE, y_ptr.dtype.element_ty, RNE)
    tl.store(y_ptr + r64[:, None] * D + cols[None, :], y, mask=inside)


def rows_view(x: torch.Tensor) -> torch.Tensor:
    """x as [rows, D] with a contiguous last dim, a view when the strides allow it."""
    d = x.shape[-1]
    x2 = x.reshape(-1, d)
    return x2 if x2.stride(-1) == 1 else x2.contiguous()


def rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float, style: str, v: Variant,
            y: torch.Tensor | None = None, add: torch.Tensor | None = None, s: torch.Tensor | None = None):
    """y = rmsnorm(x); with `add` (a residual branch shaped like x): s = x + add (rounded, into `s`)
    and y = rmsnorm(s), in one pass."""
    x2 = rows_view(x)
    rows, d = x2.shape
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device) if y is None else y
    if rows == 0:
        return y
    p = v.p
    extra = {} if add is None else {"r_ptr": add.contiguous(), "s_ptr": s, "ADD": True}
    rmsnorm_kernel[(cdiv(rows, p["rows"]),)](x2, w, y, rows, x2.stride(0), eps, D=d, BLOCK_D=next_pow2(d),
                                             ROWS=p["rows"], STYLE=STYLES[style], RNE=rne_flag(x.dtype),
                                             num_warps=p["w"], **extra, **pdl(x2))
    return y


@dataclass(frozen=True)
class NormShape:
    rows: int      # tokens, or tokens x heads (runtime)
    d: int         # normalised dimension (constexpr)
    style: str

    @property
    def key(self) -> tuple:
        return (self.d, self.style)


def norm_variant(rows: int, warps: int) -> Variant:
    return variant(f"r{rows}_w{warps}", rows=rows, w=warps)


TRUSTED = norm_variant(1, 4)        # one row per program
CPU_TRUSTED = norm_variant(64, 4)   # under the interpreter, whose cost is per program


def norm_inputs(rows: int, d: int, style: str, dtype, device, gen) -> dict:
    """Rows of varied scale (so rstd varies); weights near 1 (llama, plain) or near 0 (offset)."""
    scale = torch.rand(rows, 1, generator=gen, device=device) * 4 + 0.25
    x = torch.randn(rows, d, generator=gen, device=device) * scale
    w = torch.randn(d, generator=gen, device=device) * 0.2 + (0.0 if style == "offset" else 1.0)
    return {"x": x.to(dtype), "norm_w": w.to(dtype), "eps": 1e-6, "style": style}


class RmsnormOp(Op):
    name = "rmsnorm"
    sources = (__file__, COMMON)
    shape_type = NormShape

    def shape_str(self, s: NormShape) -> str:
        return f"{s.rows}x{s.d}_{s.style}"

    def with_rows(self, s: NormShape, rows: int) -> NormShape:
        return NormShape(rows, s.d, s.style)

    def catalogue(self, s: NormShape, dev) -> list[Variant]:
        if dev.capability is None:
            return [CPU_TRUSTED, norm_variant(16, 4), norm_variant(256, 4)]
        return [norm_variant(r, w) for r in (1, 2, 4, 8, 16) for w in (1, 2, 4, 8, 16)]

    def candidates(self, s: NormShape, dev) -> list[Variant]:
        per_thread = lambda v: v.p["rows"] * next_pow2(s.d) / (32 * v.p["w"])  # noqa: E731
        forms = self.catalogue(s, dev)
        if dev.capability is None:
            return forms
        return [v for v in forms if v == TRUSTED or (2 <= per_thread(v) <= 32 and v.p["rows"] <= max(1, s.rows))]

    def trusted(self, s, dev) -> Variant:
        return CPU_TRUSTED if dev.capability is None else TRUSTED

    def default(self, s: NormShape, dev) -> Variant:
        if dev.capability is None:
            return CPU_TRUSTED
        return norm_variant(1, 4) if s.d >= 512 else norm_variant(4, 4)

    def inputs(self, s: NormShape, dtype, device, gen) -> dict:
        return norm_inputs(s.rows, s.d, s.style, dtype, device, gen)

    def outputs(self, s: NormShape, inputs: dict) -> dict:
        return {"y": torch.empty_like(inputs["x"])}

    def launch(self, v: Variant, inputs: dict, outputs: dict, plan=None) -> None:
        rmsnorm(inputs["x"], inputs["norm_w"], inputs["eps"], inputs["style"], v, outputs["y"])

    def compile(self, v: Variant, s: NormShape, dtype, device) -> list:
        if interpreting() or v.run is not None:
            return []
        x = torch.empty((1, s.d), dtype=dtype, device=device)
        w = torch.empty((s.d,), dtype=dtype, device=device)
        return [rmsnorm_kernel.warmup(x, w, x, 1, s.d, 1e-6, D=s.d, BLOCK_D=next_pow2(s.d), ROWS=v.p["rows"],
                                      STYLE=STYLES[s.style], RNE=False, num_warps=v.p["w"], grid=(1,), **pdl(x))]

    def kernel_sources(self, v: Variant) -> list:
        return [rmsnorm_kernel, scale_normed, style_scaled, round_to, pdl_wait]

    def supports(self, x: torch.Tensor, w: torch.Tensor, style: str) -> bool:
        return x.dtype in SUPPORTED and w.dtype == x.dtype and style in STYLES and w.shape == x.shape[-1:]


OP = register(RmsnormOp())
